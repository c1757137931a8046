"""Per-iteration test accuracy and tool use of one or more runs: a table on stderr and
`RUN/summary.json` for each run (iteration 0 is the cold-start SFT model). Beside the greedy
test accuracy of checkpoint k stands the mean reward of the training rollouts sampled from
it (`iter-k/scored.jsonl`), when they exist.

usage: python scripts/run_summary.py RUN [RUN...] --iters N
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import orjson
from rich.console import Console
from rich.table import Table

from marscli.jsonl import AtomicFile

SHORT = {"image_zoom_in_tool": "zoom", "text_search_tool": "text", "image_search_tool": "image"}


def iteration(run: Path, k: int) -> dict | None:
    path = run / "eval" / f"ckpt-{k}.summary.json"
    if not path.is_file():
        return None
    s = orjson.loads(path.read_bytes())
    (bench,) = s["benchmarks"].values()  # the toy test split is one benchmark
    return {"iter": k, "test_accuracy": bench["accuracy"], "items": bench["items"],
            "mean_turns": bench["mean_turns"],
            "tool_calls": {name: u["mean"] for name, u in bench["tool_use"].items()},
            "categories": {c: v["accuracy"] for c, v in bench["categories"].items()},
            "rollout_reward": rollout_reward(run, k)}


def rollout_reward(run: Path, k: int) -> dict | None:
    meta = run / f"iter-{k}" / "scored.jsonl.meta.json"
    if not meta.is_file():
        return None
    st = orjson.loads(meta.read_bytes())["stats"]
    return {"accuracy": st["accuracy_mean"], "format": st["format_mean"], "rows": st["rows"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--iters", type=int, required=True)
    args = ap.parse_args()
    # A log file gets a table wide enough for run names (rich assumes 80 columns off a tty).
    console = Console(stderr=True, width=None if sys.stderr.isatty() else 120)
    summaries = {run: [r for k in range(args.iters + 1) if (r := iteration(run, k))]
                 for run in args.runs}
    # A per-category column only where some run has more than one category (a perception-only
    # toy world has one, equal to the overall accuracy).
    by_cat = any(len(r["categories"]) > 1 for rows in summaries.values() for r in rows)
    table = Table(title="test accuracy and tool calls per trajectory, by iteration "
                        "(iteration 0: the SFT model)", title_justify="left")
    for col in ("run", "iter", "test acc %", "turns", "zoom", "image", "text",
                *(("by category",) if by_cat else ()), "rollout acc %"):
        table.add_column(col, justify="left" if col in ("run", "by category") else "right")
    for run, rows in summaries.items():
        with AtomicFile(run / "summary.json") as fh:
            fh.write(orjson.dumps({"v": 1, "run": str(run), "iterations": rows},
                                  option=orjson.OPT_INDENT_2))
        for r in rows:
            tools = {SHORT.get(k, k): v for k, v in r["tool_calls"].items()}
            cats = " ".join(f"{c} {a:.1f}" for c, a in r["categories"].items() if a is not None)
            table.add_row(run.name, str(r["iter"]), f"{r['test_accuracy']:.1f}",
                          f"{r['mean_turns']:.2f}", *(f"{tools.get(t, 0) or 0:.2f}"
                                                       for t in ("zoom", "image", "text")),
                          *((cats,) if by_cat else ()),
                          f"{100 * r['rollout_reward']['accuracy']:.1f}"
                          if r["rollout_reward"] else "-")
        if rows:
            table.add_section()
    console.print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
