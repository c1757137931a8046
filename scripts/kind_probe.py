#!/usr/bin/env python3
"""Per question kind, what a policy does on a toy world's prompts: accuracy, the share of
trajectories calling each tool, and found (its tools reach the target: toy.summary.found).

usage: scripts/kind_probe.py RECORDS.jsonl [--out FILE.json]

RECORDS are `marscli eval --mode agent` results (scored; image paths relative to their folder).
`make tiny-vlm-search` runs it on a world none of its pre-training worlds is (issue 35): the
search skills measured there are skills, not names or facts remembered. Prints one line per
kind (mean over the kind's rows) and, with --out, writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from marscli.errors import BadInput
from marscli.toy.summary import TOOLS, accuracy, fmt, kind_order, records, use_stats


def probe(path: Path) -> dict[str, dict]:
    rows = [r for r in records(path) if r.get("segments") is not None]
    acc, use = accuracy(rows, "score", "test"), use_stats(rows, path.parent, "test")
    return {k: {**acc[k], **use[k]} for k in sorted(acc, key=kind_order)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("records", type=Path)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    if not a.records.is_file():
        print(f"kind_probe: {a.records}: no such file", file=sys.stderr)
        return 2
    stats = probe(a.records)
    for kind, s in stats.items():
        cells = "  ".join(f"{t} {fmt(s[f'test_{t}'])}%" for t in TOOLS)
        print(f"{kind:<11} n={s['test_items']:<3} accuracy {fmt(s['test_accuracy'])}%  "
              f"calls {cells}  found {fmt(s['test_found'])}%")
    if a.out:
        a.out.write_text(json.dumps(stats, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except BadInput as e:
        print(f"kind_probe: {e}", file=sys.stderr)
        raise SystemExit(e.exit_code) from None
