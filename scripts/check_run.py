"""Check that one RL iteration's artifacts exist and validate (CI runs it after a Slurm
`make rl-iter`). usage: python scripts/check_run.py RUN ITER [WORLD] (the toy world whose images
the prompts name; default RUN/world)"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from marscli.records.jsonl import get_field, read_rows
from marscli.records.schema import load_prompts, parse_segments


def check(run: Path, k: int, world: Path | None = None) -> list[str]:
    it = run / f"iter-{k}"
    done: list[str] = []
    prompts = load_prompts(str(it / "prompts.jsonl"), image_dir=world or run / "world")
    done.append(f"prompts.jsonl: {len(prompts)} prompts")
    for name in ("rollouts", "scored", "advantages"):
        path = str(it / f"{name}.jsonl")
        rows = read_rows(path)
        ids = [get_field(r, "id", str, path, n) for n, r in rows]
        assert len(ids) == len(set(ids)), f"{path}: duplicate ids"
        assert {r["prompt_id"] for _, r in rows} <= {p.id for p in prompts}, (
            f"{path}: stray prompt ids"
        )
        for n, r in rows:
            parse_segments(r, path, n)
            if name != "rollouts":
                total = get_field(r, "reward.total", (int, float), path, n)
                assert math.isfinite(total)
            if name == "advantages":
                assert math.isfinite(get_field(r, "advantage", (int, float), path, n))
        assert Path(path + ".meta.json").is_file(), f"{path}: no sidecar"
        assert not Path(path + ".partial").exists(), f"{path}.partial: left by a failed run"
        done.append(f"{name}.jsonl: {len(rows)} records")
    metrics = read_rows(str(it / "metrics.jsonl"))
    assert all("loss" in r for _, r in metrics)
    done.append(f"metrics.jsonl: {len(metrics)} steps")

    from transformers import AutoModelForImageTextToText, AutoProcessor

    ckpt = run / f"ckpt-{k + 1}"
    AutoModelForImageTextToText.from_pretrained(ckpt)
    AutoProcessor.from_pretrained(ckpt)
    done.append(f"{ckpt.name}: loads")
    leftovers = list(run.rglob("*.tmp-*"))
    assert not leftovers, f"temporary files left: {leftovers[:3]}"
    return done


if __name__ == "__main__":
    world = Path(sys.argv[3]) if len(sys.argv) > 3 else None
    for line in check(Path(sys.argv[1]), int(sys.argv[2]), world):
        print(f"ok  {line}")
