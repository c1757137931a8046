"""`marscli index` and `marscli search` at the process boundary: exit codes, stdout, files."""

from __future__ import annotations

import os
import subprocess
import sys

import orjson
import pytest
from PIL import Image, ImageDraw

from marscli.tools.search import query_text


def run(*args, cwd, env_extra=None):
    env = {**os.environ, "MARSCLI_CACHE_DIR": str(cwd / "cache"), **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "marscli", *args], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=120, check=False)


def write_jsonl(path, rows):
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))


CORPUS = [{"id": i, "title": t, "text": x} for i, (t, x) in enumerate([
    ("Mars", "Mars is the fourth planet from the Sun, with two moons, Phobos and Deimos."),
    ("Venus", "Venus is the second planet from the Sun and the hottest one."),
    ("Olympus Mons", "Olympus Mons is a shield volcano on Mars, the tallest in the Solar System."),
])]


def test_index_text_then_search(tmp_path):
    write_jsonl(tmp_path / "corpus.jsonl", CORPUS)
    r = run("index", "text", "corpus.jsonl", "-o", "idx/text.sqlite", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "" and "3 documents" in r.stderr
    meta = orjson.loads((tmp_path / "idx/text.sqlite.meta.json").read_bytes())
    assert meta["stage"] == "index text" and meta["stats"] == {"documents": 3}
    r = run("search", "tallest volcano on mars", "--text-search", "local:idx/text.sqlite",
            "--k", "2", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("[1] Olympus Mons\n")
    expected = query_text("tallest volcano on mars", f"local:{tmp_path}/idx/text.sqlite", k=2)
    assert r.stdout == expected.text + "\n"
    r = run("search", "venus", "--text-search", "local:idx/text.sqlite", "--json", cwd=tmp_path)
    out = orjson.loads(r.stdout)
    assert out["ok"] and out["text"].startswith("[1] Venus") and out["images"] == []


def test_bad_corpus_row_exits_2_with_one_line_and_no_index(tmp_path):
    write_jsonl(tmp_path / "corpus.jsonl", CORPUS + [{"id": 9, "title": "x", "text": 5}])
    r = run("index", "text", "corpus.jsonl", "-o", "text.sqlite", cwd=tmp_path)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        "error: corpus.jsonl:4: text: expected str, got int"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl"]


@pytest.mark.parametrize("args,code,msg", [
    (["search"], 2, "either a QUERY"),
    (["search", "q"], 2, "--text-search"),
    (["search", "q", "--text-search", "bing"], 2, "choose one of: local, retriever, serper"),
    (["search", "q", "--text-search", "local:nope.sqlite"], 2, "marscli index text"),
    (["search", "q", "--text-search", "serper"], 2, "SERPER_API_KEY"),
    (["search", "q", "--text-search", "retriever:http://127.0.0.1:9", "--no-cache"], 1,
     "search failed"),
    (["index", "text", "missing.jsonl", "-o", "x.sqlite"], 2, "missing.jsonl: no such file"),
    (["index", "images", "nowhere", "-o", "x.sqlite"], 2, "nowhere: no such file"),
])
def test_usage_errors(tmp_path, args, code, msg):
    r = run(*args, cwd=tmp_path, env_extra={"SERPER_API_KEY": ""})
    assert r.returncode == code, r.stderr
    assert msg in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("opts, message", [
    ({"k": 0}, "--k: 0 is out of range — must be >= 1 and <= 100"),
    ({"max_chars": 1 << 25}, "--max-chars: 33554432 is out of range"),
    ({}, "give either a QUERY"),
])
def test_search_options_are_checked_by_the_stage(opts, message):
    from marscli.errors import BadInput
    from marscli.stages.search import main

    with pytest.raises(BadInput, match=message):
        main(None if not opts else "q", **opts)


def test_index_images_then_search(tmp_path):
    (tmp_path / "pics").mkdir()
    for i, color in enumerate(["red", "green", "blue", "yellow"]):
        im = Image.new("RGB", (200, 150), color)
        ImageDraw.Draw(im).ellipse([20 + 30 * i, 10, 120 + 20 * i, 140 - 20 * i], fill="white")
        im.save(tmp_path / "pics" / f"{color}_disc.png")
    r = run("index", "images", "pics", "-o", "images.sqlite", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    Image.open(tmp_path / "pics/blue_disc.png").resize((100, 75)).save(tmp_path / "q.png")
    r = run("search", "--image", "q.png", "--image-search", "local:images.sqlite", "--json",
            cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = orjson.loads(r.stdout)
    assert out["images"][0] == {"title": "blue disc",
                                "thumbnail": str(tmp_path / "pics/blue_disc.png")}
    assert out["text"].splitlines()[1] == "[1] blue disc <image>"


def test_search_data_backend_from_a_row(tmp_path):
    Image.new("RGB", (32, 32), "red").save(tmp_path / "t.png")
    write_jsonl(tmp_path / "rows.jsonl", [
        {"v": 1, "id": "a"},
        {"v": 1, "id": "b", "image_search": [{"title": "Red square", "thumbnail": "t.png"}]}])
    r = run("search", "--row", "rows.jsonl:2", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "Reverse image search results:\n[1] Red square <image>\n"
    r = run("search", "--row", "rows.jsonl", cwd=tmp_path)
    assert r.stdout == "No matching images were found.\n"
