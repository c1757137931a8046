"""`marscli --help` start-up beside `python -c "import torch"`, measured in the same run."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time


def wall(cmd: list[str], repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    help_s = wall([sys.executable, "-m", "marscli", "--help"])
    torch_s = wall([sys.executable, "-c", "import torch"])
    print(f"startup: marscli --help {help_s:.3f} s | import torch {torch_s:.3f} s | "
          f"ratio {help_s / torch_s:.2f} (median of 5)")


if __name__ == "__main__":
    main()
