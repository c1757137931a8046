#!/usr/bin/env python3
"""Wait until the COUNT `marscli serve` processes that write URL_DIR/0.url ... answer GET
/health; print their URLs, one a line, in index order.

usage: scripts/serve-wait.py URL_DIR [--count N] [--pid PID ... | --job SLURM_JOB_ID] [--timeout S]

Exits 1 when a server's process (any --pid, or the Slurm job) ends first, or after the timeout,
so that `make rl SERVE=1` never waits on a server that failed to start. Standard library only.
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


def alive(pids: list[int], job: str | None) -> bool:
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
    if job is not None:
        state = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True,
                               text=True, check=False).stdout.strip()
        return state in ("PENDING", "CONFIGURING", "RUNNING")
    return True


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
    ap.add_argument("--timeout", type=float, default=900.0)
    args = ap.parse_args()
    deadline = time.monotonic() + args.timeout
    urls: dict[int, str] = {}
    while time.monotonic() < deadline:
        if not alive(args.pid, args.job):
            print(f"serve-wait: a server ended before it answered ({args.url_dir}: "
                  f"{len(urls)} of {args.count} up)", file=sys.stderr)
            return 1
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
