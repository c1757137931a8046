"""The summary of an eval results file: per benchmark and category, the accuracy under the
records' protocol, turns, tool use, stops, tool health and the paper's numbers; the policy the
records were made with (two are refused); unscored records counted, never scored 0.

Unscored records (the judge gave no verdict, the engine failed) are excluded from accuracy,
counted per benchmark, and warned about; more than `--max-unscored` of them (default 5%)
exits 1 with the results kept but no sidecar and no summary (a stale one is removed), so
`make` does not take the eval for done. A run whose every trajectory failed at the engine
exits 1 the same way. Never a silent 0.

Tool health (`health.py`): each record carries the endpoints it was made with
(`endpoints`: search, summariser, judge; redacted), the agent's `tool_health` and the
score's `judge_calls`; the summary adds them up per benchmark and category (`health`) and
marks a group whose tool, page-fetch or judge failure rate exceeds
`--max-tool-failure-rate` (default 5%) `broken_backend`, in the JSON, in the table and in a
warning.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import orjson

from marscli.agent.generation import MAX_TOOL_FAILURE_RATE
from marscli.benchmarks.paper import reported
from marscli.errors import BadInput, RuntimeFailure
from marscli.evaluation.health import group_health
from marscli.evaluation.paths import summary_path
from marscli.records.jsonl import iter_rows
from marscli.records.outputs import AtomicFile
from marscli.scoring.protocols import make_protocol
from marscli.tools import TOOL_NAMES


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


def fail_if_unscored(summary: dict, results: str) -> None:
    """Too many unscored: no summary (a stale one is removed), so make retries the stage."""
    if summary["over_unscored"]:
        summary_path(results).unlink(missing_ok=True)
        raise RuntimeFailure(
            f"{summary['unscored']} of {summary['trajectories']} trajectories unscored (over "
            f"{summary['max_unscored']:.0%}) — {results} keeps them, no summary was written; "
            f"fix the judge and re-score them: marscli eval rescore {results} "
            "--judge SPEC (cached verdicts are reused)")
