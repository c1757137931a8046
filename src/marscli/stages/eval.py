"""`marscli eval`: run the agent (or a direct answer) over a benchmark, score every
trajectory, and summarise per benchmark and category beside the paper's numbers.

- BENCH is read by a loader (`benchmarks/`, `--format`, `auto` detects) into prompt rows.
  Everything is checked before any generation: options, every row (FILE:LINE: field; a row
  without a gold answer is refused, never scored 0), every image of the shard (it must exist,
  decode and have an aspect ratio the processor takes, 200:1 at most). Images stored inside
  the benchmark file (parquet bytes, TSV base64) are written once to `eval-images/SHA256.EXT`
  beside the results.
- `--mode agent`: the full tool loop (zoom-in always; text and image search when a backend is
  given). `--mode direct`: no tools (an empty tools block), one turn, a system prompt asking
  for `<answer>`.
- `--samples K`: K trajectories per item, ids `ITEM#k` (k = 0..K-1); an item's accuracy is
  the mean over its scored samples.
- Resumable and shardable like `rollout`, through the same loop (`generate`): records are
  appended one at a time, a re-run skips the ids already there, `--shard i/N` keeps the items
  whose id hashes to i. As in `rollout`, a re-run into records made with other settings
  (policy weights, sampling, limits, tools, system prompt, seed, and here also mode, samples,
  protocol, judge, format and benchmark) exits 2 naming the setting; they are kept in
  `RESULTS.jsonl.settings.json`, written before the first record; an item that kept its id
  but changed its question, image or gold exits 2 the same way (`runner.check_inputs`).
  `--force` starts over (removes the results, their media, summary, sidecar and settings).
  Each record is the agent's trajectory record plus `benchmark`, `category`, `mode` and `score`
  (`scoring/protocols.py`).
- `--protocol` (`scoring/protocols.py`): `mars` (default), `official` (each benchmark's
  own), `release` (the released code's validation scoring) or `release-inference` (its
  `inference/eval.py`). The summary names it: per benchmark and at the top of
  `RESULTS.summary.json` (`protocol`), in the table's title, and in one line on stderr saying
  what that protocol scores.
- The summary is computed from the whole results file at the end (so it is right after a
  resume); a table goes to stderr, then the sidecar `RESULTS.jsonl.meta.json` is written, and
  `RESULTS.summary.json` last (atomically): it is what `make` takes for a finished eval. The
  summary names the policy (`policy`, and `weights`: the fingerprint eval records carry);
  records of two policies are refused, naming the line, never averaged into one accuracy.
  `eval summarize` and `eval rescore` recompute it without generating
  (`stages/eval_summarize.py`); unscored records and tool health: `evaluation/summary.py`.

Departures from the release's evaluation are listed in `scoring/protocols.py`; marscli's
system prompts are its own (`--system-prompt FILE` replaces them).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from marscli.agent.generation import MAX_SAMPLES, GenerationOptions, JobOptions
from marscli.agent.protocol import read_system_prompt
from marscli.agent.runner import generate, sample_settings, start_over
from marscli.benchmarks import format_names
from marscli.errors import BadInput, check_range, unknown_name
from marscli.evaluation.check import load_shard
from marscli.evaluation.config import EvalConfig
from marscli.evaluation.finish import finish_eval
from marscli.evaluation.health import run_endpoints
from marscli.evaluation.modes import DIRECT_PROMPT, MODES, for_mode
from marscli.evaluation.paths import image_cache, summary_path
from marscli.records.provenance import stage_inputs
from marscli.records.trackers import check_tracker, log_stats, stats_tracker
from marscli.scoring.judge import JudgeOptions, judge_options, make_judge
from marscli.scoring.judge_config import JudgeConfig
from marscli.scoring.protocols import ScoreContext, make_protocol


def main(bench: str | None, output: str | None, check: bool, ev: EvalConfig,
         gen: GenerationOptions, judge: JudgeConfig, job: JobOptions,
         summarize: str | None = None, rescore: bool = False) -> None:
    """`marscli eval BENCH`: the run, `--check` (no model), or the old form of `eval
    summarize|rescore` (`--summarize RESULTS.jsonl [--rescore]`)."""
    if summarize is not None:
        if bench is not None:
            raise BadInput("--summarize: give the results file only, not BENCH too")
        from marscli.stages.eval_summarize import rescore as run_rescore

        run_rescore(summarize, judge, job, rescore=rescore, protocol=ev.protocol)
        return
    if bench is None:
        raise BadInput("BENCH: missing — give a benchmark file or folder (or --summarize "
                       "RESULTS.jsonl)")
    if check:
        from marscli.stages.eval_check import run_check

        run_check(bench, fmt=ev.fmt, benchmark=ev.benchmark, image_dir=job.image_dir,
                  split=ev.split, output=output)
        return
    if output is None:
        raise BadInput("-o: missing — name the results file, e.g. -o results.jsonl")
    if rescore:
        raise BadInput("--rescore: only with --summarize RESULTS.jsonl")
    run_eval(bench, output, gen, **vars(ev), judge_spec=judge.judge,
             judge_opts=judge_options(judge), max_unscored=judge.max_unscored,
             **job.stage_kwargs())


@stage_inputs()
def run_eval(bench: str, output: str, gen: GenerationOptions | None = None, *,
             fmt: str = "auto", mode: str = "agent", samples: int = 1,
             judge_spec: str = "exact", protocol: str | None = "mars",
             shard: tuple[int, int] = (0, 1), benchmark: str | None = None,
             image_dir: str | None = None, max_unscored: float = 0.05,
             split: str | None = None,
             max_tool_failure_rate: float = JobOptions.max_tool_failure_rate,
             judge_opts: JudgeOptions | None = None, progress: bool = True,
             force: bool = False, track: str | None = None, **fields: Any) -> dict:
    """Generate and score the missing trajectories of BENCH (this shard) into `output`, then
    write the summary; return it. `fields`: `GenerationOptions` fields, set over `gen`
    (default: greedy, and the turns `--mode` implies); `force`: start over."""
    started = time.time()
    protocol = protocol or "mars"
    gen = replace(gen or GenerationOptions(temperature=0.0, max_turns=None), **fields)
    _check_options(output, fmt, mode, samples, gen.temperature, max_unscored,
                   max_tool_failure_rate)
    proto = make_protocol(protocol)
    gen = for_mode(gen, mode)
    gen.check()
    check_tracker(track)
    base_prompt = read_system_prompt(gen.system_prompt) or (DIRECT_PROMPT if mode == "direct"
                                                            else None)
    judge = make_judge(judge_spec, judge_opts)  # a bad spec fails before anything is read
    stack = contextlib.ExitStack()
    try:
        # opened first (loading may fill the image cache): a tracker that cannot write fails
        tracker = stats_tracker(track, stage="eval", output=output,
                                inputs=[bench, image_dir, *gen.read_paths()],
                                outputs=[summary_path(output), image_cache(output)])
        stack.callback(tracker.close)  # on a failure; on success log_stats closes it
        loaded, rows = load_shard(bench, output, fmt, image_dir, benchmark, split, shard)
        sctx = ScoreContext(judge=judge, base=Path(output).parent)
        tools = gen.tools() if mode == "agent" else []
        endpoints = run_endpoints(tools, judge)
        if force:
            start_over(output, summary_path(output))
        settings = sample_settings(gen, base_prompt, mode=mode, samples=samples,
                                   protocol=protocol, judge=judge_spec, format=loaded.fmt,
                                   benchmark=loaded.benchmark, split=loaded.split,
                                   shard=f"{shard[0]}/{shard[1]}")
        score = _scorer(mode, loaded.split, proto, sctx, endpoints, settings["weights"])
        res = generate([(p, k) for _, p in rows for k in range(samples)], gen, tools,
                       output=output, system_prompt=base_prompt, label=f"eval ({mode})",
                       on_record=score,
                       progress=progress, settings=settings,
                       finished=(summary_path(output),))
    except BaseException:
        stack.close()
        raise
    finally:
        judge.close()
    with stack:  # the tracker, closed on a failure below
        summary = finish_eval(output, gen, res, settings, loaded, rows, mode, protocol, judge,
                              samples, shard, max_unscored, max_tool_failure_rate, bench,
                              started)
        stack.pop_all()
    log_stats(tracker, output=output, stats=summary)
    return summary


def _check_options(output: str, fmt: str, mode: str, samples: int, temperature: float,
                   max_unscored: float, max_tool_failure_rate: float) -> None:
    """eval's own options → BadInput naming the option, before anything is read."""
    check_range("--samples", samples, 1, MAX_SAMPLES)
    if samples > 1 and temperature == 0:
        print(f"warning: --samples {samples} with --temperature 0: the samples of an item "
              "will be identical (greedy) — set a temperature to average real samples",
              file=sys.stderr)
    check_range("--max-unscored", max_unscored, 0, 1)
    check_range("--max-tool-failure-rate", max_tool_failure_rate, 0, 1)
    if output == "-":
        raise BadInput("-o -: eval appends to a file so that it can resume — name one, "
                       "e.g. -o results.jsonl")
    if mode not in MODES:
        raise BadInput(f"--mode {mode!r}: choose agent or direct")
    if fmt not in format_names():
        raise unknown_name("--format", fmt, format_names())


def _scorer(mode: str, split: str | None, proto: Any, sctx: ScoreContext, endpoints: dict,
            weights: str | None) -> Callable[[dict], None]:
    """The hook each new record goes through before it is appended: scored, and marked with
    what the summary tells runs and policies apart by."""

    def score(rec: dict) -> None:
        rec["mode"] = mode
        if split is not None:
            rec["split"] = split
        rec["score"] = proto.score(rec, sctx)
        rec["endpoints"] = endpoints
        if weights:
            rec["weights"] = weights

    return score
