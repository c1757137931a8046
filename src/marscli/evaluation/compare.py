"""`marscli eval summarize RUN` (or SUMMARY.json ...): which checkpoint to pick.

RUN is a run folder (its `eval/ckpt-K.summary.json`, as `make rl-eval` writes them), a folder
of summaries, or a list of `*.summary.json` files. For every checkpoint and benchmark: the
accuracy and its 95% interval; then the mean over the benchmarks every checkpoint has, and
the best checkpoint by `--by BENCH` or by that mean. A table on stderr; `--json` puts the
same numbers on stdout.

The intervals, computed from what a summary holds (its accuracy and its scored items n):
- a benchmark: Wilson's score interval for a proportion p = accuracy with n items. With one
  sample per item it is the usual binomial interval. With several samples per item (or token
  F1), an item's score is a mean in [0, 1], whose variance is at most p(1 - p): the interval
  is then conservative (at least as wide as it needs to be).
- InfoSeek under the official protocol (harmonic mean of two splits): the harmonic mean of
  the splits' Wilson bounds, lower with lower and upper with upper.
- the mean over B benchmarks: a normal interval, mean ± 1.96·sqrt(Σ s_b²)/B, with s_b the
  Wilson half-width of benchmark b over 1.96 (the benchmarks taken as independent).
The best checkpoint has the highest accuracy (the earlier step on a tie); when the runner-up's
interval overlaps the best's, the table says so: the data do not separate them at 95%.

Tool health (`health.py`) stands beside each checkpoint: the worst tool failure rate, the
page fetches read, the judge's failures and retries; a benchmark whose health exceeds
`--max-tool-failure-rate` is marked `!` (a score measured with a broken backend), listed per
checkpoint in `health.broken_backend`, and warned about.
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import orjson

from marscli.agent.generation import MAX_TOOL_FAILURE_RATE
from marscli.errors import BadInput
from marscli.evaluation.health import (
    checkpoint_cells,
    checkpoint_health,
    health_warnings,
)

Z = 1.96  # the normal quantile of a two-sided 95% interval
_STEP = re.compile(r"ckpt-(\d+)")
_SHARD = re.compile(r"\.shard-\d+\.summary\.json$")  # a sharded eval's parts


def wilson(p: float, n: int, z: float = Z) -> tuple[float, float]:
    """Wilson's score interval for a proportion p (in [0, 1]) out of n."""
    if n <= 0:
        return (0.0, 1.0)
    d = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / d
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (max(0.0, mid - half), min(1.0, mid + half))


def _harmonic(a: float, b: float) -> float:
    return 0.0 if a + b == 0 else 2 * a * b / (a + b)


def bench_interval(b: dict) -> tuple[float, float] | None:
    """A summary benchmark's 95% interval, in percent (module docstring)."""
    if b.get("accuracy") is None:
        return None
    splits = b.get("splits")
    if b.get("metric", "").startswith("harmonic mean") and isinstance(splits, dict) \
            and len(splits) == 2:
        lo, hi = zip(*(wilson(s["accuracy"] / 100, int(s["items"])) for s in splits.values()))
        return (100 * _harmonic(*lo), 100 * _harmonic(*hi))
    n = int(b.get("scored_items", b.get("items", 0)))
    lo, hi = wilson(b["accuracy"] / 100, n)
    return (100 * lo, 100 * hi)


def find_summaries(paths: list[str]) -> list[Path]:
    """The summaries named by RUN or the files given (module docstring), in step order."""
    found: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            for pattern in ("eval/ckpt-*.summary.json", "ckpt-*.summary.json", "*.summary.json"):
                # a sharded eval's per-shard summaries (OUT.shard-i.summary.json) are parts
                # of the merged one beside them, not checkpoints
                hits = sorted(h for h in p.glob(pattern) if not _SHARD.search(h.name))
                if hits:
                    found += hits
                    break
            else:
                raise BadInput(f"{raw}: no eval/ckpt-*.summary.json or *.summary.json here — "
                               "run make rl-eval (or marscli eval) first")
        elif p.is_file():
            found.append(p)
        else:
            raise BadInput(f"{raw}: no such file or folder")
    return sorted(found, key=_order)


def _order(p: Path) -> tuple[int, str]:
    m = _STEP.search(p.name)
    return (int(m[1]) if m else sys.maxsize, str(p))


def label(p: Path) -> str:
    return p.name.removesuffix(".summary.json")


def read_summary(p: Path) -> dict:
    try:
        doc = orjson.loads(p.read_bytes())
    except orjson.JSONDecodeError as e:
        raise BadInput(f"{p}: not valid JSON ({e})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("benchmarks"), dict):
        raise BadInput(f"{p}: benchmarks: missing — not an eval summary (RESULTS.summary.json)")
    return doc


def compare(paths: list[Path], by: str | None = None,
            max_tool_failure_rate: float = MAX_TOOL_FAILURE_RATE) -> dict:
    """Accuracy and intervals per checkpoint and benchmark, the mean, the best checkpoint,
    and each checkpoint's tool health."""
    rows = []
    for p in paths:
        benches = {}
        summary = read_summary(p)["benchmarks"]
        for name, b in summary.items():
            ci = bench_interval(b)
            h = b.get("health")
            benches[name] = {"accuracy": b.get("accuracy"), "ci95": ci,
                             "items": b.get("scored_items", b.get("items")),
                             "metric": b.get("metric"),
                             "broken_backend": bool(isinstance(h, dict) and health_warnings(
                                 h, max_tool_failure_rate))}
        rows.append({"checkpoint": label(p), "summary": str(p), "benchmarks": benches,
                     "health": checkpoint_health(summary, max_tool_failure_rate)})
    if not rows:
        raise BadInput("no summaries to compare")
    common = sorted(set.intersection(*(set(r["benchmarks"]) for r in rows)))
    for r in rows:
        r["mean"] = _mean_row([r["benchmarks"][b] for b in common])
    if by is not None:
        names = sorted({b for r in rows for b in r["benchmarks"]})
        if by not in names:
            raise BadInput(f"--by {by!r}: no such benchmark in these summaries (they have: "
                           f"{', '.join(names)})")
    best = _best(rows, by)
    return {"v": 1, "by": by or "mean", "benchmarks": common if by is None else [by],
            "max_tool_failure_rate": max_tool_failure_rate,
            "interval": "95%: Wilson score per benchmark; normal for the mean "
                        "(evaluation/compare.py's docstring)",
            "checkpoints": rows, **best}


def _mean_row(cells: list[dict]) -> dict | None:
    if not cells or any(c["accuracy"] is None or c["ci95"] is None for c in cells):
        return None
    m = sum(c["accuracy"] for c in cells) / len(cells)
    se = math.sqrt(sum(((c["ci95"][1] - c["ci95"][0]) / (2 * Z)) ** 2 for c in cells))
    half = Z * se / len(cells)
    return {"accuracy": round(m, 4), "ci95": (max(0.0, m - half), min(100.0, m + half))}


def _score(r: dict, by: str | None) -> dict | None:
    return r["mean"] if by is None else r["benchmarks"].get(by)


def _best(rows: list[dict], by: str | None) -> dict:
    ranked = [r for r in rows if (s := _score(r, by)) and s["accuracy"] is not None]
    if not ranked:
        return {"best": None, "separated": None}
    best = max(ranked, key=lambda r: _score(r, by)["accuracy"])  # max keeps the first on ties
    others = [r for r in ranked if r is not best]
    runner = max(others, key=lambda r: _score(r, by)["accuracy"]) if others else None
    sb = _score(best, by)
    overlap = runner is not None and _score(runner, by)["ci95"][1] >= sb["ci95"][0]
    return {"best": best["checkpoint"], "best_accuracy": sb["accuracy"], "best_ci95": sb["ci95"],
            "runner_up": runner["checkpoint"] if runner else None,
            "separated": None if runner is None else not overlap}


def _cell(c: dict | None) -> str:
    if not c or c["accuracy"] is None:
        return "-"
    lo, hi = c["ci95"] or (math.nan, math.nan)
    mark = " !" if c.get("broken_backend") else ""
    return f"{c['accuracy']:.1f} [{lo:.1f}, {hi:.1f}]{mark}"


def print_table(doc: dict) -> None:
    from rich.table import Table

    from marscli.agent.progress import stderr_console

    names = sorted({b for r in doc["checkpoints"] for b in r["benchmarks"]})
    broken = [(r["checkpoint"], r["health"]["broken_backend"]) for r in doc["checkpoints"]
              if r["health"]["broken_backend"]]
    t = Table(title="accuracy % [95% interval] per checkpoint (Wilson per benchmark; normal "
                    "for the mean)", title_justify="left",
              caption=f"! measured with a broken backend (a failure rate over "
                      f"{doc['max_tool_failure_rate']:.0%})" if broken else None,
              caption_justify="left")
    for col in ("checkpoint", *names, "mean", "tool fail %", "pages ok %", "judge fail/retry"):
        t.add_column(col, justify="left" if col == "checkpoint" else "right")
    for r in doc["checkpoints"]:
        mark = " *" if r["checkpoint"] == doc["best"] else ""
        t.add_row(r["checkpoint"] + mark, *(_cell(r["benchmarks"].get(b)) for b in names),
                  _cell(r["mean"]), *checkpoint_cells(r["health"]))
    console = stderr_console()
    if not console.is_terminal:
        console.width = max(150, 24 * (len(names) + 2) + 50)
    console.print(t)
    for ckpt, benches in broken:
        print(f"warning: {ckpt}: {', '.join(benches)} measured with a broken backend (tool, "
              f"page-fetch or judge failures over {doc['max_tool_failure_rate']:.0%}) — see "
              "its summary's health", file=sys.stderr)
    what = "the mean over " + ", ".join(doc["benchmarks"]) if doc["by"] == "mean" else doc["by"]
    if doc["best"] is None:
        print(f"best: none — no checkpoint has a score for {what}", file=sys.stderr)
        return
    lo, hi = doc["best_ci95"]
    line = (f"best: {doc['best']} by {what}: {doc['best_accuracy']:.2f} "
            f"[{lo:.2f}, {hi:.2f}]")
    if doc["separated"] is False:
        line += (f"; its interval overlaps {doc['runner_up']}'s: not separated at 95% — more "
                 "items or samples would tell them apart")
    print(line, file=sys.stderr)
