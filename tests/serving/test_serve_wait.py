"""`scripts/serve-wait.py` against a fake `squeue` on PATH: a server array job is alive while
every task is pending or running, and its timeout counts from when the tasks run (issue 52)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from fakes import FakeServer, always

ROOT = Path(__file__).resolve().parents[2]
# The fake prints the lines of STATES_DIR/<n> on its n-th call (the last file repeats), and on
# the call that first prints RUNNING moves the url files of STATES_DIR/urls into the URL folder,
# as servers that start only once their task runs.
FAKE_SQUEUE = """#!/bin/sh
d=$FAKE_SQUEUE_DIR
n=$(cat "$d/calls" 2>/dev/null || echo 0); n=$((n + 1)); echo $n > "$d/calls"
f="$d/$n"; [ -f "$f" ] || f=$(ls "$d" | grep -E '^[0-9]+$' | sort -n | tail -1 | sed "s|^|$d/|")
if grep -q RUNNING "$f" && [ -d "$d/urls" ]; then mv "$d/urls"/* "$URL_DIR"/; rmdir "$d/urls"; fi
cat "$f"
"""


def serve_wait(tmp: Path, states: list[str], servers: list[FakeServer], *args: str,
               timeout: float = 60) -> subprocess.CompletedProcess:
    """Run serve-wait on a job whose squeue states are `states` call after call; the servers'
    url files appear when the job first runs."""
    bin_dir, fake, url_dir = tmp / "bin", tmp / "squeue", tmp / "serve"
    for d in (bin_dir, fake / "urls", url_dir):
        d.mkdir(parents=True)
    (bin_dir / "squeue").write_text(FAKE_SQUEUE)
    (bin_dir / "squeue").chmod(0o755)
    for i, text in enumerate(states, 1):
        (fake / str(i)).write_text(text)
    for i, s in enumerate(servers):
        (fake / "urls" / f"{i}.url").write_text(s.url + "\n")
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "FAKE_SQUEUE_DIR": str(fake), "URL_DIR": str(url_dir)}
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "serve-wait.py"), str(url_dir),
                           "--count", str(len(servers)), "--job", "4242", *args],
                          env=env, capture_output=True, text=True, timeout=timeout)


def health() -> FakeServer:
    return FakeServer({"/health": always(200, {"policy": "ckpt-0"})})


def test_an_array_of_two_running_servers_is_alive(tmp_path):
    """squeue lists one line per task: two RUNNING lines are a live job, not a dead one."""
    with health() as a, health() as b:
        r = serve_wait(tmp_path, ["RUNNING\nRUNNING\n"], [a, b], "--timeout", "30")
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == [a.url, b.url]


def test_time_pending_in_the_queue_is_not_counted_in_the_timeout(tmp_path):
    """Three polls pending (about 3 s) then running: a 1.5 s timeout is not spent in the queue,
    and the wait says how long the job pended."""
    with health() as a, health() as b:
        r = serve_wait(tmp_path, ["PENDING\n", "PENDING\n", "PENDING\nRUNNING\n",
                                  "RUNNING\nRUNNING\n"], [a, b], "--timeout", "1.5")
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == [a.url, b.url]
        assert "s pending" in r.stderr


def test_a_failed_task_ends_the_wait(tmp_path):
    with health() as a:
        r = serve_wait(tmp_path, ["RUNNING\nFAILED\n"], [a, a], "--timeout", "30")
        assert r.returncode == 1
        assert "a server ended before it answered" in r.stderr


def test_a_job_gone_from_the_queue_ends_the_wait(tmp_path):
    with health() as a:
        r = serve_wait(tmp_path, ["PENDING\n", ""], [a], "--timeout", "30")
        assert r.returncode == 1
        assert "a server ended before it answered" in r.stderr


def test_the_pending_timeout_bounds_the_queue(tmp_path):
    with health() as a:
        r = serve_wait(tmp_path, ["PENDING\n"], [a], "--pending-timeout", "1.5")
        assert r.returncode == 1
        assert "still pending after" in r.stderr and "squeue -j 4242" in r.stderr
