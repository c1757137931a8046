#!/usr/bin/env python3
"""Fingerprints of a demo run's artifacts, stage by stage, to find where two machines part.

usage: scripts/fingerprint.py RUN [--check REFERENCE.json] [--write REFERENCE.json]

`make demo` gives other numbers on another machine of the same kind (docs/demo.md "Same numbers
on another machine"). The stages run in order — world, base model, expert trajectories, SFT
weights, SFT losses, the SFT model's evaluation, RL iteration 0's rollouts, ckpt-1 — so the
first stage whose fingerprint differs from the reference is where the two machines part;
everything after it differs because of it. Trajectory files are fingerprinted by their tokens
and answers only (timings differ on every run); weights by their bytes. `--check` prints each
stage as same / DIFFERS / missing and exits 1 at a difference; `--write` records this run's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path


def _files(h: hashlib._Hash, paths: list[Path], root: Path) -> None:
    for p in paths:
        h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes())


def _records(h: hashlib._Hash, path: Path) -> None:
    """Token ids, log-probs rounded to 1e-4, stops and answers, in id order."""
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    for r in sorted(rows, key=lambda r: r["id"]):
        segs = [[s.get("role"), s.get("tokens"), [round(x, 4) for x in s.get("logprobs") or []]]
                for s in r.get("segments", [])]
        h.update(json.dumps([r["id"], segs, r.get("final_answer"), r.get("stop")]).encode())


def fingerprints(run: Path) -> dict[str, str | None]:
    stages: dict[str, tuple] = {
        "world": ("files", sorted((run / "world").glob("*.jsonl"))
                  + sorted((run / "world" / "images").glob("*.png"))),
        "base weights": ("files", [run / "base" / "model.safetensors"]),
        "base tokenizer": ("files", [run / "base" / "tokenizer.json"]),
        "expert trajectories": ("records", run / "sft" / "trajectories.jsonl"),
        "sft losses": ("losses", run / "sft" / "metrics.jsonl"),
        "ckpt-0 weights": ("files", [run / "ckpt-0" / "model.safetensors"]),
        "ckpt-0 eval": ("records", run / "eval" / "ckpt-0.jsonl"),
        "iter-0 rollouts": ("records", run / "iter-0" / "rollouts.jsonl"),
        "ckpt-1 weights": ("files", [run / "ckpt-1" / "model.safetensors"]),
    }
    out: dict[str, str | None] = {}
    for name, (kind, what) in stages.items():
        h = hashlib.sha256()
        paths = what if isinstance(what, list) else [what]
        if not paths or not all(p.is_file() for p in paths):
            out[name] = None
            continue
        if kind == "files":
            _files(h, paths, run)
        elif kind == "records":
            _records(h, what)
        else:  # the SFT loss curve, rounded: where the weights start to drift
            rows = [json.loads(x) for x in what.read_text().splitlines() if x.strip()]
            h.update(json.dumps([round(r["loss"], 5) for r in rows if "loss" in r]).encode())
        out[name] = h.hexdigest()[:16]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--check", type=Path)
    ap.add_argument("--write", type=Path)
    args = ap.parse_args()
    got = fingerprints(args.run)
    if args.write:
        args.write.write_text(json.dumps(got, indent=2) + "\n")
    if not args.check:
        print(json.dumps(got, indent=2))
        return 0
    want = json.loads(args.check.read_text())
    for name, value in got.items():
        ref = want.get(name)
        state = ("missing" if value is None or ref is None
                 else "same" if value == ref else "DIFFERS")
        print(f"{name:22s} {state}")
        if state == "DIFFERS":
            print(f"fingerprint: the runs part at {name!r} (everything after follows from it)",
                  file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
