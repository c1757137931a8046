"""A rollout's statistics over its records (the sidecar's `stats`), and its refusal of a run
whose tools failed too often (stages/rollout.py's docstring)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from marscli.agent.tool_health import BACKEND_FAILURES, tool_rates, tool_warnings
from marscli.errors import RuntimeFailure

# what `tally` reads of a record: all `-o -` keeps of the records it streamed
TALLIED = ("turns", "stop", "final_answer", "tool_calls", "tool_errors", "tool_failures",
           "tool_health", "format_errors", "response_tokens")


def tally(records: Iterable[dict]) -> dict:
    """Counts of stops, turns, answers, tool calls and errors over `records` (the whole
    output file, so a resumed run's sidecar is complete; or what `-o -` streamed)."""
    n, turns, stops, answered = 0, Counter(), Counter(), 0
    calls, errors, failures = Counter(), Counter(), Counter()
    health: dict[str, Counter] = {}
    fmt, resp = 0, 0
    for r in records:
        n += 1
        turns[int(r.get("turns") or 0)] += 1
        stops[str(r.get("stop"))] += 1
        answered += r.get("final_answer") is not None
        calls.update(r.get("tool_calls") or {})
        errors.update(r.get("tool_errors") or {})
        failures.update(r.get("tool_failures") or {})
        for name, h in (r.get("tool_health") or {}).items():
            health.setdefault(name, Counter()).update(h)
        fmt += int(r.get("format_errors") or 0)
        resp += int(r.get("response_tokens") or 0)
    return {"trajectories": n, "answered": answered, "stop": dict(sorted(stops.items())),
            "turns": {str(k): v for k, v in sorted(turns.items())},
            "tool_calls": dict(sorted(calls.items())), "tool_errors": dict(sorted(errors.items())),
            "tool_failures": dict(sorted(failures.items())),
            "tool_failure_rates": {k: v["failure_rate"] for k, v in tool_rates(
                calls, failures, health, BACKEND_FAILURES).items()},
            "tool_health": {k: dict(sorted(v.items())) for k, v in sorted(health.items())},
            "format_errors": fmt,
            "mean_response_tokens": round(resp / n, 1) if n else None}


def fail_if_tools_broken(stats: dict, output: str, max_rate: float) -> None:
    """Exit 1 when a tool failed over `max_rate` of its calls in the output's records (the
    stages/rollout.py docstring), naming the tool and its rate."""
    tools = tool_rates(stats["tool_calls"], stats["tool_failures"], stats["tool_health"],
                       BACKEND_FAILURES)
    if broken := tool_warnings(tools, max_rate):
        kept = "" if output == "-" else \
            f"; the {stats['trajectories']} records are kept in {output}"
        raise RuntimeFailure(
            f"{'; '.join(broken)}, over --max-tool-failure-rate {max_rate:.0%}{kept} — its "
            "backend is failing: check it (marscli preflight), drop the trajectories whose "
            "tools failed (jq -c 'select((.tool_failures // {}) == {})') and re-run")
