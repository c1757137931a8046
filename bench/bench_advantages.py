"""Time `marscli advantages` on 10,000 rows (a subprocess, start-up included) beside
`python -c "import torch"`, measured in the same run, and print the ratio.

The stage must stay numpy-only: if it ever imports torch, the ratio jumps above 1.

    python bench/bench_advantages.py [--rows 10000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import orjson


def best_of(cmd: list[str], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=10_000, help="scored rows to generate")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt")
    ap.add_argument("--repeat", type=int, default=3, help="runs per command; the best counts")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "scored.jsonl", Path(tmp) / "adv.jsonl"
        rewards = rng.choice([0.0, 0.5, 1.0, 1.5], args.rows).tolist()
        src.write_bytes(b"".join(
            orjson.dumps({"v": 1, "id": f"q{i // args.group}#{i % args.group}",
                          "prompt_id": f"q{i // args.group}", "reward": {"total": r},
                          "segments": [{"role": "model", "tokens": list(range(64))}]}) + b"\n"
            for i, r in enumerate(rewards)))
        stage = best_of([sys.executable, "-m", "marscli", "advantages", str(src), "-o", str(out)],
                        args.repeat)
        torch = best_of([sys.executable, "-c", "import torch"], args.repeat)
    print(f"marscli advantages, {args.rows} rows: {stage:.3f} s")
    print(f"python -c 'import torch':        {torch:.3f} s")
    print(f"ratio (advantages / import torch): {stage / torch:.2f}")
    print(f"advantages: seconds={stage:.3f} goal_ratio={stage / 0.3:.2f} (goal: at most 0.3 s)")


if __name__ == "__main__":
    main()
