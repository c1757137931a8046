"""bench/repeat.py, which makes the README's performance numbers: the mean and Student's t
95% interval of every `key=value` over the runs, computed by hand here, and a failing run
stops it with that run's exit status."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

REPEAT = Path(__file__).resolve().parents[2] / "bench" / "repeat.py"

# Run k (counted in a file) prints ratio=k and, once, a key only the second run has.
COUNTER = """
import pathlib, sys
p = pathlib.Path(sys.argv[1]); k = int(p.read_text()) + 1 if p.exists() else 1
p.write_text(str(k))
print(f"noise line\\nbench: ratio={k} seconds={0.5 * k:.1f}" + (" only=7" if k == 2 else ""))
"""


def repeat(tmp_path: Path, *extra: str, runs: int = 3) -> subprocess.CompletedProcess:
    script = tmp_path / "bench.py"
    script.write_text(COUNTER)
    return subprocess.run([sys.executable, str(REPEAT), "--runs", str(runs), "--", sys.executable,
                           str(script), str(tmp_path / "count"), *extra],
                          capture_output=True, text=True)


def test_mean_and_interval_over_runs(tmp_path):
    res = repeat(tmp_path)
    assert res.returncode == 0, res.stderr
    lines = dict(line.split(": ", 1) for line in res.stdout.splitlines())
    half = 4.303 * 1.0 / math.sqrt(3)  # values 1, 2, 3: sd 1, t(0.975, 2 dof) 4.303
    assert lines["ratio"] == f"2 ± {round(half, 3):g} (runs: 1, 2, 3)"
    assert lines["seconds"] == f"1 ± {round(half / 2, 3):g} (runs: 0.5, 1, 1.5)"
    assert lines["only"] == "7 (runs: -, 7, -)"  # one value: no interval
    assert "noise line" in res.stderr  # each run's output, as it came


def test_a_failing_run_stops_with_its_status(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import sys; print('x=1'); sys.exit(3)")
    res = subprocess.run([sys.executable, str(REPEAT), "--", sys.executable, str(script)],
                         capture_output=True, text=True)
    assert res.returncode == 3
    assert "run 1 exited 3" in res.stderr and res.stdout == ""
