"""JSONL reading/writing at the edges: FILE:LINE: field errors, atomic output, resumable
appends, sidecars without secrets, MARS-style rows converted."""

from __future__ import annotations

import os
from pathlib import Path

import orjson
import pytest

from marscli.errors import BadInput
from marscli.records.jsonl import get_field, iter_rows, read_rows
from marscli.records.outputs import AppendJsonl, AtomicJsonl
from marscli.records.schema import load_prompts, parse_segments
from marscli.records.sidecar import write_sidecar


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("text,msg", [
    ('{"v": 1, "id": "a"}\n{"v": 1, "id": ', ":2: not valid JSON (truncated last line?)"),
    ('{"v": 1}\nnot json\n', ":2: not valid JSON"),
    ('[1, 2]\n', ":1: expected a JSON object"),
    ('{"v": 2, "id": "a"}\n', ":1: v: unknown schema version 2"),
])
def test_bad_jsonl_names_file_and_line(tmp_path, text, msg):
    p = write(tmp_path / "in.jsonl", text)
    with pytest.raises(BadInput) as e:
        list(iter_rows(p))
    assert str(e.value).startswith(p) and msg in str(e.value)


def test_empty_input_and_missing_file(tmp_path):
    with pytest.raises(BadInput, match="empty input"):
        read_rows(write(tmp_path / "e.jsonl", "\n\n"))
    with pytest.raises(BadInput, match="no such file"):
        read_rows(str(tmp_path / "nope.jsonl"))
    with pytest.raises(BadInput, match="is a folder"):
        read_rows(str(tmp_path))


def test_get_field_types():
    row = {"reward": {"total": 1.5, "flag": True}}
    assert get_field(row, "reward.total", (int, float), "f", 3) == 1.5
    with pytest.raises(BadInput, match=r"^f:3: reward\.flag: expected int or float, got bool$"):
        get_field(row, "reward.flag", (int, float), "f", 3)
    with pytest.raises(BadInput, match=r"^f:3: reward\.nope: missing required field$"):
        get_field(row, "reward.nope", (int, float), "f", 3)


def test_atomic_output_keeps_old_file_on_failure(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text("old\n")
    with pytest.raises(RuntimeError), AtomicJsonl(str(out)) as w:
        w.write({"v": 1, "id": "x"})
        raise RuntimeError("boom")
    assert out.read_text() == "old\n" and list(tmp_path.iterdir()) == [out]
    with AtomicJsonl(str(out)) as w:
        w.write({"v": 1, "id": "x", "n": float("1.5")})
    assert orjson.loads(out.read_bytes()) == {"v": 1, "id": "x", "n": 1.5}


def test_append_cuts_torn_tail_and_knows_ids(tmp_path):
    out = tmp_path / "t.jsonl"
    out.write_bytes(b'{"id": "a"}\n{"id": "b"}\n{"id": "c", "seg')
    with AppendJsonl(str(out)) as w:
        assert w.ids == {"a", "b"}
        w.write({"id": "c"})
    assert [r["id"] for _, r in iter_rows(str(out))] == ["a", "b", "c"]


def test_sidecar_redacts_secrets(tmp_path, monkeypatch):
    monkeypatch.setenv("SERPER_API_KEY", "SENTINEL-123")
    out = tmp_path / "o.jsonl"
    out.write_text("")
    write_sidecar(str(out), stage="t",
                  config={"api_key": "SENTINEL-123", "url": "x?k=SENTINEL-123"},
                  inputs=[str(out)], stats={"n": 1})
    meta = (tmp_path / "o.jsonl.meta.json").read_text()
    assert "SENTINEL" not in meta and '"stage": "t"' in meta and "sha256" not in meta
    assert orjson.loads(meta)["inputs"][str(out)]


def test_prompts_marscli_and_mars_style(tmp_path):
    rows = [
        {"v": 1, "id": "q1", "image": "a.jpg", "question": "Q?", "answer": ["x", "y"],
         "choices": ["A. x", "B. y"], "category": "c", "extra_field": 7},
        {"prompt": [{"role": "user", "content": "<image>Who made it?"}], "image": ["b.jpg"],
         "reward_model": {"ground_truth": ["Kelo", "K."]}, "extra_info": {"index": 12},
         "image_search_title_list": ["t1"], "image_search_thumbnail_list": ["th/1.jpg"]},
    ]
    p = write(tmp_path / "p.jsonl", "".join(orjson.dumps(r).decode() + "\n" for r in rows))
    a, b = load_prompts(p)
    assert (a.id, a.answer, a.choices, a.category, a.extra) == (
        "q1", ["x", "y"], ["A. x", "B. y"], "c", {"extra_field": 7})
    assert a.image_paths() == [tmp_path / "a.jpg"]
    assert (b.id, b.question, b.images, b.answer) == (
        "12", "Who made it?", ["b.jpg"], ["Kelo", "K."])
    assert b.image_search == [{"title": "t1", "thumbnail": "th/1.jpg"}]


@pytest.mark.parametrize("row,msg", [
    ({"v": 1, "image": "a.jpg", "question": "Q"}, ":1: id: missing required field"),
    ({"v": 1, "id": "a", "image": "a.jpg"}, ":1: question: missing required field"),
    ({"v": 1, "id": "a", "question": "Q"}, ":1: image: missing required field"),
    ({"v": 1, "id": "a", "question": "Q", "image": 3}, ":1: image: expected a string or a list"),
    ({"v": 1, "id": "a", "question": "Q", "image": "x", "choices": "AB"},
     ":1: choices: expected a list"),
])
def test_prompt_field_errors(tmp_path, row, msg):
    p = write(tmp_path / "p.jsonl", orjson.dumps(row).decode() + "\n")
    with pytest.raises(BadInput, match=msg):
        load_prompts(p)


def test_duplicate_prompt_ids(tmp_path):
    r = '{"v": 1, "id": "a", "question": "Q", "image": "x"}\n'
    with pytest.raises(BadInput, match=r":2: id: duplicate id 'a' \(first on line 1\)"):
        load_prompts(write(tmp_path / "p.jsonl", r + r))


def test_segments_validation():
    ok = {"segments": [{"role": "prompt", "tokens": [1, -4, 2]},
                       {"role": "model", "tokens": [5, 6], "logprobs": [-0.1, -0.2]}]}
    assert [s.role for s in parse_segments(ok, "f", 1)] == ["prompt", "model"]
    with pytest.raises(BadInput, match="f:1: segments: no model segment"):
        parse_segments({"segments": [{"role": "prompt", "tokens": [1]}]}, "f", 1)
    with pytest.raises(BadInput, match=r"segments\[1\]\.logprobs: expected one number per token"):
        parse_segments({"segments": [ok["segments"][0],
                                     {"role": "model", "tokens": [5], "logprobs": []}]}, "f", 1)
    with pytest.raises(BadInput, match=r"segments\[0\]\.role"):
        parse_segments({"segments": [{"role": "user", "tokens": []}]}, "f", 1)


def test_no_temp_files_left(tmp_path):
    with AtomicJsonl(str(tmp_path / "x.jsonl")) as w:
        w.write({"id": 1})
    assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f]


def test_redact_keeps_ordinary_keys():
    from marscli.secrets import redact

    cfg = {"api_key": "s", "X-API-KEY": "s", "password": "p", "max_new_tokens": 8,
           "num_key_value_heads": 1, "pad_token_id": 0}
    assert redact(cfg) == {"api_key": "<redacted>", "X-API-KEY": "<redacted>",
                           "password": "<redacted>", "max_new_tokens": 8,
                           "num_key_value_heads": 1, "pad_token_id": 0}
