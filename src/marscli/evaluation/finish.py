"""The end of an eval run: its summary computed from the whole results file (right after a
resume), a run whose every trajectory failed at the engine refused, then the sidecar, and the
summary written last (what `make` takes for a finished eval)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from marscli.agent.generation import GenerationOptions
from marscli.errors import RuntimeFailure
from marscli.evaluation.paths import summary_path
from marscli.evaluation.summary import fail_if_unscored, summarize, write_summary
from marscli.evaluation.table import print_summary
from marscli.records.sidecar import write_sidecar


def finish_eval(output: str, gen: GenerationOptions, res: Any, settings: dict, loaded: Any,
            rows: list, mode: str, protocol: str, judge: Any, samples: int,
            shard: tuple[int, int], max_unscored: float, max_tool_failure_rate: float,
            bench: str, started: float) -> dict:
    """Summarise, refuse a failed run, write the sidecar and the summary (last)."""
    run = res.stats
    speed = f" in {run['generate_s']:.1f} s" if run["new"] else ""
    print(f"eval: {run['new']} new, {run['skipped']} already in {output}{speed}",
          file=sys.stderr)
    summary = summarize(output, max_unscored=max_unscored,
                        max_tool_failure_rate=max_tool_failure_rate)
    print_summary(summary)
    if res.all_failed:
        summary_path(output).unlink(missing_ok=True)
        raise RuntimeFailure(f"every trajectory of this run failed at the engine (first: "
                             f"{run['first_error']}) — they are recorded unscored; fix the "
                             "engine, drop them (jq -c 'select(.stop != \"engine_error\")') "
                             "and re-run")
    fail_if_unscored(summary, output)
    config = {**gen.sidecar(res.engine), "bench": bench, "format": loaded.fmt,
              "benchmark": loaded.benchmark, "split": loaded.split, "mode": mode,
              "protocol": protocol,
              "judge": judge.config(), "samples": samples, "shard": f"{shard[0]}/{shard[1]}",
              "max_unscored": max_unscored, "max_tool_failure_rate": max_tool_failure_rate,
              "weights": settings["weights"]}
    stats = {"items_loaded": len(rows), "rows_read": loaded.rows, "rows_skipped": loaded.skipped,
             **run, "trajectories": summary["trajectories"], "unscored": summary["unscored"]}
    inputs = [bench] if Path(bench).is_file() else []
    write_sidecar(output, stage="eval", seed=gen.seed, config=config,
                  inputs=inputs + gen.input_files(), stats=stats, started=started)
    write_summary(summary, output)  # last: make takes it for done
    return summary

