"""`marscli rollout`: G sampled trajectories per prompt, appended resumably.

- Trajectory `PROMPTID#k` (k = 0..G-1) is sample k of prompt PROMPTID; the G samples share
  `prompt_id`. Records are appended one complete record at a time (`jsonl.AppendJsonl`), so a
  killed run re-run with the same command skips what is written and loses nothing.
- `--shard i/N` (0-based) keeps the prompts whose id hashes to i (`generate.shard_of`): the
  N parts of a Slurm array together give exactly the ids of one run. All samples of a prompt
  land in the same shard. The loop itself (resume, engine loading, media) is `generate`'s.
- Everything is checked before any generation: options, the prompts file (FILE:LINE: field),
  and every image of the shard's prompts (it must exist and decode); a failure creates no
  output file. The engine is loaded only when something is left to generate.
- Crops and thumbnails go to `OUT.media/` beside `OUT.jsonl`; records hold their paths relative
  to the output's folder.
- Statistics go to stderr (a progress bar on a terminal, one summary line) and to the sidecar
  `OUT.jsonl.meta.json`, written at the end of a complete run and counted from the whole file,
  so it is right after a resumed run too. Speeds (trajectories/s, tokens/s) are this run's.
- Trajectories whose engine requests kept failing are recorded with `stop: "engine_error"`. A
  run in which every new trajectory failed so exits 1: the server is down or misconfigured.
  To retry them, drop them from the file (`jq -c 'select(.stop != "engine_error")'`) and re-run.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import replace
from typing import Any

from marscli.errors import BadInput, RuntimeFailure, check_range
from marscli.generate import GenerationOptions, check_images, generate, in_shard
from marscli.jsonl import iter_rows, write_sidecar
from marscli.protocol import read_system_prompt
from marscli.records import load_prompts


def run_rollout(prompts: str, output: str, gen: GenerationOptions | None = None, *, n: int = 8,
                shard: tuple[int, int] = (0, 1), image_dir: str | None = None,
                progress: bool = True, **fields: Any) -> dict:
    """Generate the missing trajectories of `prompts` (this shard) into `output`; return the
    sidecar statistics. `fields`: `GenerationOptions` fields, set over `gen`."""
    started = time.time()
    gen = replace(gen or GenerationOptions(), **fields)
    check_range("-n", n, 1)
    gen.check()
    if output == "-":
        raise BadInput("-o -: rollout appends to a file so that it can resume — name one, "
                       "e.g. -o traj.jsonl")
    base_prompt = read_system_prompt(gen.system_prompt)
    rows = [(p.line, p) for p in load_prompts(prompts, image_dir) if in_shard(p.id, shard)]
    check_images(prompts, rows)
    tools = gen.tools()
    jobs = [(p, k) for _, p in rows for k in range(n)]
    res = generate(jobs, gen, tools, output=output, system_prompt=base_prompt, label="rollout",
                   progress=progress)
    stats = {**file_stats(output), **res.stats}
    _report(stats, output)
    if res.all_failed:
        raise RuntimeFailure(f"every trajectory of this run failed at the engine (first: "
                             f"{stats['first_error']}) — they are recorded with stop engine_error; "
                             "fix the engine, drop them from the output and re-run")
    config = {**gen.sidecar(res.engine), "n": n, "shard": f"{shard[0]}/{shard[1]}"}
    write_sidecar(output, stage="rollout", seed=gen.seed, config=config,
                  inputs=[prompts] + ([gen.system_prompt] if gen.system_prompt else []),
                  stats=stats, started=started)
    return stats


def file_stats(output: str) -> dict:
    """Statistics over every record in `output` (so a resumed run's sidecar is complete)."""
    n, turns, stops, answered = 0, Counter(), Counter(), 0
    calls, errors, failures = Counter(), Counter(), Counter()
    fmt, resp = 0, 0
    for _, r in iter_rows(output):
        n += 1
        turns[int(r.get("turns", 0))] += 1
        stops[str(r.get("stop"))] += 1
        answered += r.get("final_answer") is not None
        calls.update(r.get("tool_calls") or {})
        errors.update(r.get("tool_errors") or {})
        failures.update(r.get("tool_failures") or {})
        fmt += int(r.get("format_errors", 0))
        resp += int(r.get("response_tokens", 0))
    return {"trajectories": n, "answered": answered, "stop": dict(sorted(stops.items())),
            "turns": {str(k): v for k, v in sorted(turns.items())},
            "tool_calls": dict(sorted(calls.items())), "tool_errors": dict(sorted(errors.items())),
            "tool_failures": dict(sorted(failures.items())), "format_errors": fmt,
            "mean_response_tokens": round(resp / n, 1) if n else None}


def _report(stats: dict, output: str) -> None:
    speed = (f" in {stats['generate_s']:.1f} s ({stats['trajectories_per_s']:.2f} traj/s, "
             f"{stats['generated_tokens_per_s']:.0f} tokens/s)" if stats["new"] else "")
    stops = ", ".join(f"{k} {v}" for k, v in stats["stop"].items()) or "none"
    print(f"rollout: {stats['new']} new, {stats['skipped']} already in {output}{speed}; "
          f"{stats['trajectories']} trajectories, stops: {stops}", file=sys.stderr)
    if 0 < stats["new_engine_errors"] < stats["new"]:
        print(f"warning: {stats['new_engine_errors']} trajectories ended in engine_error "
              f"(first: {stats['first_error']})", file=sys.stderr)
