"""Tool health in eval's summary: were the search backends, the page fetches, the summariser and
the judge working while the score was measured?

The reproductions that fell 10-20 points short of the paper were traced to failing search
backends and page fetches that no summary showed. Here every benchmark and category of a
summary gets a `health` block, added up from its records:
- per tool: calls, failures by kind (`backend_error`, `timeout`: after the retries; `empty`:
  the search found nothing; `unknown`: a failure in a record written before kinds were
  recorded), the failure rate (failures / calls) and cache hits (`tool_health` in the
  trajectory record, `marscli.tools.HEALTH_KEYS`);
- pages: fetched, read, and the success rate (serper `fetch_pages`);
- summariser failures (each also fails its search call);
- the judge: verdicts asked, retries, failures (`score.judge_calls`), and its failure rate;
- image-search cache hits (the row's precomputed results or the search cache answered);
- the endpoints the records were made with (`endpoints`, redacted), each distinct value.

A group is `broken_backend` when a rate exceeds `max_tool_failure_rate` (`--max-tool-failure-
rate`, default 5%): a tool's failure rate, the page fetches' failure rate (1 - success) or the
judge's; `health.warnings` says which. The accuracy stays what it is; the table marks it and
`eval summarize` warns, so that nobody takes it for the policy's score.
"""

from __future__ import annotations

from collections import Counter

from marscli.agent.generation import MAX_TOOL_FAILURE_RATE
from marscli.agent.tool_health import rate as _rate
from marscli.agent.tool_health import tool_rates, tool_warnings
from marscli.agent.tools_config import RELEASE_TOOLS

ENDPOINT_KEYS = ("text_search", "summarizer", "image_search", "judge")


def run_endpoints(tools: list, judge: object) -> dict[str, str]:
    """What a run's records carry as `endpoints`: each tool's servers and the judge's,
    redacted by the tools and the judge."""
    out: dict[str, str] = {}
    for t in tools:
        if hasattr(t, "endpoints"):
            out.update(t.endpoints())
    out["judge"] = getattr(judge, "address", None) or getattr(judge, "name", "")
    return out


def group_health(trajs: list[dict], max_rate: float = MAX_TOOL_FAILURE_RATE) -> dict:
    """The `health` block of a group of eval records (module docstring)."""
    calls: Counter = Counter()
    failed: Counter = Counter()
    per_tool: dict[str, Counter] = {}
    judge: Counter = Counter()
    endpoints: dict[str, set[str]] = {}
    for t in trajs:
        calls.update(t.get("tool_calls") or {})
        failed.update(t.get("tool_failures") or {})
        for name, h in (t.get("tool_health") or {}).items():
            per_tool.setdefault(name, Counter()).update(h)
        judge.update((t.get("score") or {}).get("judge_calls") or {})
        for key, val in (t.get("endpoints") or {}).items():
            endpoints.setdefault(key, set()).add(str(val))
    tools, pages = tool_rates(calls, failed, per_tool), Counter()
    for name in tools:
        h = per_tool.get(name, Counter())
        pages.update(fetched=h["pages_fetched"], ok=h["pages_ok"])
    summarizer = sum(h["summarizer_failures"] for h in per_tool.values())
    image_hits = sum(tools[n]["cache_hits"] for n in tools
                     if RELEASE_TOOLS.get(n, n) == "image_search_tool")
    out = {
        "tools": tools,
        "failure_rate": max((v["failure_rate"] for v in tools.values()), default=None),
        "pages": {"fetched": pages["fetched"], "ok": pages["ok"],
                  "success_rate": _rate(pages["ok"], pages["fetched"])},
        "summarizer_failures": summarizer,
        "judge": {"asked": judge["asked"], "retries": judge["retries"],
                  "failures": judge["failures"], "cache_hits": judge["cache_hits"],
                  "failure_rate": _rate(judge["failures"], judge["asked"])},
        "image_search_cache_hits": image_hits,
        "endpoints": {k: sorted(endpoints[k]) for k in ENDPOINT_KEYS if k in endpoints},
    }
    out["warnings"] = health_warnings(out, max_rate)
    out["broken_backend"] = bool(out["warnings"])
    return out


def health_warnings(h: dict, max_rate: float) -> list[str]:
    """One line per rate of a `health` block over `max_rate`."""
    out = tool_warnings(h["tools"], max_rate)
    p = h["pages"]
    if p["success_rate"] is not None and 1 - p["success_rate"] > max_rate:
        out.append(f"page fetches: {p['fetched'] - p['ok']} of {p['fetched']} failed")
    j = h["judge"]
    if j["failure_rate"] is not None and j["failure_rate"] > max_rate:
        out.append(f"judge: {j['failures']} of {j['asked']} verdicts failed "
                   f"({j['retries']} retries)")
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def health_cells(h: dict | None) -> tuple[str, str, str]:
    """The table's health columns: tool failure % (the worst tool), pages read %, judge
    failures/retries."""
    if not h:
        return "-", "-", "-"
    j = h["judge"]
    judge = f"{j['failures']}/{j['retries']}" if j["asked"] else "-"
    return _pct(h["failure_rate"]), _pct(h["pages"]["success_rate"]), judge


def health_lines(bench: str, h: dict) -> list[str]:
    """The health of a benchmark in words, for stderr under the table."""
    calls = ", ".join(f"{n} {t['calls']}" for n, t in h["tools"].items()) or "none"
    fails = "; ".join(f"{n} " + ", ".join(f"{k} {v}" for k, v in t["failures"].items())
                      for n, t in h["tools"].items() if t["failures"]) or "none"
    p, j = h["pages"], h["judge"]
    lines = [f"health: {bench}: tool calls {calls}; failures {fails}; pages read "
             f"{p['ok']}/{p['fetched']}; summariser failures {h['summarizer_failures']}; "
             f"judge {j['asked']} asked, {j['retries']} retries, {j['failures']} failed, "
             f"{j['cache_hits']} cached; image-search cache hits "
             f"{h['image_search_cache_hits']}"]
    if h["endpoints"]:
        lines.append(f"health: {bench}: endpoints " + "; ".join(
            f"{k} {', '.join(v)}" for k, v in h["endpoints"].items()))
    return lines


def checkpoint_health(benches: dict[str, dict], max_rate: float) -> dict:
    """A checkpoint's health over its benchmarks' `health` blocks (`eval summarize RUN`): the
    worst tool failure rate, the pages read, the judge's failures and retries, and the
    benchmarks measured with a broken backend at `max_rate`. None where no summary has one
    (summaries written before health was)."""
    blocks = {n: b["health"] for n, b in benches.items() if isinstance(b.get("health"), dict)}
    if not blocks:
        return {"failure_rate": None, "pages": {"fetched": 0, "ok": 0, "success_rate": None},
                "judge": None, "broken_backend": [], "known": False}
    fetched = sum(h["pages"]["fetched"] for h in blocks.values())
    ok = sum(h["pages"]["ok"] for h in blocks.values())
    judge = Counter()
    for h in blocks.values():
        judge.update({k: h["judge"][k] for k in ("asked", "retries", "failures")})
    rates = [h["failure_rate"] for h in blocks.values() if h["failure_rate"] is not None]
    return {"failure_rate": max(rates, default=None),
            "pages": {"fetched": fetched, "ok": ok, "success_rate": _rate(ok, fetched)},
            "judge": dict(judge),
            "broken_backend": sorted(n for n, h in blocks.items()
                                     if health_warnings(h, max_rate)),
            "known": True}


def checkpoint_cells(h: dict) -> tuple[str, str, str]:
    """`eval summarize RUN`'s health columns (as `health_cells`)."""
    if not h["known"]:
        return "-", "-", "-"
    j = h["judge"]
    judge = f"{j['failures']}/{j['retries']}" if j.get("asked") else "-"
    return _pct(h["failure_rate"]), _pct(h["pages"]["success_rate"]), judge
