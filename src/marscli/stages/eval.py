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
from dataclasses import replace
from pathlib import Path
from typing import Any

from marscli.agent.protocol import read_system_prompt
from marscli.agent.runner import (
    MAX_SAMPLES,
    GenerationOptions,
    check_images,
    generate,
    in_shard,
    sample_settings,
    start_over,
)
from marscli.agent.tool_health import MAX_TOOL_FAILURE_RATE
from marscli.benchmarks import LoadContext, format_names, load_benchmark
from marscli.errors import BadInput, RuntimeFailure, check_range, unknown_name
from marscli.evaluation.check import report_loaded
from marscli.evaluation.health import run_endpoints
from marscli.evaluation.modes import DIRECT_PROMPT, MODES, for_mode
from marscli.evaluation.paths import image_cache, summary_path
from marscli.evaluation.summary import fail_if_unscored, summarize, write_summary
from marscli.evaluation.table import print_summary
from marscli.records.provenance import stage_inputs
from marscli.records.sidecar import write_sidecar
from marscli.records.trackers import check_tracker, log_stats, stats_tracker
from marscli.scoring.judge import JudgeOptions, make_judge
from marscli.scoring.protocols import ScoreContext, make_protocol


@stage_inputs()
def run_eval(bench: str, output: str, gen: GenerationOptions | None = None, *,
             fmt: str = "auto", mode: str = "agent", samples: int = 1,
             judge_spec: str = "exact", protocol: str = "mars",
             shard: tuple[int, int] = (0, 1), benchmark: str | None = None,
             image_dir: str | None = None, max_unscored: float = 0.05,
             split: str | None = None,
             max_tool_failure_rate: float = MAX_TOOL_FAILURE_RATE,
             judge_opts: JudgeOptions | None = None, progress: bool = True,
             force: bool = False, track: str | None = None, **fields: Any) -> dict:
    """Generate and score the missing trajectories of BENCH (this shard) into `output`, then
    write the summary; return it. `fields`: `GenerationOptions` fields, set over `gen`
    (default: greedy, and the turns `--mode` implies); `force`: start over."""
    started = time.time()
    gen = replace(gen or GenerationOptions(temperature=0.0, max_turns=None), **fields)
    check_range("--samples", samples, 1, MAX_SAMPLES)
    check_range("--max-unscored", max_unscored, 0, 1)
    check_range("--max-tool-failure-rate", max_tool_failure_rate, 0, 1)
    if output == "-":
        raise BadInput("-o -: eval appends to a file so that it can resume — name one, "
                       "e.g. -o results.jsonl")
    if mode not in MODES:
        raise BadInput(f"--mode {mode!r}: choose agent or direct")
    if fmt not in format_names():
        raise unknown_name("--format", fmt, format_names())
    proto = make_protocol(protocol)
    gen = for_mode(gen, mode)
    gen.check()
    check_tracker(track)
    base_prompt = read_system_prompt(gen.system_prompt) or (DIRECT_PROMPT if mode == "direct"
                                                            else None)
    judge = make_judge(judge_spec, judge_opts)  # a bad spec fails before anything is read
    stack = contextlib.ExitStack()
    try:
        # opened before any work (loading the benchmark may fill the image cache): a tracker
        # that cannot write, or would write into the stage's data, fails first
        tracker = stats_tracker(track, stage="eval", output=output,
                                inputs=[bench, image_dir, *gen.read_paths()],
                                outputs=[summary_path(output), image_cache(output)])
        stack.callback(tracker.close)  # on a failure; on success log_stats closes it
        ctx = LoadContext(source=bench, cache_dir=image_cache(output),
                          image_dir=Path(image_dir) if image_dir else None, benchmark=benchmark,
                          split=split, keep=lambda pid: in_shard(pid, shard))
        loaded = load_benchmark(bench, fmt, ctx)
        rows = [(line, p) for line, p in loaded.prompts if in_shard(p.id, shard)]
        if not rows and not loaded.rows:
            raise BadInput(f"{bench}: no items")
        check_images(bench, rows, loaded.unit, loaded.where)
        report_loaded(loaded, len(rows), shard)
        if samples > 1 and gen.temperature == 0:
            print(f"warning: --samples {samples} with --temperature 0: the samples of an item "
                  "will be identical (greedy) — set a temperature to average real samples",
                  file=sys.stderr)
        sctx = ScoreContext(judge=judge, base=Path(output).parent)
        tools = gen.tools() if mode == "agent" else []
        endpoints = run_endpoints(tools, judge)
        if force:
            start_over(output, summary_path(output))
        settings = sample_settings(gen, base_prompt, mode=mode, samples=samples,
                                   protocol=protocol, judge=judge_spec, format=loaded.fmt,
                                   benchmark=loaded.benchmark, split=loaded.split,
                                   shard=f"{shard[0]}/{shard[1]}")

        def score(rec: dict) -> None:
            rec["mode"] = mode
            if loaded.split is not None:
                rec["split"] = loaded.split
            rec["score"] = proto.score(rec, sctx)
            rec["endpoints"] = endpoints
            if settings["weights"]:  # what the summary tells policies apart by
                rec["weights"] = settings["weights"]

        res = generate([(p, k) for _, p in rows for k in range(samples)], gen,
                       tools, output=output,
                       system_prompt=base_prompt, label=f"eval ({mode})", on_record=score,
                       progress=progress, settings=settings,
                       finished=(summary_path(output),))
    except BaseException:
        stack.close()
        raise
    finally:
        judge.close()
    with stack:  # the tracker, closed on a failure below
        summary = _finish(output, gen, res, settings, loaded, rows, mode, protocol, judge,
                          samples, shard, max_unscored, max_tool_failure_rate, bench, started)
        stack.pop_all()
    log_stats(tracker, output=output, stats=summary)
    return summary


def _finish(output: str, gen: GenerationOptions, res: Any, settings: dict, loaded: Any,
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

