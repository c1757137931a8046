"""Start-up, measured in one run beside a reference:

1. `marscli --help` beside `python -c "import torch"` (goal: --help at most 0.15 s);
2. a model stage's start-up, `marscli rollout` of 1 prompt x 1 token on the demo's tiny VLM
   (imports, processor and model loading: the generation itself takes 0.1 s), beside one
   tiny-recipe iteration (`make rl-iter RECIPE=recipes/tiny-sees.mk`, from that VLM as ckpt-0;
   the world is built first and not counted). Goal: start-up at most 20% of the iteration.

    python bench/bench_startup.py [--no-iteration]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "recipes/tiny-sees.mk"


def wall(cmd: list[str], repeats: int = 5, **kw) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True, **kw)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_help() -> None:
    help_s = wall([sys.executable, "-m", "marscli", "--help"])
    torch_s = wall([sys.executable, "-c", "import torch"])
    print(f"startup: marscli --help {help_s:.3f} s | import torch {torch_s:.3f} s | "
          f"ratio {help_s / torch_s:.2f} (median of 5)")
    print(f"startup: help_s={help_s:.3f} (goal: at most 0.15 s)")


def bench_stage(run: Path) -> None:
    make = ["make", "-s", f"RECIPE={RECIPE}", f"RUN={run}"]
    shutil.copytree(ROOT / "recipes" / "tiny-vlm", run / "ckpt-0")
    subprocess.run(make + [f"{run}/world.meta.json", f"{run}/world/text.sqlite.meta.json"],
                   cwd=ROOT, check=True, capture_output=True)
    one = run / "one.jsonl"
    one.write_text((run / "world" / "train.jsonl").read_text().splitlines()[0] + "\n")
    out = run / "one-out.jsonl"
    rollout = [sys.executable, "-m", "marscli", "rollout", str(one), "--policy",
               str(run / "ckpt-0"), "-o", str(out), "--force", "-n", "1", "--max-turns", "1",
               "--max-turn-tokens", "1", "--system-prompt", "recipes/toy-system.txt",
               "--image-dir", str(run / "world")]
    start = wall(rollout, repeats=3, cwd=ROOT)
    t0 = time.perf_counter()  # -o: ckpt-0 is the VLM itself, not an SFT model to be made
    subprocess.run(make + ["rl-iter", "ITER=0", "-o", f"{run}/ckpt-0/config.json"], cwd=ROOT,
                   check=True, capture_output=True)
    iteration = time.perf_counter() - t0
    print(f"startup: rollout of 1 prompt x 1 token {start:.2f} s (median of 3) | one "
          f"{RECIPE} iteration {iteration:.1f} s")
    print(f"startup: stage_startup_s={start:.2f} iteration_s={iteration:.1f} "
          f"stage_startup_ratio={start / iteration:.3f} (goal: at most 0.20)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-iteration", action="store_true", help="--help only")
    args = ap.parse_args()
    bench_help()
    if not args.no_iteration:
        with tempfile.TemporaryDirectory() as tmp:
            bench_stage(Path(tmp))


if __name__ == "__main__":
    main()
