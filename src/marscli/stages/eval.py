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
  `marscli eval summarize RESULTS.jsonl` (the older `--summarize RESULTS.jsonl`) recomputes it
  without generating (after `marscli merge`); `marscli eval rescore RESULTS.jsonl` (`--summarize
  ... --rescore`) first re-scores every record (under `--protocol`, with `--judge`) and rewrites
  the file atomically — the way to retry rows a failing judge left unscored, or to switch
  protocol (the settings file then names the new judge and protocol).
- Unscored records (the judge gave no verdict, the engine failed) are excluded from accuracy,
  counted per benchmark, and warned about; more than `--max-unscored` of them (default 5%)
  exits 1 with the results kept but no sidecar and no summary (a stale one is removed), so
  `make` does not take the eval for done. A run whose every trajectory failed at the engine
  exits 1 the same way. Never a silent 0.
- Tool health (`eval_health.py`): each record carries the endpoints it was made with
  (`endpoints`: search, summariser, judge; redacted), the agent's `tool_health` and the
  score's `judge_calls`; the summary adds them up per benchmark and category (`health`) and
  marks a group whose tool, page-fetch or judge failure rate exceeds
  `--max-tool-failure-rate` (default 5%) `broken_backend`, in the JSON, in the table and in a
  warning.

Departures from the release's evaluation are listed in `scoring/protocols.py`; marscli's
system prompts are its own (`--system-prompt FILE` replaces them).
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections import Counter, defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson

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
from marscli.benchmarks.paper import reported
from marscli.errors import BadInput, RuntimeFailure, check_range, unknown_name
from marscli.records.jsonl import iter_rows
from marscli.records.outputs import AtomicFile, AtomicJsonl
from marscli.records.provenance import stage_inputs, write_sidecar
from marscli.scoring.judge import JudgeOptions, make_judge
from marscli.scoring.protocols import ScoreContext, make_protocol
from marscli.stages.eval_health import (
    group_health,
    health_cells,
    health_lines,
    run_endpoints,
)
from marscli.tools import TOOL_NAMES
from marscli.train.trackers import check_tracker, log_stats, stats_tracker

MODES = ("agent", "direct")
DIRECT_PROMPT = """You answer questions about images. Look at the image carefully, reason \
briefly inside <thinking>...</thinking>, then give the final answer inside \
<answer>...</answer>: a short answer (a name, a number, a few words), or the option's letter \
for a multiple-choice question. You have no tools; answer in this one reply."""


def summary_path(results: str | Path) -> Path:
    """`runs/eval.jsonl` → `runs/eval.summary.json`."""
    p = Path(results)
    return p.with_name(p.name.removesuffix(".jsonl") + ".summary.json")


def image_cache(results: str | Path) -> Path:
    """Decoded benchmark images: one folder per results folder, shared by its shards."""
    return Path(results).parent / "eval-images"


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
    gen = _for_mode(gen, mode)
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
        _report_loaded(loaded, len(rows), shard)
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
    _fail_if_unscored(summary, output)
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


def _for_mode(gen: GenerationOptions, mode: str) -> GenerationOptions:
    """`--mode direct`: no tools, one turn (refusing options that say otherwise); `agent`: the
    tool loop, 10 turns unless told."""
    if mode == "agent":
        return replace(gen, max_turns=10 if gen.max_turns is None else gen.max_turns)
    for opt, val in (("--text-search", gen.text_search), ("--image-search", gen.image_search)):
        if val:
            raise BadInput(f"{opt}: not used with --mode direct (no tools) — drop it, "
                           "or use --mode agent")
    if gen.max_turns not in (None, 1):
        raise BadInput(f"--max-turns {gen.max_turns}: --mode direct answers in one turn")
    return replace(gen, max_turns=1)


def _report_loaded(loaded: Any, n: int, shard: tuple[int, int]) -> None:
    part = f", {n} in shard {shard[0]}/{shard[1]}" if shard[1] > 1 else ""
    skipped = "".join(f"; skipped {v} {k}" for k, v in loaded.skipped.items())
    names = sorted({str(p.extra.get("benchmark")) for _, p in loaded.prompts}) or \
        [loaded.benchmark]
    split = f", {loaded.split} split" if loaded.split else ""
    print(f"eval: {', '.join(names)} ({loaded.fmt} format{split}): {loaded.rows} rows{part}"
          f"{skipped}", file=sys.stderr)
    for note in loaded.notes:
        print(f"note: {note}", file=sys.stderr)


# ----------------------------------------------------------------------------- summary


def _tool_use(trajs: list[dict], names: set[str]) -> dict:
    """Per tool: how many trajectories called it 0, 1, 2... times, and the mean."""
    out = {}
    for name in sorted(names):
        counts = [int((t.get("tool_calls") or {}).get(name, 0)) for t in trajs]
        hist = Counter(counts)
        out[name] = {"histogram": {str(k): hist[k] for k in sorted(hist)},
                     "mean": round(sum(counts) / len(counts), 3) if counts else None}
    return out


def _group_stats(bench: str, proto: Any, items: list[dict], trajs: list[dict],
                 tools: set[str], max_rate: float) -> dict:
    agg = proto.aggregate(bench, items)
    turns = [int(t.get("turns", 0)) for t in trajs]
    health = group_health(trajs, max_rate)
    return {
        "accuracy": agg.pop("accuracy"), "metric": agg.pop("metric"),
        "broken_backend": health["broken_backend"],
        "items": len(items), "scored_items": sum(it["accuracy"] is not None for it in items),
        "trajectories": len(trajs),
        "unscored": sum(t["score"].get("status") == "unscored" for t in trajs),
        "mean_turns": round(sum(turns) / len(turns), 3) if turns else None,
        "tool_use": _tool_use(trajs, tools), "health": health, **agg}


def summarize(results: str, max_unscored: float = 0.05,
              max_tool_failure_rate: float = MAX_TOOL_FAILURE_RATE) -> dict:
    """The summary of a whole results file (any number of benchmarks, shards, resumes)."""
    by_bench: dict[str, list[tuple[int, dict]]] = defaultdict(list)
    seen: dict[tuple[str, str], int] = {}
    for line, r in iter_rows(results):
        score = r.get("score")
        if not isinstance(score, dict):
            raise BadInput(f"{results}:{line}: score: missing — not an eval results row (score "
                           f"rollout output with: marscli eval rescore {results})")
        rid = r.get("id")
        if not isinstance(rid, str):
            raise BadInput(f"{results}:{line}: id: missing required field")
        bench = str(r.get("benchmark") or "unknown")
        if (bench, rid) in seen:
            raise BadInput(f"{results}:{line}: id: duplicate {rid!r} in {bench} (first on line "
                           f"{seen[bench, rid]}) — the same shard merged twice?")
        seen[bench, rid] = line
        by_bench[bench].append((line, r))
    policy = _one_policy(results, [row for rows in by_bench.values() for row in rows])
    benches, total, unscored = {}, 0, 0
    for bench, rows in sorted(by_bench.items()):
        benches[bench] = _bench_summary(results, bench, rows, max_tool_failure_rate)
        total += benches[bench]["trajectories"]
        unscored += benches[bench]["unscored"]
    protocols = sorted({b["protocol"] for b in benches.values()})
    return {"v": 1, "results": str(results), "protocol": "+".join(protocols) or None,
            **policy, "trajectories": total, "unscored": unscored,
            "max_unscored": max_unscored, "over_unscored": unscored > max_unscored * total,
            "max_tool_failure_rate": max_tool_failure_rate,
            "broken_backend": [b for b, s in benches.items() if s["broken_backend"]],
            "benchmarks": benches}


def _one_policy(results: str, rows: list[tuple[int, dict]]) -> dict:
    """The policy every record was made with (`policy`, and `weights` where eval recorded
    them): one accuracy over two checkpoints' records would name neither, so a mix is refused.
    Two records are one policy when their weights agree (a checkpoint moved between a run and
    its resume), or, where either has none, their names do."""
    first: tuple[int, str | None, str | None] | None = None
    for line, r in sorted(rows, key=lambda lr: lr[0]):
        name, weights = r.get("policy") or None, r.get("weights") or None
        if name is None and weights is None:
            continue  # a hand-made record: nothing to compare
        if first is None:
            first = (line, name, weights)
            continue
        same = weights == first[2] if weights and first[2] else name == first[1]
        if not same:
            how = " (same name, other weights)" if name == first[1] else ""
            raise BadInput(f"{results}:{line}: policy: records of two policies, {first[1]!r} "
                           f"(line {first[0]}) and {name!r}{how} — a summary is one policy's: "
                           "summarize each one's records apart, e.g. jq -c 'select(.policy == "
                           "\"NAME\")'")
    return {"policy": first[1] if first else None, "weights": first[2] if first else None}


def _bench_summary(results: str, bench: str, rows: list[tuple[int, dict]],
                   max_rate: float) -> dict:
    protocols = {str(r["score"].get("protocol", "mars")) for _, r in rows}
    if len(protocols) > 1:
        raise BadInput(f"{results}: {bench}: records scored under several protocols "
                       f"({', '.join(sorted(protocols))}) — re-score them all with "
                       f"marscli eval rescore {results} --protocol NAME")
    proto = make_protocol(protocols.pop())
    modes = sorted({str(r.get("mode", "agent")) for _, r in rows})
    trajs = [r for _, r in rows]
    items: dict[str, dict] = {}
    samples: dict[str, list[float]] = defaultdict(list)
    for r in trajs:
        pid = str(r.get("prompt_id") or r["id"].rsplit("#", 1)[0])
        if pid not in items:
            items[pid] = {"id": pid, "category": r.get("category") or "all",
                          "cycle_category": r.get("cycle_category"),
                          "data_split": r.get("data_split"), "n": 0}
        items[pid]["n"] += 1
        if "accuracy" in r["score"]:
            samples[pid].append(float(r["score"]["accuracy"]))
    for pid, it in items.items():
        it["accuracy"] = sum(samples[pid]) / len(samples[pid]) if samples[pid] else None
    tools = {k for t in trajs for k in (t.get("tool_calls") or {})}
    if "agent" in modes:
        tools |= set(TOOL_NAMES[:1])  # zoom-in is always offered to the agent
    splits = sorted({str(r["split"]) for r in trajs if r.get("split")})
    out = {"protocol": proto.name, "mode": "+".join(modes), "split": "+".join(splits) or None,
           **_group_stats(bench, proto, list(items.values()), trajs, tools, max_rate)}
    ns = [it["n"] for it in items.values()]
    out["samples_per_item"] = {"min": min(ns), "max": max(ns)}
    out["stops"] = dict(sorted(Counter(str(t.get("stop")) for t in trajs).items()))
    out["paper"] = reported(bench, modes[0] if len(modes) == 1 else "agent")
    cats = sorted({it["category"] for it in items.values()})
    out["categories"] = {}
    for cat in cats:
        cit = [it for it in items.values() if it["category"] == cat]
        ctr = [t for t in trajs if (t.get("category") or "all") == cat]
        out["categories"][cat] = _group_stats(bench, proto, cit, ctr, tools, max_rate)
    return out


def write_summary(summary: dict, results: str) -> Path:
    path = summary_path(results)
    with AtomicFile(path) as fh:
        fh.write(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    return path


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


def _fail_if_unscored(summary: dict, results: str) -> None:
    """Too many unscored: no summary (a stale one is removed), so make retries the stage."""
    if summary["over_unscored"]:
        summary_path(results).unlink(missing_ok=True)
        raise RuntimeFailure(
            f"{summary['unscored']} of {summary['trajectories']} trajectories unscored (over "
            f"{summary['max_unscored']:.0%}) — {results} keeps them, no summary was written; "
            f"fix the judge and re-score them: marscli eval rescore {results} "
            "--judge SPEC (cached verdicts are reused)")


# ----------------------------------------------------------------------------- summarize only


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
        settings = _settings_of(results)  # likewise a bad settings file
        _rescore(results, protocol, judge_spec, judge_opts)
        _rescored_settings(results, settings, protocol, judge_spec)
    elif protocol is not None:
        raise BadInput("--protocol: with --summarize it needs --rescore (the records hold "
                       "their scores; --rescore re-scores them under --protocol)")
    summary = summarize(results, max_unscored=max_unscored,
                        max_tool_failure_rate=max_tool_failure_rate)
    print_summary(summary)
    _fail_if_unscored(summary, results)
    if rescore:
        write_sidecar(results, stage="eval --rescore", config={
            "protocol": protocol, "judge": judge_spec, "max_unscored": max_unscored},
            inputs=[results], stats={"trajectories": summary["trajectories"],
                                     "unscored": summary["unscored"]}, started=started)
    write_summary(summary, results)
    return summary


def _settings_of(results: str) -> dict | None:
    """The settings RESULTS was generated with (None: no settings file), read before
    rescoring: a bad one is BadInput before any judge call is paid or RESULTS rewritten."""
    from marscli.agent.runner import read_settings, settings_path

    try:
        return read_settings(settings_path(results), "remove it (it only guards a resume of "
                                                     "the eval) and re-run")
    except FileNotFoundError:
        return None


def _rescored_settings(results: str, settings: dict | None, protocol: str | None,
                       judge_spec: str) -> None:
    """After `--rescore`, the settings file names the judge (and protocol) the records now
    carry, so that a resume with them is not refused."""
    from marscli.agent.runner import settings_path
    from marscli.secrets import redact

    if settings is None:
        return
    settings.update(redact({"judge": judge_spec}))
    if protocol is not None:
        settings["protocol"] = protocol
    with AtomicFile(settings_path(results)) as fh:
        fh.write(orjson.dumps({"v": 1, "settings": settings}, option=orjson.OPT_INDENT_2))


def _rescore(results: str, protocol: str | None, judge_spec: str,
             judge_opts: JudgeOptions | None) -> None:
    from concurrent.futures import ThreadPoolExecutor

    rows = [r for _, r in iter_rows(results)]
    judge = make_judge(judge_spec, judge_opts)
    try:
        ctx = ScoreContext(judge=judge, base=Path(results).parent)

        def one(r: dict) -> dict:
            name = protocol or str((r.get("score") or {}).get("protocol") or "mars")
            return make_protocol(name).score(r, ctx)

        workers = judge_opts.concurrency if judge_opts else 8
        with ThreadPoolExecutor(max_workers=workers) as pool:
            scores = list(pool.map(one, rows))
    finally:
        judge.close()
    # rewriting the results in place (atomically) is what --rescore is for
    with AtomicJsonl(results, replaces_input=True) as w:
        for r, s in zip(rows, scores):
            ends = {**(r.get("endpoints") or {}), "judge": judge.address}
            w.write({**r, "score": s, "endpoints": ends})
    print(f"eval: re-scored {len(rows)} records in {results}", file=sys.stderr)


__all__ = ["DIRECT_PROMPT", "MODES", "format_names", "image_cache", "print_summary",
           "run_eval", "run_summarize", "summarize", "summary_path", "write_summary"]
