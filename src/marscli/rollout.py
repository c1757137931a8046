"""`marscli rollout`: G sampled trajectories per prompt, appended resumably.

- Trajectory `PROMPTID#k` (k = 0..G-1) is sample k of prompt PROMPTID; the G samples share
  `prompt_id`. Records are appended one complete record at a time (`jsonl.AppendJsonl`), so a
  killed run re-run with the same command skips what is written and loses nothing.
- `--shard i/N` (0-based) keeps the prompts whose id hashes to i (`shard_of`): a stable hash,
  so the N parts of a Slurm array together give exactly the ids of one run, whatever the order
  of the prompts file. All samples of a prompt land in the same shard.
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

import contextlib
import hashlib
import re
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from marscli.agent import Agent, AgentConfig
from marscli.engines import ENGINES, SamplingParams, make_engine
from marscli.errors import BadInput, RuntimeFailure, unknown_name
from marscli.images import open_image
from marscli.jsonl import AppendJsonl, iter_rows, read_rows, write_sidecar
from marscli.protocol import read_system_prompt
from marscli.records import Prompt, load_prompts
from marscli.tools import build_tools

CHECK_PIXELS = 1_000_000  # the up-front image check decodes at most this (JPEG draft mode)
OPENAI_OPTIONS = ("base_url", "model", "api_key_env", "tokenize_with", "timeout", "retries",
                  "concurrency", "backoff")


def parse_shard(spec: str | None, option: str = "--shard") -> tuple[int, int]:
    """`"i/N"` → (i, N), shards numbered 0..N-1 (`$SLURM_ARRAY_TASK_ID/N` with `--array
    0-(N-1)`); None → (0, 1), everything."""
    if spec is None:
        return 0, 1
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", spec)
    if not m:
        raise BadInput(f"{option}: {spec!r} is not i/N — e.g. 0/4 (shards are numbered 0..N-1)")
    i, n = int(m[1]), int(m[2])
    if n < 1:
        raise BadInput(f"{option}: {spec}: N must be at least 1")
    if i >= n:
        raise BadInput(f"{option}: {spec}: shard {i} is out of range — the shards of {n} are "
                       f"numbered 0..{n - 1}")
    return i, n


def shard_of(prompt_id: str, n: int) -> int:
    """The shard of a prompt id: a stable hash (not Python's `hash`, which is salted per run)."""
    return int.from_bytes(hashlib.sha256(prompt_id.encode()).digest()[:8], "big") % n


def media_dir(output: str | Path) -> Path:
    """`runs/traj.jsonl` → `runs/traj.media` (crops and thumbnails of that file)."""
    p = Path(output)
    return p.with_name(p.name.removesuffix(".jsonl") + ".media")


def check_images(src: str, prompts: list[tuple[int, Prompt]]) -> None:
    """Every image must exist and decode, before any generation; one error line names
    FILE:LINE and the image."""
    for line, p in prompts:
        for path in p.image_paths():
            try:
                open_image(path, max_pixels=CHECK_PIXELS)
            except BadInput as e:
                raise BadInput(f"{src}:{line}: image: {e}") from None


def _engine_args(engine: str, policy: str | None, engine_opts: dict, device: str,
                 batch_size: int) -> tuple[dict, str]:
    """The engine's keyword arguments and the name records carry as `policy`."""
    if engine not in ENGINES:
        raise unknown_name("engine", engine, ENGINES.names())
    if engine == "openai":
        if policy is not None:
            raise BadInput("--policy: not used by --engine openai (the server holds the model) — "
                           "give --model NAME, and --tokenize-with CKPT for token-exact segments")
        return dict(engine_opts), str(engine_opts.get("model") or "")
    for k in OPENAI_OPTIONS:
        if k != "tensor_parallel" and engine_opts.get(k) is not None:
            raise BadInput(f"--{k.replace('_', '-')}: only for --engine openai")
    if policy is None:
        raise BadInput(f"--policy: required for --engine {engine} — a checkpoint folder or hub id")
    tp = engine_opts.get("tensor_parallel")
    if tp is not None and engine != "vllm":
        raise BadInput("--tensor-parallel: only for --engine vllm")
    kwargs = {"device": device, "max_batch": batch_size}
    return (kwargs | {"tensor_parallel": tp} if tp else kwargs), policy


def run_rollout(prompts: str, output: str, *, policy: str | None = None, n: int = 8,
                engine: str = "hf", shard: tuple[int, int] = (0, 1), temperature: float = 1.0,
                top_p: float = 1.0, top_k: int = 0, max_turns: int = 10,
                max_response_tokens: int = 16_384, max_turn_tokens: int = 2_048,
                batch_size: int = 32, seed: int = 0, text_search: str | None = None,
                image_search: str | None = None, system_prompt_file: str | None = None,
                device: str = "cpu", engine_opts: dict | None = None,
                image_dir: str | None = None, progress: bool = True,
                search_opts: dict | None = None) -> dict:
    """Generate the missing trajectories of `prompts` (this shard) into `output`; return the
    sidecar statistics. Options are assumed in range (the CLI checks them). `search_opts`:
    `SearchOptions` fields for both search tools (timeout, attempts...)."""
    started = time.time()
    if output == "-":
        raise BadInput("-o -: rollout appends to a file so that it can resume — name one, "
                       "e.g. -o traj.jsonl")
    engine_opts = {k: v for k, v in (engine_opts or {}).items() if v is not None}
    eng_kwargs, policy_name = _engine_args(engine, policy, engine_opts, device, batch_size)
    base_prompt = read_system_prompt(system_prompt_file)
    rows = [(p.line, p) for p in load_prompts(prompts, image_dir)
            if shard_of(p.id, shard[1]) == shard[0]]
    check_images(prompts, rows)
    tools = build_tools(text_search=text_search, image_search=image_search,
                        **(search_opts or {}))
    jobs = [(p, k) for _, p in rows for k in range(n)]

    with contextlib.ExitStack() as stack:
        # An existing output is opened first (cutting a torn tail), so that a finished run
        # re-run loads no model; a new one is created only once the engine has loaded.
        out = stack.enter_context(AppendJsonl(output)) if Path(output).exists() else None
        pending = [(p, k) for p, k in jobs if out is None or f"{p.id}#{k}" not in out.ids]
        eng = make_engine(engine, policy, **eng_kwargs) if pending else None
        if out is None:
            out = stack.enter_context(AppendJsonl(output))
        cfg = AgentConfig(max_turns=max_turns, max_response_tokens=max_response_tokens,
                          max_turn_tokens=max_turn_tokens, system_prompt=base_prompt,
                          batch_size=batch_size,
                          sampling=SamplingParams(temperature=temperature, top_p=top_p,
                                                  top_k=top_k, max_new_tokens=max_turn_tokens,
                                                  seed=seed))
        run = _generate(eng, tools, cfg, pending, out, output, policy_name, progress)
    stats = {**file_stats(output), **run, "skipped": len(jobs) - len(pending)}
    stats["tools"] = {t.name: t.stats() for t in tools if hasattr(t, "stats")}
    if eng is not None and hasattr(eng, "stats"):
        stats["engine"] = eng.stats()
    _report(stats, output)
    if run["new"] and run["new_engine_errors"] == run["new"]:
        raise RuntimeFailure(f"every trajectory of this run failed at the engine (first: "
                             f"{run['first_error']}) — they are recorded with stop engine_error; "
                             "fix the engine, drop them from the output and re-run")
    config = {"engine": engine, "policy": policy_name, "n": n, "shard": f"{shard[0]}/{shard[1]}",
              "temperature": temperature, "top_p": top_p, "top_k": top_k,
              "max_turns": max_turns, "max_response_tokens": max_response_tokens,
              "max_turn_tokens": max_turn_tokens, "batch_size": batch_size,
              "text_search": text_search, "image_search": image_search,
              "search_options": search_opts or {},
              "system_prompt": system_prompt_file, "device": device,
              "engine_options": eng.config() if hasattr(eng, "config") else
              {k: v for k, v in engine_opts.items() if k in OPENAI_OPTIONS}}
    write_sidecar(output, stage="rollout", seed=seed, config=config,
                  inputs=[prompts] + ([system_prompt_file] if system_prompt_file else []),
                  stats=stats, started=started)
    return stats


def _generate(eng: Any, tools: list, cfg: AgentConfig, jobs: list[tuple[Prompt, int]],
              out: AppendJsonl, output: str, policy_name: str, progress: bool) -> dict:
    """Run the agent over `jobs`, appending each record; this run's counts and speeds."""
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)

    from marscli.trace import stderr_console

    run = {"new": 0, "new_engine_errors": 0, "first_error": None, "generated_tokens": 0}
    t0 = time.perf_counter()
    if jobs:
        console = stderr_console()
        bar = Progress(TextColumn("rollout"), BarColumn(), MofNCompleteColumn(),
                       TimeElapsedColumn(), TimeRemainingColumn(), console=console,
                       disable=not (progress and console.is_terminal))
        task = bar.add_task("rollout", total=len(jobs))

        def on_event(kind: str, traj: Any, data: dict) -> None:
            if kind == "stop":
                bar.advance(task)

        agent = Agent(eng, tools, cfg, media_dir=media_dir(output),
                      rel_to=Path(output).parent, policy_name=policy_name, on_event=on_event)
        with bar:
            for rec in agent.run(jobs):
                out.write(rec)
                run["new"] += 1
                run["generated_tokens"] += rec["generated_tokens"]
                if rec["stop"] == "engine_error":
                    run["new_engine_errors"] += 1
                    run["first_error"] = run["first_error"] or rec.get("error")
    wall = time.perf_counter() - t0
    run["generate_s"] = round(wall, 3)
    run["trajectories_per_s"] = round(run["new"] / wall, 3) if run["new"] else None
    run["generated_tokens_per_s"] = (round(run["generated_tokens"] / wall, 1)
                                     if run["new"] else None)
    return run


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
