#!/usr/bin/env python3
"""Wait until the `marscli serve` that writes URL_FILE answers GET /health; print its URL.

usage: scripts/serve-wait.py URL_FILE [--pid PID | --job SLURM_JOB_ID] [--timeout S]

Exits 1 when the server's process (or Slurm job) ends first, or after the timeout, so that
`make rl SERVE=1` never waits on a server that failed to start. Standard library only.
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


def alive(pid: int | None, job: str | None) -> bool:
    if pid is not None:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
    if job is not None:
        state = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True,
                               text=True, check=False).stdout.strip()
        return state in ("PENDING", "CONFIGURING", "RUNNING")
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("url_file", type=Path)
    ap.add_argument("--pid", type=int)
    ap.add_argument("--job")
    ap.add_argument("--timeout", type=float, default=900.0)
    args = ap.parse_args()
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        if not alive(args.pid, args.job):
            print(f"serve-wait: the server ended before it answered ({args.url_file})",
                  file=sys.stderr)
            return 1
        if args.url_file.is_file():
            url = args.url_file.read_text().strip()
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                    policy = json.load(r)["policy"]
                print(f"serve-wait: {url} holds {policy}", file=sys.stderr)
                print(url)
                return 0
            except OSError:
                pass
        time.sleep(1.0)
    print(f"serve-wait: no answer from the server within {args.timeout:g} s", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
