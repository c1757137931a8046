"""The summary of an eval as a table on stderr, with its notes and warnings (unscored
records, tool health, a broken backend)."""

from __future__ import annotations

import math
import sys

from marscli.agent.generation import MAX_TOOL_FAILURE_RATE
from marscli.evaluation.health import health_cells, health_lines
from marscli.scoring.protocols import make_protocol


def _fmt(x: float | None, nd: int = 2) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def print_summary(summary: dict) -> None:
    """The summary as a rich table on stderr."""
    from rich.table import Table

    from marscli.agent.progress import stderr_console

    setups = sorted({f"{b['protocol']} protocol, {b['mode']}"
                     for b in summary["benchmarks"].values()})
    broken = bool(summary.get("broken_backend"))
    policy = f", policy {summary['policy']}" if summary.get("policy") else ""
    t = Table(title=f"eval: {summary['results']} ({'; '.join(setups)}{policy})",
              title_justify="left",
              caption=f"! measured with a broken backend: a failure rate over "
                      f"{summary.get('max_tool_failure_rate', MAX_TOOL_FAILURE_RATE):.0%} "
                      "(see the warnings)" if broken else None, caption_justify="left")
    for col, just in (("benchmark", "left"), ("category", "left"), ("items", "right"),
                      ("accuracy", "right"), ("MARS-8B", "right"), ("MARS-32B", "right"),
                      ("turns", "right"), ("tool calls", "right"), ("unscored", "right"),
                      ("tool fail %", "right"), ("pages ok %", "right"),
                      ("judge fail/retry", "right")):
        t.add_column(col, justify=just)
    for bench, b in summary["benchmarks"].items():
        def calls(s: dict) -> str:
            return _fmt(sum(v["mean"] or 0 for v in s["tool_use"].values()))

        def acc(s: dict) -> str:
            return _fmt(s["accuracy"]) + (" !" if s.get("broken_backend") else "")

        t.add_row(bench, "all", str(b["items"]),
                  acc(b), _fmt(b["paper"]["SenseNova-MARS-8B"]),
                  _fmt(b["paper"]["SenseNova-MARS-32B"]), _fmt(b["mean_turns"]),
                  calls(b), str(b["unscored"]), *health_cells(b.get("health")), style="bold")
        if len(b["categories"]) > 1:
            for cat, c in b["categories"].items():
                t.add_row("", cat, str(c["items"]), acc(c), "", "",
                          _fmt(c["mean_turns"]), calls(c), str(c["unscored"]),
                          *health_cells(c.get("health")))
    console = stderr_console()
    if not console.is_terminal:  # a log file: room for the whole table
        console.width = 150
    console.print(t)
    if not summary["benchmarks"]:
        print(f"eval: {summary['results']}: no results yet (an empty shard?)", file=sys.stderr)
    for name in sorted({b["protocol"] for b in summary["benchmarks"].values()}):
        print(f"eval: scored under the {name} protocol — {make_protocol(name).about}",
              file=sys.stderr)
    for bench, b in summary["benchmarks"].items():
        if b.get("note"):
            print(f"note: {bench}: {b['note']}", file=sys.stderr)
        if b["unscored"]:
            print(f"warning: {bench}: {b['unscored']} of {b['trajectories']} trajectories "
                  "unscored (judge or engine failures), excluded from the accuracy",
                  file=sys.stderr)
        if b.get("health"):
            for line in health_lines(bench, b["health"]):
                print(line, file=sys.stderr)
            _warn_broken(bench, b)


def _warn_broken(bench: str, b: dict) -> None:
    """A benchmark (or one of its categories) measured with a broken backend, said once."""
    for w in b["health"]["warnings"]:
        print(f"warning: {bench}: broken backend — {w}; its accuracy "
              f"({_fmt(b['accuracy'])}) is not the policy's alone", file=sys.stderr)
    for cat, c in b["categories"].items():
        if c["broken_backend"] and not b["broken_backend"]:
            for w in c["health"]["warnings"]:
                print(f"warning: {bench}/{cat}: broken backend — {w}", file=sys.stderr)
