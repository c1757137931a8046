"""`marscli summary RUN... --iters N [--seeds S] [--plot PNG]`: the toy world's run summary
(toy/summary.py, the demo's table): RUN/summary.json for each run, the tables on stderr and, with
--plot, one PNG of accuracy ± 95% CI."""

from __future__ import annotations

import sys
from pathlib import Path

from marscli.records.provenance import stage_inputs


@stage_inputs()
def main(runs: list[str], iters: int, seeds: int = 1, plot_path: str | None = None) -> None:
    from rich.console import Console

    from marscli.toy.summary import kind_table, plot, summarize, table

    # A log file gets a table wide enough for run names (rich assumes 80 columns off a tty).
    console = Console(stderr=True, width=None if sys.stderr.isatty() else 200)
    summaries = {Path(run): summarize(Path(run), iters, seeds) for run in runs}
    console.print(table(summaries, seeds))
    if any(r["kinds"] for rows in summaries.values() for r in rows):
        console.print(kind_table(summaries, seeds))
    if plot_path:
        plot(summaries, Path(plot_path), seeds)
        console.print(f"plot: {Path(plot_path)}")
