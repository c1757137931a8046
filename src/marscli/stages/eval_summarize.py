"""`marscli eval summarize` and `marscli eval rescore`: no generation.

`marscli eval summarize RESULTS.jsonl` (the older `--summarize RESULTS.jsonl`) recomputes the
summary without generating (after `marscli merge`); `marscli eval rescore RESULTS.jsonl`
(`--summarize ... --rescore`) first re-scores every record (under `--protocol`, with `--judge`)
and rewrites the file atomically — the way to retry rows a failing judge left unscored, or to
switch protocol (the settings file then names the new judge and protocol).

Given a run folder or summaries instead, `eval summarize` compares checkpoints: accuracy with
95% intervals and the best one (`evaluation/compare.py`).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import orjson

from marscli.agent.generation import MAX_TOOL_FAILURE_RATE, JobOptions
from marscli.errors import BadInput, check_range
from marscli.evaluation.compare import compare, find_summaries, print_table
from marscli.evaluation.rescore import rescore_file, rescored_settings, settings_of
from marscli.evaluation.summary import fail_if_unscored, summarize, write_summary
from marscli.evaluation.table import print_summary
from marscli.records.provenance import stage_inputs
from marscli.records.sidecar import write_sidecar
from marscli.scoring.judge import JudgeOptions, judge_options
from marscli.scoring.judge_config import JudgeConfig
from marscli.scoring.protocols import make_protocol


def rescore(results: str, judge: JudgeConfig, job: JobOptions, **kw: Any) -> dict:
    """`run_summarize` with the command's judge options (`eval rescore`, `eval --summarize`)."""
    return run_summarize(results, judge_spec=judge.judge, judge_opts=judge_options(judge),
                         max_unscored=judge.max_unscored,
                         max_tool_failure_rate=job.max_tool_failure_rate, **kw)


@stage_inputs()
def run_summarize(results: str, *, rescore: bool = False, protocol: str | None = None,
                  judge_spec: str = "exact", judge_opts: JudgeOptions | None = None,
                  max_unscored: float = 0.05,
                  max_tool_failure_rate: float = MAX_TOOL_FAILURE_RATE,
                  command: str = "--summarize") -> dict:
    """`marscli eval summarize|rescore RESULTS.jsonl` (`eval --summarize RESULTS.jsonl
    [--rescore]`): no generation. `command`: what messages about RESULTS name."""
    started = time.time()
    check_range("--max-unscored", max_unscored, 0, 1)
    check_range("--max-tool-failure-rate", max_tool_failure_rate, 0, 1)
    if results == "-":
        raise BadInput(f"{command} -: name the results file (the summary goes beside it)")
    if not Path(results).is_file():
        raise BadInput(f"{command} {results}: no such file")
    if rescore:
        if protocol is not None:
            make_protocol(protocol)  # an unknown name: refused before any judge call
        settings = settings_of(results)  # likewise a bad settings file
        rescore_file(results, protocol, judge_spec, judge_opts)
        rescored_settings(results, settings, protocol, judge_spec)
    elif protocol is not None:
        raise BadInput("--protocol: with --summarize it needs --rescore (the records hold "
                       "their scores; --rescore re-scores them under --protocol)")
    summary = summarize(results, max_unscored=max_unscored,
                        max_tool_failure_rate=max_tool_failure_rate)
    print_summary(summary)
    fail_if_unscored(summary, results)
    if rescore:
        write_sidecar(results, stage="eval --rescore", config={
            "protocol": protocol, "judge": judge_spec, "max_unscored": max_unscored},
            inputs=[results], stats={"trajectories": summary["trajectories"],
                                     "unscored": summary["unscored"]}, started=started)
    write_summary(summary, results)
    return summary


def run_compare(paths: list[str], by: str | None = None, as_json: bool = False,
                max_tool_failure_rate: float = MAX_TOOL_FAILURE_RATE) -> dict:
    check_range("--max-tool-failure-rate", max_tool_failure_rate, 0, 1)
    doc = compare(find_summaries(paths), by, max_tool_failure_rate)
    print_table(doc)
    if as_json:
        sys.stdout.buffer.write(orjson.dumps(doc, option=orjson.OPT_APPEND_NEWLINE))
        sys.stdout.flush()
    return doc


def is_results_file(paths: list[str]) -> bool:
    """`eval summarize RESULTS.jsonl` (recompute one summary) rather than a comparison."""
    return len(paths) == 1 and not Path(paths[0]).is_dir() and Path(paths[0]).suffix != ".json"


def summarize_or_compare(paths: list[str], by: str | None = None, as_json: bool = False,
                         max_unscored: float = 0.05,
                         max_tool_failure_rate: float = MAX_TOOL_FAILURE_RATE) -> None:
    """`marscli eval summarize PATHS`: one results file's summary recomputed
    (`run_summarize`), or checkpoints compared (`run_compare`). `--by` and
    `--json` pick and print among checkpoints: with one results file they are refused, not
    ignored."""
    if not is_results_file(paths):
        run_compare(paths, by=by, as_json=as_json, max_tool_failure_rate=max_tool_failure_rate)
        return
    for flag, given in (("--by", by is not None), ("--json", as_json)):
        if given:
            raise BadInput(f"{flag}: compares checkpoints, and {paths[0]} is one results file "
                           "— give a run folder or summaries")
    run_summarize(paths[0], max_unscored=max_unscored, command="eval summarize",
                  max_tool_failure_rate=max_tool_failure_rate)

