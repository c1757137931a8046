"""How a run's tools fared, per tool, from its trajectory records, against the threshold over
which a tool's backend counts as broken (`--max-tool-failure-rate`, generation.py). Shared by
eval, which marks the benchmark and warns (`evaluation/health.py`), and rollout, which exits 1
(`agent/tally.py`): a search backend that keeps failing turns into observations of failures,
and a policy trained on them learns the backend's outage, not the task.

A call has failed when its tool segment says `"failed": true` (the record's `tool_failures`);
`tool_health` splits them by kind (`backend_error`, `timeout` after the retries; `empty`: the
search found nothing), and failures in records written before kinds were recorded are
`unknown`. A tool's failure rate is its failures over its calls. Eval counts the empty results
too (its score suffers from them); rollout counts the backend's failures only
(`BACKEND_FAILURES`: the segments with `"failed": true`), since a query that finds nothing is the
policy's doing and a fair observation to learn from.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from marscli.tools import FAILURE_KINDS

BACKEND_FAILURES = ("backend_error", "timeout")


def rate(bad: int, n: int) -> float | None:
    return round(bad / n, 4) if n else None


def tool_rates(calls: Mapping[str, int], failed: Mapping[str, int],
               health: Mapping[str, Mapping[str, int]],
               kinds: tuple[str, ...] = FAILURE_KINDS) -> dict[str, dict]:
    """Per tool called: calls, failures by kind (of `kinds`), the failure rate and cache hits,
    from the summed `tool_calls`, `tool_failures` and `tool_health` of a run's records."""
    tools = {}
    for name in sorted(calls):
        h = Counter(health.get(name) or {})
        counts = {k: h[k] for k in kinds if h[k]}
        unknown = failed.get(name, 0) - h["backend_error"] - h["timeout"]
        if unknown > 0:  # records from before kinds were recorded
            counts["unknown"] = unknown
        tools[name] = {"calls": calls[name], "failures": counts,
                       "failure_rate": rate(sum(counts.values()), calls[name]),
                       "cache_hits": h["cache_hits"]}
    return tools


def tool_warnings(tools: Mapping[str, dict], max_rate: float) -> list[str]:
    """One line per tool of `tool_rates` whose failure rate is over `max_rate`."""
    out = []
    for name, t in tools.items():
        if t["failure_rate"] is not None and t["failure_rate"] > max_rate:
            kinds = ", ".join(f"{k} {v}" for k, v in t["failures"].items())
            out.append(f"{name}: {t['failure_rate']:.1%} of {t['calls']} calls failed ({kinds})")
    return out
