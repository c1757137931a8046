"""Run a benchmark several times and print every `key=value` it printed as the mean and the
95% interval over the runs (Student's t): how the README's performance numbers are made.

    python bench/repeat.py --runs 3 -- .venv/bin/python bench/bench_update.py

Each run's output goes to stderr as it comes; a key printed twice in one run counts once (the
last value).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

from marscli.toy.summary import mean_ci  # one place for the interval

PAIR = re.compile(r"\b([a-z_]+)=(-?\d+(?:\.\d+)?)\b")


def values(output: str) -> dict[str, float]:
    return {k: float(v) for k, v in PAIR.findall(output)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the benchmark command")
    args = ap.parse_args()
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd or args.runs < 1:
        ap.error("usage: repeat.py [--runs N] -- COMMAND...")
    runs: list[dict[str, float]] = []
    for i in range(args.runs):
        res = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        sys.stderr.write(res.stdout)
        if res.returncode != 0:
            print(f"repeat: run {i + 1} exited {res.returncode}", file=sys.stderr)
            return res.returncode
        runs.append(values(res.stdout))
    for key in dict.fromkeys(k for run in runs for k in run):
        xs = [run.get(key) for run in runs]
        mean, half = mean_ci(xs)
        ci = "" if half is None else f" ± {half:g}"
        each = ", ".join("-" if x is None else f"{x:g}" for x in xs)
        print(f"{key}: {mean:g}{ci} (runs: {each})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
