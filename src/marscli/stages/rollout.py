"""`marscli rollout`: G sampled trajectories per prompt, appended resumably.

- Trajectory `PROMPTID#k` (k = 0..G-1) is sample k of prompt PROMPTID; the G samples share
  `prompt_id`. Records are appended one complete record at a time (`outputs.AppendJsonl`), so a
  killed run re-run with the same command skips what is written and loses nothing.
- A rerun never mixes runs: the settings that decide the samples (policy and its weights'
  fingerprint, engine, -n, sampling, limits, tools, system prompt, seed, shard;
  `generate.sample_settings`) are written to `OUT.settings.json` before the first record, and
  a run that would add to records made with other settings exits 2 naming the setting
  (old → new). `--force` starts over: it removes the output, `OUT.media/`, sidecar and
  settings (a `--media-dir` of your own is left alone). Likewise a row that kept its id but
  changed its question, image or gold answer (each record's `input_hash`) exits 2 naming it;
  rows appended under new ids resume.
- `-o -` streams each finished trajectory to stdout as one flushed line, so
  `rollout | reward - | advantages -` pipes. Nothing is resumed (every job runs), no sidecar
  or settings file is written, crops go to `--media-dir` (default `./rollout.media/`) and the
  records' image paths are absolute, so whichever file the pipe ends in finds them.
- `--shard i/N` (0-based) keeps the prompts whose id hashes to i (`generate.shard_of`): the
  N parts of a Slurm array together give exactly the ids of one run. All samples of a prompt
  land in the same shard. The loop itself (resume, engine loading, media) is `generate`'s.
- Everything is checked before any generation: options (counts have upper bounds, e.g.
  -n <= 1024), the prompts file (FILE:LINE: field), every image of the shard's prompts (it
  must exist and decode), and the settings of an existing output; a failure creates no output
  file. The engine is loaded only when something is left to generate.
- Crops and thumbnails go to `OUT.media/` beside `OUT.jsonl` (or `--media-dir`); records hold
  their paths relative to the output's folder.
- Statistics go to stderr (a progress bar on a terminal, one summary line) and to the sidecar
  `OUT.jsonl.meta.json`, written at the end of a complete run and counted from the whole file,
  so it is right after a resumed run too. Speeds (trajectories/s, tokens/s) are this run's.
- A prompt longer than the model's context or `--max-prompt-tokens` is refused per row: its
  trajectories are recorded with `stop: "prompt_too_long"`, nothing generated, counted under
  `stop` in the statistics (and a warning line); the run goes on.
- Trajectories whose engine requests kept failing are recorded with `stop: "engine_error"`. A
  run in which every new trajectory failed so exits 1: the server is down or misconfigured.
  To retry them, drop them from the file (`jq -c 'select(.stop != "engine_error")'`) and re-run.
- A tool whose backend failed (`"failed": true`: errors and timeouts after the retries; an
  empty result is no failure) on more of its calls in the output's records than
  `--max-tool-failure-rate` (default 5%, as eval's; `agent/tool_health.py`) exits 1 naming the
  tool and its rate, with no sidecar: a search backend that is down would otherwise be trained
  on as observations. The records are kept; fix the backend (`marscli preflight`), drop the
  trajectories whose tools failed, and re-run to resume.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from marscli.agent.generation import MAX_SAMPLES, MAX_TOOL_FAILURE_RATE, GenerationOptions
from marscli.agent.protocol import read_system_prompt
from marscli.agent.runner import (
    check_images,
    generate,
    media_dir,
    sample_settings,
    start_over,
)
from marscli.agent.tally import TALLIED, fail_if_tools_broken, tally
from marscli.errors import RuntimeFailure, check_range
from marscli.records.jsonl import iter_rows
from marscli.records.provenance import stage_inputs
from marscli.records.schema import load_prompts
from marscli.records.shards import in_shard
from marscli.records.sidecar import write_sidecar
from marscli.records.trackers import check_tracker, log_stats, stats_tracker

STDOUT_MEDIA = "rollout.media"  # `-o -`: crops go here (in the working directory) by default


@stage_inputs()
def run_rollout(prompts: str, output: str, gen: GenerationOptions | None = None, *, n: int = 8,
                shard: tuple[int, int] = (0, 1), image_dir: str | None = None,
                progress: bool = True, force: bool = False, media: str | None = None,
                track: str | None = None,
                max_tool_failure_rate: float = MAX_TOOL_FAILURE_RATE, **fields: Any) -> dict:
    """Generate the missing trajectories of `prompts` (this shard) into `output` ("-":
    stdout, no resume); return the sidecar statistics. `fields`: `GenerationOptions` fields,
    set over `gen`; `media`: the crops folder (default: `OUT.media/`); `track`: a tracker
    the statistics also go to (trackers.py); `max_tool_failure_rate`: over it, exit 1 (module
    docstring)."""
    started = time.time()
    gen = replace(gen or GenerationOptions(), **fields)
    check_range("-n", n, 1, MAX_SAMPLES)
    check_range("--max-tool-failure-rate", max_tool_failure_rate, 0, 1)
    gen.check()
    check_tracker(track)
    base_prompt = read_system_prompt(gen.system_prompt)
    rows = [(p.line, p) for p in load_prompts(prompts, image_dir) if in_shard(p.id, shard)]
    check_images(prompts, rows)
    if output == "-":  # streamed records are no iteration's: nothing to track
        tracker = None
    else:  # opened before any work: a tracker that cannot write fails first
        tracker = stats_tracker(track, stage="rollout", output=output,
                                inputs=[prompts, *gen.read_paths()],
                                outputs=[media] if media else [])
    try:
        stats = _run(prompts, output, gen, rows, n, shard, progress, force, media, base_prompt,
                     started, max_tool_failure_rate)
    except BaseException:
        if tracker is not None:
            tracker.close()
        raise
    if tracker is not None:
        log_stats(tracker, output=output, stats=stats)
    return stats


def _run(prompts: str, output: str, gen: GenerationOptions, rows: list, n: int,
         shard: tuple[int, int], progress: bool, force: bool, media: str | None,
         base_prompt: str | None, started: float, max_tool_failure_rate: float) -> dict:
    """Generate, tally and write the sidecar (run_rollout's work, once everything is checked
    and the tracker is open)."""
    tools = gen.tools()
    jobs = [(p, k) for _, p in rows for k in range(n)]
    streamed: list[dict] = []
    settings = None
    if output != "-":
        if force:
            start_over(output)
        settings = sample_settings(gen, base_prompt, n=n, shard=f"{shard[0]}/{shard[1]}")
    media_path = Path(media) if media else (Path(STDOUT_MEDIA) if output == "-" else
                                            media_dir(output))
    res = generate(jobs, gen, tools, output=output, system_prompt=base_prompt, label="rollout",
                   progress=progress, settings=settings, media=media_path,
                   on_record=(lambda r: streamed.append({k: r.get(k) for k in TALLIED}))
                   if output == "-" else None)
    stats = {**tally(streamed if output == "-" else (r for _, r in iter_rows(output))),
             **res.stats}
    _report(stats, output)
    if res.all_failed:
        raise RuntimeFailure(f"every trajectory of this run failed at the engine (first: "
                             f"{stats['first_error']}) — they are recorded with stop engine_error; "
                             "fix the engine, drop them from the output and re-run")
    fail_if_tools_broken(stats, output, max_tool_failure_rate)
    config = {**gen.sidecar(res.engine), "n": n, "shard": f"{shard[0]}/{shard[1]}",
              "weights": settings["weights"] if settings else None}
    write_sidecar(output, stage="rollout", seed=gen.seed, config=config,
                  inputs=[prompts, *gen.input_files()], stats=stats, started=started)
    return stats


def _report(stats: dict, output: str) -> None:
    speed = (f" in {stats['generate_s']:.1f} s ({stats['trajectories_per_s']:.2f} traj/s, "
             f"{stats['generated_tokens_per_s']:.0f} tokens/s)" if stats["new"] else "")
    stops = ", ".join(f"{k} {v}" for k, v in stats["stop"].items()) or "none"
    done = (f"{stats['new']} to stdout" if output == "-" else
            f"{stats['new']} new, {stats['skipped']} already in {output}")
    print(f"rollout: {done}{speed}; {stats['trajectories']} trajectories, stops: {stops}",
          file=sys.stderr)
    if refused := stats["stop"].get("prompt_too_long"):
        print(f"warning: {refused} trajectories refused, their prompt too long for the model's "
              "context or --max-prompt-tokens (stop prompt_too_long, nothing generated)",
              file=sys.stderr)
    if 0 < stats["new_engine_errors"] < stats["new"]:
        print(f"warning: {stats['new_engine_errors']} trajectories ended in engine_error "
              f"(first: {stats['first_error']})", file=sys.stderr)
