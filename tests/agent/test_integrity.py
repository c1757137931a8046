"""Integrity of what is loaded and generated (issue 22, points 1, 9 and 11; issue 20, point 7):
crops that never collide and images checked against their records before training, corrupt
checkpoints refused with one line, resumed and sharded rollouts that sample what an
uninterrupted run samples, and replies streamed token by token."""

from __future__ import annotations

import hashlib
import os

import pytest

from marscli.agent.loop import Agent, AgentConfig, safe_name
from marscli.errors import BadInput
from marscli.records.schema import Prompt

from helpers import ZOOM_THEN_ANSWER, picture, trajectory
from scripted import ScriptedEngine

# ----------------------------------------------------------------------------- crops (22.9)


def test_safe_name_is_injective_on_long_and_sanitised_ids():
    long_a, long_b = "p" * 80 + "#0", "p" * 80 + "#1"  # the same first 80 characters
    assert safe_name(long_a) != safe_name(long_b)
    assert safe_name("q17#3") == "q17#3"  # a clean id keeps its name
    assert safe_name("a/b") != safe_name("a_b") == "a_b"  # changed vs kept
    assert safe_name("../x") != safe_name("x")
    digest = hashlib.sha256(long_a.encode()).hexdigest()[:16]
    assert safe_name(long_a) == "p" * 80 + "+" + digest
    assert all("/" not in safe_name(s) and not safe_name(s).startswith(".")
               for s in ("../../etc", ".hidden", "", "a/b/c"))


def test_crops_of_ids_sharing_80_characters_do_not_overwrite_each_other(processor, tmp_path):
    engine = ScriptedEngine(processor, ZOOM_THEN_ANSWER)
    agent = Agent(engine, _tools(), AgentConfig(max_turns=3), media_dir=tmp_path / "media",
                  rel_to=tmp_path)
    stem = "x" * 90
    prompts = [Prompt(id=f"{stem}{k}", question="What colour?", answer=["red"], base=tmp_path,
                      images=[picture(tmp_path / f"in{k}.png", (128, 96), seed=k).name])
               for k in range(2)]
    recs = list(agent.run([(p, 0) for p in prompts]))
    crops = [r["images"][1] for r in recs]
    assert crops[0]["path"] != crops[1]["path"]
    for c in crops:  # each record's crop is still the file it hashed
        assert hashlib.sha256((tmp_path / c["path"]).read_bytes()).hexdigest() == c["sha256"]


def _tools():
    from marscli.tools import build_tools

    return build_tools()


# ----------------------------------------------------------------------------- image hashes


@pytest.fixture(scope="module")
def spec(processor, tiny_model):
    from marscli.train.batch import Spec

    return Spec.of(processor, str(tiny_model))


def _row_with_hashes(folder, processor) -> dict:
    row = trajectory(folder, processor, 0, crop=(64, 64))
    for ref in row["images"]:
        ref["sha256"] = hashlib.sha256((folder / ref["path"]).read_bytes()).hexdigest()
    return row


def test_training_refuses_an_image_whose_sha256_changed(processor, spec, tmp_path):
    from marscli.train.batch import load_example

    row = _row_with_hashes(tmp_path, processor)
    assert load_example(row, "adv.jsonl", 4, tmp_path, spec).images  # intact: accepted
    crop = tmp_path / row["images"][1]["path"]
    picture(crop, (64, 64), seed=99)  # same size, other pixels: placeholders still agree
    with pytest.raises(BadInput, match=r"^adv\.jsonl:4: images\[1\]\.sha256: .*t0-1\.png: the "
                                       r"file's sha256 is .* the record's"):
        load_example(row, "adv.jsonl", 4, tmp_path, spec)
    no_hash = trajectory(tmp_path, processor, 1)  # refs without sha256 (message rows)
    assert load_example(no_hash, "sft.jsonl", 1, tmp_path, spec)


def test_each_image_is_hashed_once_per_process(processor, spec, tmp_path, monkeypatch):
    import marscli.train.batch as batch

    calls = []
    real = batch.sha256_file
    monkeypatch.setattr(batch, "sha256_file", lambda p: calls.append(p) or real(p))
    row = _row_with_hashes(tmp_path, processor)
    for line in range(1, 6):  # G samples of one prompt, or epochs, share the files
        batch.load_example(row, "adv.jsonl", line, tmp_path, spec)
    assert len(calls) == 2


# ----------------------------------------------------------------------------- checkpoints (22.1)


def _copy(tiny_model, folder, name):
    import shutil

    d = folder / name
    shutil.copytree(tiny_model, d)
    return d


def _edit_config(d, **text):
    import json

    cfg = json.loads((d / "config.json").read_text())
    cfg["text_config"].update(text)
    (d / "config.json").write_text(json.dumps(cfg))


def _edit_weights(d, drop=(), add=None):
    from safetensors.torch import load_file, save_file

    sd = load_file(d / "model.safetensors")
    for k in drop:
        del sd[k]
    sd.update(add or {})
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})


def _raw_header(d, header: bytes, length: int | None = None):
    """Replace model.safetensors' header by `header` (its length field: `length`)."""
    import struct

    f = d / "model.safetensors"
    blob = f.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    f.write_bytes(struct.pack("<Q", len(header) if length is None else length) + header
                  + blob[8 + n:])


@pytest.fixture(scope="module")
def bad_ckpts(tiny_model, tmp_path_factory):
    """Damaged copies of the tiny model, by what is wrong with them."""
    import json
    import struct

    import torch

    root = tmp_path_factory.mktemp("bad-ckpt")
    d = {k: _copy(tiny_model, root, k) for k in (
        "missing", "extra", "more_layers", "fewer_layers", "shape", "huge_header",
        "header_not_json", "lying_offsets", "short_data", "config_json", "tokenizer_json",
        "tokenizer_shape", "master_missing")}
    _edit_weights(d["missing"], drop=["model.language_model.layers.1.mlp.down_proj.weight"])
    _edit_weights(d["extra"], add={"model.language_model.layers.9.mlp.up_proj.weight":
                                   torch.zeros(4, 4)})
    _edit_config(d["more_layers"], num_hidden_layers=3)
    _edit_config(d["fewer_layers"], num_hidden_layers=1)
    _edit_config(d["shape"], intermediate_size=512)
    _raw_header(d["huge_header"], b"{}", length=10**15)
    _raw_header(d["header_not_json"], b"\xff" * 64)
    blob = (d["lying_offsets"] / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    lying = dict(header)
    lying[name] = {**header[name], "data_offsets": [0, 10**12]}
    _raw_header(d["lying_offsets"], json.dumps(lying).encode())
    short = dict(header)
    a, b = header[name]["data_offsets"]
    short[name] = {**header[name], "data_offsets": [a, b - 4]}
    _raw_header(d["short_data"], json.dumps(short).encode())
    (d["config_json"] / "config.json").write_text('{"model_type": "qwen3_vl", ')
    tok = d["tokenizer_json"] / "tokenizer.json"
    tok.write_text(tok.read_text()[:4000])
    (d["tokenizer_shape"] / "tokenizer.json").write_text('{"version": "1.0"}')
    from safetensors.torch import load_file, save_file

    state = d["master_missing"] / "train_state"
    state.mkdir()
    sd = load_file(d["master_missing"] / "model.safetensors")
    sd.pop("model.visual.merger.norm.weight")
    save_file(sd, state / "master.safetensors", metadata={"format": "pt"})
    return d


@pytest.mark.parametrize("case, match", [
    ("huge_header", r"model\.safetensors: not a valid safetensors file \(header length "
                    r"1000000000000000 but the file has \d+ bytes\)"),
    ("header_not_json", r"model\.safetensors: not a valid safetensors file \(the header is "
                        r"not JSON\)"),
    ("lying_offsets", r"model\.safetensors: truncated safetensors file .* ends at byte"),
    ("short_data", r"model\.safetensors: .*bytes of data for a F32 tensor of shape"),
    ("config_json", r"config\.json: not valid JSON \(.* at line 1\)"),
    ("tokenizer_json", r"tokenizer\.json: not valid JSON"),
])
def test_damaged_files_are_refused_before_loading(bad_ckpts, case, match):
    from marscli.qwen.policy import check_checkpoint

    with pytest.raises(BadInput, match=match) as e:
        check_checkpoint(str(bad_ckpts[case]))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("case, match", [
    ("missing", r"1 weight\(s\) missing from the weights: "
                r"model\.language_model\.layers\.1\.mlp\.down_proj\.weight — "),
    ("extra", r"1 weight\(s\) in the weights but not in config.json's model: "
              r"model\.language_model\.layers\.9\.mlp\.up_proj\.weight"),
    ("more_layers", r"11 weight\(s\) missing from the weights: model\.language_model\.layers\.2"
                    r"\.[^,]+, .*\(\+8 more\)"),
    ("fewer_layers", r"11 weight\(s\) in the weights but not in config.json's model: "
                     r"model\.language_model\.layers\.1\."),
    ("shape", r"6 weight\(s\) of another shape than config.json says: "
              r"model\.language_model\.layers\.0\.mlp\.down_proj\.weight \[128, 256\] vs "
              r"\[128, 512\]"),
])
def test_weights_that_disagree_with_config_are_refused(bad_ckpts, case, match, capfd):
    from marscli.qwen.policy import check_checkpoint, load_model

    path = check_checkpoint(str(bad_ckpts[case]))  # the files themselves are sound
    with pytest.raises(BadInput, match=match) as e:
        load_model(path)
    assert "\n" not in str(e.value)
    err = capfd.readouterr().err
    assert "LOAD REPORT" not in err and "Loading weights" not in err  # our line, not its table


def test_a_tokenizer_transformers_cannot_use_is_one_line(bad_ckpts):
    from marscli.qwen.policy import check_checkpoint, load_processor

    with pytest.raises(BadInput, match=r"cannot load the tokenizer or processor \(") as e:
        load_processor(check_checkpoint(str(bad_ckpts["tokenizer_shape"])))
    assert "\n" not in str(e.value)


def test_incomplete_fp32_masters_are_refused(bad_ckpts):
    from marscli.train.distributed import Dist
    from marscli.train.trainer import build_model

    with pytest.raises(BadInput, match=r"train_state/master\.safetensors: 1 fp32 master\(s\) "
                                       r"missing: model\.visual\.merger\.norm\.weight"):
        build_model(str(bad_ckpts["master_missing"]), Dist())


def test_sound_checkpoint_loads_with_nothing_on_stderr(tiny_model):
    """In a fresh process: transformers' handler binds stderr once, so in-process capture
    would miss what a user sees (its "Loading weights" bar, its tables and warnings)."""
    import subprocess
    import sys

    code = ("import sys; from marscli.qwen.policy import load_model; "
            "from transformers.utils import logging as l; "
            f"m = load_model({str(tiny_model)!r}); "
            "assert l.is_progress_bar_enabled() and not m.training; print('ok')")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert res.returncode == 0 and res.stdout == "ok\n", res.stderr
    assert res.stderr == ""


def test_rollout_and_update_exit_2_on_a_checkpoint_with_a_missing_tensor(bad_ckpts, tmp_path,
                                                                         processor):
    from helpers import invoke, write_jsonl, write_prompts

    prompts = write_prompts(tmp_path / "p.jsonl", ["a"])
    code, _, err = invoke(["rollout", str(prompts), "-o", str(tmp_path / "t.jsonl"),
                             "--policy", str(bad_ckpts["missing"])])
    assert code == 2, err
    assert err.count("\n") == 1 and "missing from the weights" in err
    assert not (tmp_path / "t.jsonl").exists() or not (tmp_path / "t.jsonl").read_text()
    adv = write_jsonl(tmp_path / "adv.jsonl", [trajectory(tmp_path, processor, 0)])
    code, _, err = invoke(["update", str(adv), "--policy", str(bad_ckpts["missing"]),
                             "--out", str(tmp_path / "ckpt-1")])
    assert code == 2, err
    assert err.count("\n") == 1 and "missing from the weights" in err
    assert not (tmp_path / "ckpt-1").exists()


# ----------------------------------------------------------------------------- seeds (22.11)

ROLLOUT = {"n": 4, "max_turns": 2, "max_turn_tokens": 8, "batch_size": 8, "seed": 5,
           "temperature": 1.0, "progress": False}


class _Killed(BaseException):
    """Stands for a kill -9: nothing in marscli catches it."""


@pytest.fixture(scope="module")
def seeded_runs(tiny_model, tmp_path_factory):
    """8 prompts × 4 samples with the hf engine: uninterrupted, killed after 12 records and
    resumed (the rest then batched differently), and as 2 shards."""
    import marscli.agent.loop
    from marscli.stages.rollout import run_rollout

    from helpers import read_jsonl, strip_ms, write_prompts

    tmp = tmp_path_factory.mktemp("seeds")
    picture(tmp / "scene.png", (64, 64), seed=3)  # small: few image tokens to prefill
    prompts = write_prompts(tmp / "p.jsonl", [f"q{i}" for i in range(8)])
    kw = {"policy": str(tiny_model), **ROLLOUT}

    def records(*files) -> dict:
        return {r["id"]: _split_logprobs(strip_ms(r)) for f in files for r in read_jsonl(f)}

    (tmp / "whole").mkdir()
    run_rollout(str(prompts), str(tmp / "whole" / "t.jsonl"), **kw)
    (tmp / "resumed").mkdir()
    real, made = marscli.agent.loop.Agent._record, []

    def dies_after_12(self, t):
        if len(made) == 12:
            raise _Killed
        made.append(t.id)
        return real(self, t)

    marscli.agent.loop.Agent._record = dies_after_12
    try:
        with pytest.raises(_Killed):
            run_rollout(str(prompts), str(tmp / "resumed" / "t.jsonl"), **kw)
    finally:
        marscli.agent.loop.Agent._record = real
    assert len(read_jsonl(tmp / "resumed" / "t.jsonl")) == 12
    run_rollout(str(prompts), str(tmp / "resumed" / "t.jsonl"), **kw)
    shards = []
    for i in range(2):
        (tmp / f"shard{i}").mkdir()
        shards.append(tmp / f"shard{i}" / "t.jsonl")
        run_rollout(str(prompts), str(shards[-1]), shard=(i, 2), **kw)
    return (records(tmp / "whole" / "t.jsonl"), records(tmp / "resumed" / "t.jsonl"),
            records(*shards))


LOGPROB_TOL = 1e-5  # measured: ≤ 1e-6 between batch compositions (padding widths differ)


def _split_logprobs(rec: dict) -> tuple[dict, list[float]]:
    """(the record without its model segments' log-probs, those log-probs in order): the
    log-probs of a row depend on its batch's padding in their last bits, nothing else may."""
    lps = [x for s in rec["segments"] for x in (s.get("logprobs") or [])]
    segs = [{k: v for k, v in s.items() if k != "logprobs"} for s in rec["segments"]]
    return {**rec, "segments": segs}, lps


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k][0] == b[k][0], k  # tokens, text, tools, stops: exactly
        assert len(a[k][1]) == len(b[k][1]) and max(
            (abs(x - y) for x, y in zip(a[k][1], b[k][1])), default=0) < LOGPROB_TOL, k


def test_resumed_rollout_samples_what_an_uninterrupted_one_does(seeded_runs):
    whole, resumed, _ = seeded_runs
    assert len(whole) == 32
    tokens = {k: [s["tokens"] for s in r["segments"] if s["role"] == "model"]
              for k, (r, _) in whole.items()}
    assert len({str(v) for v in tokens.values()}) == 32  # really sampled, every sample its own
    _same(resumed, whole)


def test_sharded_rollout_samples_what_one_run_does(seeded_runs):
    whole, _, sharded = seeded_runs
    _same(sharded, whole)


# ----------------------------------------------------------------------------- streaming (20.7)


def test_stream_decoder_holds_back_split_characters_and_adds_up(processor):
    from marscli.qwen.tokens import StreamDecoder, special_ids

    tok = processor.tokenizer
    text = "héllo 世界 ✓\nsecond line, red square\n\nend"
    ids = tok.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # characters split across tokens
    dec = StreamDecoder(tok, special_ids(tok).im_end)
    pieces = [dec.push([i]) for i in ids] + [dec.push([special_ids(tok).im_end])]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text and dec.rest(text) == ""
    assert sum(1 for p in pieces if p) > 10  # really piece by piece
    held = StreamDecoder(tok, special_ids(tok).im_end)
    assert held.push(ids[:1]) == "h"
    assert held.push(ids[1:2]) == ""  # half of "é": held back
    assert held.push(ids[2:3]) == "é" and held.rest(text) == text[2:]


class _Listener:
    def __init__(self, wants_text: bool = True) -> None:
        self.events: list[tuple[str, int, dict]] = []
        if not wants_text:
            self.wants_text = False

    def __call__(self, kind, traj, data) -> None:
        self.events.append((kind, traj.turns, data))


def _ask_once(tiny_model, tmp_path, listener, engine=None):
    from marscli.engines import SamplingParams
    from marscli.engines.hf import HFEngine

    engine = engine or HFEngine(str(tiny_model), device="cpu")
    cfg = AgentConfig(max_turns=2, max_turn_tokens=24, sampling=SamplingParams(seed=1))
    agent = Agent(engine, _tools(), cfg, media_dir=tmp_path / "media", rel_to=tmp_path,
                  on_event=listener)
    prompt = Prompt(id="ask", question="What colour?", answer=[], base=tmp_path,
                    images=[picture(tmp_path / "in.png", (64, 64), seed=1).name])
    return next(agent.run([(prompt, 0)])), engine


def test_hf_replies_stream_as_text_events_that_add_up_to_each_turn(tiny_model, tmp_path):
    listener = _Listener()
    rec, engine = _ask_once(tiny_model, tmp_path, listener)
    kinds = [k for k, _, _ in listener.events]
    assert kinds.count("model") == rec["turns"] >= 1
    turn_text, pieces, replies = "", 0, 0
    for kind, turns, data in listener.events:
        if kind == "text":
            assert data["delta"] and turns == replies  # `turns`: finished replies only
            turn_text += data["delta"]
            pieces += 1
        elif kind == "model":
            replies += 1
            assert turns == replies and turn_text == data["text"]  # pieces first, adding up
            turn_text = ""
    assert pieces > rec["turns"]  # more than one piece a turn: streamed, not dumped
    quiet = _Listener(wants_text=False)
    (tmp_path / "q").mkdir()
    _ask_once(tiny_model, tmp_path / "q", quiet, engine)
    assert "text" not in [k for k, _, _ in quiet.events] and quiet.events


def test_engines_that_do_not_stream_send_no_text_events(processor, tmp_path):
    listener = _Listener()
    rec, _ = _ask_once(None, tmp_path, listener, ScriptedEngine(processor, ZOOM_THEN_ANSWER))
    kinds = [k for k, _, _ in listener.events]
    assert "text" not in kinds and kinds.count("model") == rec["turns"] == 2


def test_padding_rows_past_the_tokenizer_are_never_sampled():
    """Qwen3-VL pads 151,669 token names to 151,936 embedding rows: the engines ban the rest
    (with the vision placeholders), and a vocabulary without padding bans placeholders only."""
    from marscli.qwen.tokens import SpecialIds, never_sampled

    ids = SpecialIds(im_start=1, im_end=2, pad=0, image_pad=5, video_pad=6, vision_start=3,
                     vision_end=4)
    assert never_sampled(ids, 151_669, 151_936) == [5, 6, 3, 4, *range(151_669, 151_936)]
    assert never_sampled(ids, 100, 100) == never_sampled(ids, 100, None) == [5, 6, 3, 4]


def test_checkpoint_writers_keep_transformers_bars_out_of_logs(tmp_path, tiny_model):
    """`tiny-model` and `sft` write shards through transformers, whose "Writing model shards"
    bar would land in every Slurm log: stderr holds marscli's own lines only."""
    from marscli.qwen.policy import load_processor

    from helpers import invoke, write_jsonl

    code, _, err = invoke(["tiny-model", str(tmp_path / "m")])
    assert code == 0 and "Writing model shards" not in err and "it/s" not in err, err
    d = write_jsonl(tmp_path / "d.jsonl", [trajectory(tmp_path, load_processor(str(tiny_model)),
                                                      0)])
    code, _, err = invoke(["sft", str(d), "--policy", str(tiny_model), "--out",
                           str(tmp_path / "o"), "--epochs", "1"])
    assert code == 0 and "Writing model shards" not in err and "Loading weights" not in err, err
