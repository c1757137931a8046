"""scripts/fingerprint.py: where two demo runs part, stage by stage."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from helpers import ROOT

SCRIPT = ROOT / "scripts" / "fingerprint.py"


def fake_run(root: Path) -> Path:
    (root / "world" / "images").mkdir(parents=True)
    (root / "world" / "train.jsonl").write_text('{"id": "a"}\n')
    (root / "world" / "images" / "s.png").write_bytes(b"png")
    for d in ("base", "ckpt-0", "ckpt-1", "sft", "eval", "iter-0"):
        (root / d).mkdir()
    for d in ("base", "ckpt-0", "ckpt-1"):
        (root / d / "model.safetensors").write_bytes(d.encode())
    (root / "base" / "tokenizer.json").write_text("{}")
    (root / "sft" / "metrics.jsonl").write_text('{"step": 1, "loss": 1.234567891}\n')
    rec = {"id": "q#0", "segments": [{"role": "model", "tokens": [1, 2], "logprobs": [-0.5]}],
           "stop": "answer", "final_answer": "red", "ms": {"generate": 3}}
    for f in ("sft/trajectories.jsonl", "eval/ckpt-0.jsonl", "iter-0/rollouts.jsonl"):
        (root / f).write_text(json.dumps(rec) + "\n")
    return root


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          check=False, timeout=60)


def test_check_names_the_first_stage_that_differs(tmp_path):
    a = fake_run(tmp_path / "a")
    ref = tmp_path / "ref.json"
    assert run(str(a), "--write", str(ref)).returncode == 0
    assert run(str(a), "--check", str(ref)).returncode == 0
    # timings differ on every run and are not fingerprinted; an answer is
    rec = json.loads((a / "eval/ckpt-0.jsonl").read_text())
    (a / "eval/ckpt-0.jsonl").write_text(json.dumps({**rec, "ms": {"generate": 9}}) + "\n")
    assert run(str(a), "--check", str(ref)).returncode == 0
    (a / "ckpt-0" / "model.safetensors").write_bytes(b"other weights")
    (a / "ckpt-1" / "model.safetensors").write_bytes(b"other too")
    p = run(str(a), "--check", str(ref))
    assert p.returncode == 1 and "ckpt-0 weights         DIFFERS" in p.stdout
    assert "ckpt-1" not in p.stdout  # the first difference only: the rest follows from it
    assert "part at 'ckpt-0 weights'" in p.stderr
