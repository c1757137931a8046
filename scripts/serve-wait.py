#!/usr/bin/env python3
"""Wait until the COUNT `marscli serve` processes that write URL_DIR/0.url ... answer GET
/health; print their URLs, one a line, in index order.

usage: scripts/serve-wait.py URL_DIR [--count N] [--pid PID ... | --job SLURM_JOB_ID]
                              [--timeout S] [--pending-timeout S]

Exits 1 when a server's process (any --pid, or the Slurm job) ends first, or after the timeout,
so that `make rl SERVE=1` never waits on a server that failed to start. Standard library only.

A Slurm job (`--job`, an array of one task per server) is alive while every task squeue lists
is PENDING, CONFIGURING or RUNNING; a task in any other state (FAILED, CANCELLED, COMPLETING,
...) or no task listed at all means a server ended. The timeout counts from when every task
runs: time pending in the queue is reported, not counted, unless --pending-timeout bounds it
(default: wait as long as the queue holds the job).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

LIVE = ("PENDING", "CONFIGURING", "RUNNING")


def job_states(job: str) -> list[str]:
    """The state of each task of `job` as squeue lists it (an array: one line per task, the
    tasks still pending possibly on one line); [] once the job has left the queue."""
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True,
                         text=True, check=False).stdout
    return [line.strip() for line in out.splitlines() if line.strip()]


def status(pids: list[int], job: str | None) -> str:
    """"ended" when a server's process or task has ended (or failed), "pending" while some
    task of the job waits in the queue, else "running"."""
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "ended"
    if job is None:
        return "running"
    states = job_states(job)
    if not states or any(s not in LIVE for s in states):
        return "ended"
    return "running" if all(s == "RUNNING" for s in states) else "pending"


def answers(url_file: Path) -> str | None:
    """The URL in `url_file` when the server there answers /health, else None."""
    if not url_file.is_file():
        return None
    url = url_file.read_text().strip()
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
            policy = json.load(r)["policy"]
    except OSError:
        return None
    print(f"serve-wait: {url} holds {policy}", file=sys.stderr)
    return url


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("url_dir", type=Path)
    ap.add_argument("--count", type=int, default=1)
    ap.add_argument("--pid", type=int, action="append", default=[])
    ap.add_argument("--job")
    ap.add_argument("--timeout", type=float, default=900.0,
                    help="seconds the servers have to answer once they run")
    ap.add_argument("--pending-timeout", type=float, default=None,
                    help="seconds the job may wait in the queue (default: no limit)")
    args = ap.parse_args()
    started = time.monotonic()
    deadline = None  # set when the servers run: time in the queue is not theirs to start in
    urls: dict[int, str] = {}
    while deadline is None or time.monotonic() < deadline:
        state = status(args.pid, args.job)
        if state == "ended":
            print(f"serve-wait: a server ended before it answered ({args.url_dir}: "
                  f"{len(urls)} of {args.count} up)", file=sys.stderr)
            return 1
        if state == "pending":
            waited = time.monotonic() - started
            if args.pending_timeout is not None and waited > args.pending_timeout:
                print(f"serve-wait: job {args.job} still pending after {waited:.0f} s "
                      f"(--pending-timeout {args.pending_timeout:g}) — see `squeue -j "
                      f"{args.job}` for the reason", file=sys.stderr)
                return 1
            time.sleep(1.0)
            continue
        if deadline is None:
            pending, deadline = time.monotonic() - started, time.monotonic() + args.timeout
            if args.job is not None:
                print(f"serve-wait: job {args.job} runs after {pending:.0f} s pending (not "
                      "counted in --timeout)", file=sys.stderr)
        for i in range(args.count):
            if i not in urls and (url := answers(args.url_dir / f"{i}.url")):
                urls[i] = url
        if len(urls) == args.count:
            print("\n".join(urls[i] for i in range(args.count)))
            return 0
        time.sleep(1.0)
    print(f"serve-wait: {args.count - len(urls)} of {args.count} servers did not answer within "
          f"{args.timeout:g} s", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
