"""`make bench`: run every benchmarks/bench_*.py in turn; each prints its own ratios."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ORDER = ["startup", "advantages", "search", "rollout", "update"]


def main() -> int:
    here = Path(__file__).parent
    found = {p.stem.removeprefix("bench_"): p for p in here.glob("bench_*.py")}
    names = [n for n in ORDER if n in found] + sorted(set(found) - set(ORDER))
    failed = 0
    for name in names:
        print(f"== {name}", flush=True)
        res = subprocess.run([sys.executable, str(found[name])])
        failed += res.returncode != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
