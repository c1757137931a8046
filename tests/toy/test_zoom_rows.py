"""scripts/zoom_rows.py: the expert's perception trajectories, replayed through the real agent
and tools by `marscli rollout`, cut after the zoom call token for token; rows `marscli sft`
trains on; a bad row is a one-line error, exit 2, nothing written."""

from __future__ import annotations

import json
import subprocess
import sys

from marscli.toy.world import build_world

from helpers import ROOT, marscli

SCRIPT = [sys.executable, str(ROOT / "scripts" / "zoom_rows.py")]


def lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_zoom_rows_are_the_replayed_zoom_turns_and_sft_trains_on_them(tiny_model, tmp_path):
    w = tmp_path / "w"
    # --direct is drawn per attribute: 0.5 leaves one of colour's two rows without a zoom
    build_world(w, seed=3, entities=6, train=1, test=1, sft=8, size=512, grid=4, zoom_cells=2,
                kinds=("perception", "knowledge"), direct=0.5)
    res = marscli("index", "text", str(w / "corpus.jsonl"), "-o", str(w / "t.sqlite"))
    assert res.returncode == 0, res.stderr
    traj = tmp_path / "traj.jsonl"
    res = marscli("rollout", str(w / "sft.jsonl"), "--policy", str(tiny_model), "-o", str(traj),
                  "--engine", "replay", "-n", "1", "--system-prompt",
                  str(ROOT / "recipes" / "toy-system.txt"), "--image-search", "data",
                  "--text-search", f"local:{w / 't.sqlite'}")
    assert res.returncode == 0, res.stderr
    got = subprocess.run([*SCRIPT, str(traj)], capture_output=True, text=True, check=False)
    assert got.returncode == 0, got.stderr
    rows = [json.loads(x) for x in got.stdout.splitlines()]
    full = lines(traj)
    zooms = [r for r in full if r["category"] == "perception" and r["turns"] == 2]
    direct = [r for r in full if r["category"] == "perception" and r["turns"] == 1]
    assert zooms and direct  # the world's direct share: perception answered without a zoom
    assert [r["id"] for r in rows] == [r["id"] for r in zooms]  # knowledge and direct rows out
    for z, r in zip(rows, zooms):
        assert z["segments"] == r["segments"][:2] and z["images"] == r["images"][:1]
        model = z["segments"][1]
        assert model["role"] == "model" and model["tokens"] == r["segments"][1]["tokens"]
        call = json.loads(model["text"].split("<tool_call>")[1].split("</tool_call>")[0])
        assert call["name"] == "image_zoom_in_tool"
        assert call["arguments"]["bbox_2d"] == r["toy"]["zoom_box"]
    zoom = tmp_path / "zoom.jsonl"
    zoom.write_text(got.stdout)
    res = marscli("sft", str(zoom), "--policy", str(tiny_model), "--out", str(tmp_path / "p"),
                  "--epochs", "1", "--batch-size", "2", "--lr", "1e-4")
    assert res.returncode == 0, res.stderr
    steps = lines(tmp_path / "p" / "metrics.jsonl")
    assert len(steps) == -(-len(rows) // 2)  # every row loads and trains


def test_a_bad_row_names_file_line_and_field_and_writes_nothing(tmp_path):
    good = {"category": "knowledge", "segments": []}
    bad = {"category": "perception", "segments": [{"role": "prompt", "tokens": [1]}]}
    f = tmp_path / "t.jsonl"
    f.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    got = subprocess.run([*SCRIPT, str(f)], capture_output=True, text=True, check=False)
    assert got.returncode == 2 and got.stdout == ""
    assert got.stderr.strip() == f"zoom_rows: {f}:2: segments: no model segment"
    f.write_text("{not json\n")
    got = subprocess.run([*SCRIPT, str(f)], capture_output=True, text=True, check=False)
    assert got.returncode == 2 and got.stdout == "" and f"{f}:1: not valid JSON" in got.stderr
