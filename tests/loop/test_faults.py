"""Fault injection: the seeded chaos server (tests/chaos.py) fails 30% of requests (HTTP 500,
timeouts, malformed JSON) or answers slowly, as the OpenAI-compatible engine, the retriever and
the judge at once. rollout, reward and eval still finish; what failed for good shows in the
records and in the stage statistics, the counts agree, and no distinct request is ever sent
more often than the configured number of attempts."""

from __future__ import annotations

import orjson
import pytest

from marscli.scoring.judge import JudgeOptions

from chaos import FAULTS, ChaosServer
from helpers import judge_options, read_jsonl, write_prompts

TIMEOUT = 1.0  # every client's per-request timeout; the chaos timeouts sleep past it
RETRIES = 1  # two attempts per request: enough failures survive to be seen
BOUND = RETRIES + 1
# Chaos seeds whose faults leave failures in every stage (the draws are reproducible: they hash
# the request, not its arrival order).
SEED, JUDGE_SEED, EVAL_SEED = 1, 5, 6


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("MARSCLI_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)


def engine_opts(server: ChaosServer) -> dict:
    return {"base_url": f"{server.url}/v1", "model": "chaos", "timeout": TIMEOUT,
            "retries": RETRIES, "concurrency": 8, "backoff": 0.05}


def search_opts() -> dict:
    return {"timeout": TIMEOUT, "attempts": BOUND, "backoff": 0.05, "cache": None}


def judge_opts(tmp_path) -> JudgeOptions:
    return JudgeOptions(timeout_s=TIMEOUT, attempts=BOUND, concurrency=8, backoff_s=0.05,
                        cache_path=str(tmp_path / "judge.sqlite"))


def search_failures(rec: dict) -> int:
    return sum(1 for s in rec["segments"]
               if s["role"] == "tool" and s.get("failed")
               and s["text"].startswith("search failed:"))


def check_rollout_records(recs: list[dict], stats: dict, ids: set[str]) -> None:
    """Every id once; each failure visible in its record and counted in the statistics."""
    got = [r["id"] for r in recs]
    assert len(got) == len(set(got)) and set(got) == ids
    errors = [r for r in recs if r["stop"] == "engine_error"]
    assert all(r["error"].startswith("POST ") and "attempt" in r["error"] for r in errors)
    assert stats["stop"].get("engine_error", 0) == len(errors)
    for r in recs:  # a failed search is the backend's fault: flagged, counted apart
        assert r["tool_failures"].get("text_search_tool", 0) == search_failures(r)
        assert not r["tool_errors"]  # the script never makes a mistake of its own
    assert stats["tool_failures"].get("text_search_tool", 0) == sum(map(search_failures, recs))
    # the run is not lost: most trajectories got through to an answer
    assert sum(r["stop"] == "answer" for r in recs) >= len(recs) // 2


@pytest.fixture(scope="module")
def rollout_run(tmp_path_factory):
    from marscli.stages.rollout import run_rollout

    tmp = tmp_path_factory.mktemp("chaos-rollout")
    ids = [f"q{i}" for i in range(8)]
    prompts = write_prompts(tmp / "p.jsonl", ids)
    out = tmp / "out" / "t.jsonl"
    with ChaosServer(seed=SEED, timeout_s=TIMEOUT) as server:
        stats = run_rollout(str(prompts), str(out), engine="openai", n=2, max_turns=4,
                            engine_opts=engine_opts(server), seed=SEED, progress=False,
                            text_search=f"retriever:{server.url}", search_opts=search_opts(),
                            max_tool_failure_rate=1.0)  # chaos fails searches on purpose
    return tmp, out, stats, server, {f"{i}#{k}" for i in ids for k in range(2)}


def test_rollout_finishes_through_chaos(rollout_run):
    _, out, stats, server, ids = rollout_run
    recs = read_jsonl(out)
    check_rollout_records(recs, stats, ids)
    assert all(server.faults[k] > 0 for k in FAULTS), server.faults
    eng = stats["engine"]
    assert eng["requests"] == server.requests("/chat/completions")
    assert 0 < eng["failed_requests"] == stats["stop"]["engine_error"]
    tool = stats["tools"]["text_search_tool"]
    assert tool["attempts"] == server.requests("/retrieve")
    assert 0 < tool["failures"] == stats["tool_failures"]["text_search_tool"]
    meta = orjson.loads(out.with_name("t.jsonl.meta.json").read_bytes())
    assert meta["stats"]["engine"] == eng and meta["stats"]["tools"]["text_search_tool"] == tool


def test_rollout_attempts_stay_within_the_bound(rollout_run):
    _, _, _, server, _ = rollout_run
    assert server.max_attempts("/chat/completions") == BOUND  # retried, never beyond
    assert server.max_attempts("/retrieve") == BOUND


def test_reward_finishes_through_chaos(rollout_run):
    from marscli.stages.reward import main as reward_main

    tmp, out, _, _, _ = rollout_run
    scored = tmp / "scored.jsonl"
    with ChaosServer(seed=JUDGE_SEED, timeout_s=TIMEOUT) as judge:
        stats = reward_main(str(out), str(scored), f"openai:chaos@{judge.url}/v1",
                            max_unscored=1.0,
                            judge_options=judge_options(TIMEOUT, RETRIES, backoff=0.05,
                                                        cache=str(tmp / "judge.sqlite")))
    rows = read_jsonl(scored)
    unscored = [r for r in rows if r["reward"].get("status") == "unscored"]
    assert stats["unscored"] == len(unscored) > 0
    assert all(r["reward"]["error"].startswith("judge gave no verdict after 2 attempts")
               for r in unscored)
    answered = [r for r in rows if r["stop"] == "answer"]
    assert stats["judge_calls"] == len(answered)  # every answer is inexact: all reach the judge
    assert stats["judge_requests"] == judge.requests("/chat/completions")
    assert stats["judge_retries"] == stats["judge_requests"] - stats["judge_calls"] > 0
    assert judge.max_attempts() == BOUND
    scored_ok = [r for r in rows if "total" in r["reward"]]
    assert scored_ok and all(r["reward"]["accuracy"] == 1.0 for r in scored_ok
                             if r["stop"] == "answer")
    meta = orjson.loads(scored.with_name("scored.jsonl.meta.json").read_bytes())
    assert meta["stats"]["unscored"] == len(unscored)


def test_eval_finishes_through_chaos(tmp_path):
    from marscli.stages.eval import run_eval

    ids = [f"e{i}" for i in range(8)]
    (tmp_path / "bench").mkdir()
    bench = write_prompts(tmp_path / "bench" / "b.jsonl", ids)
    out = tmp_path / "eval" / "r.jsonl"
    with ChaosServer(seed=EVAL_SEED, timeout_s=TIMEOUT) as server:
        summary = run_eval(str(bench), str(out), engine="openai", engine_opts=engine_opts(server),
                           judge_spec=f"openai:chaos@{server.url}/v1",
                           judge_opts=judge_opts(tmp_path), text_search=f"retriever:{server.url}",
                           search_opts=search_opts(), max_turns=4, max_unscored=1.0,
                           progress=False)
    recs = read_jsonl(out)
    assert sorted(r["id"] for r in recs) == sorted(f"{i}#0" for i in ids)
    failed = [r for r in recs if r["stop"] == "engine_error" or search_failures(r)
              or r["score"].get("status") == "unscored"]
    assert failed, "the seeded chaos must leave a visible failure"
    unscored = [r for r in recs if r["score"].get("status") == "unscored"]
    assert summary["unscored"] == len(unscored) and summary["trajectories"] == len(recs)
    assert all(r["score"].get("error") for r in unscored)
    meta = orjson.loads((tmp_path / "eval" / "r.jsonl.meta.json").read_bytes())
    assert meta["stats"]["unscored"] == len(unscored)
    # engine, retriever and judge share the server; no request went out more than BOUND times
    assert server.max_attempts("/retrieve") <= BOUND
    assert server.max_attempts("/chat/completions") <= BOUND
    assert sum(server.faults.values()) > 0
