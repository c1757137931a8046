"""The asynchronous agent loop (`Agent._run_async`), on a scripted engine given `agenerate`:
the same records as the lock-step loop, token for token; each trajectory moving on its own
(a slow request holds up only its own trajectory); `max_inflight` respected; an engine
failure ending the run with that failure; a caller that stops early leaving no thread behind.
On vLLM-CPU the same equality is checked in tests/serving/test_serve.py."""

from __future__ import annotations

import asyncio
import threading

import pytest

from marscli.agent.loop import Agent, AgentConfig
from marscli.engines import SamplingParams
from marscli.records.schema import Prompt
from marscli.tools import build_tools

from helpers import REPLIES, big_scene, strip_ms
from scripted import ScriptedEngine


class AsyncScripted(ScriptedEngine):
    """The scripted engine with an asynchronous path; `slow` keys wait `pause` s a request."""

    def __init__(self, processor, replies, slow=(), pause=0.0, fail_on=None) -> None:
        super().__init__(processor, replies)
        self.slow, self.pause, self.fail_on = set(slow), pause, fail_on
        self.inflight = self.most = 0
        self.finished: list[str] = []
        self._lock = threading.Lock()

    async def agenerate(self, request, params):
        with self._lock:
            self.inflight += 1
            self.most = max(self.most, self.inflight)
        try:
            await asyncio.sleep(self.pause if request.key in self.slow else 0.001)
            if request.key == self.fail_on:
                raise RuntimeError(f"engine down at {request.key}")
            return self.generate([request], params)[0]
        finally:
            with self._lock:
                self.inflight -= 1


@pytest.fixture(scope="module")
def world(tiny_model, tmp_path_factory):
    from marscli.qwen.policy import load_processor

    tmp = tmp_path_factory.mktemp("async")
    big_scene(tmp / "scene.png")
    prompts = [Prompt(id=f"q{i}", question="What year is on the sign?", images=["scene.png"],
                      answer=["1997"], base=tmp) for i in range(3)]
    return load_processor(str(tiny_model)), tmp, [(p, s) for p in prompts for s in range(2)]


def agent(engine, tmp, **cfg) -> Agent:
    return Agent(engine, build_tools(), AgentConfig(max_turns=10, sampling=SamplingParams(),
                                                    **cfg),
                 media_dir=tmp / "crops", rel_to=tmp, policy_name="p")


def by_id(recs):
    return {r["id"]: strip_ms(r) for r in recs}


def test_async_equals_lockstep_token_for_token(world):
    proc, tmp, jobs = world
    eng = AsyncScripted(proc, REPLIES)
    lock = agent(eng, tmp, lockstep=True)
    assert not lock.asynchronous and agent(eng, tmp).asynchronous
    want = by_id(lock.run(jobs))
    got = by_id(agent(AsyncScripted(proc, REPLIES), tmp).run(jobs))
    assert got == want and len(got) == len(jobs)
    assert all(r["turns"] == len(REPLIES) for r in got.values())


def test_a_slow_trajectory_holds_up_only_itself(world):
    """q0#0 waits 0.3 s a request; the other five finish first, in whatever order."""
    proc, tmp, jobs = world
    eng = AsyncScripted(proc, REPLIES, slow={"q0#0"}, pause=0.3)
    order = [r["id"] for r in agent(eng, tmp).run(jobs)]
    assert sorted(order) == sorted(f"{p.id}#{s}" for p, s in jobs)
    assert order[-1] == "q0#0"
    assert eng.most >= 2  # requests of several trajectories were at the engine together


@pytest.mark.parametrize("limit", [1, 2])
def test_max_inflight_bounds_the_trajectories_at_the_engine(world, limit):
    proc, tmp, jobs = world
    eng = AsyncScripted(proc, REPLIES)
    recs = list(agent(eng, tmp, max_inflight=limit).run(jobs))
    assert len(recs) == len(jobs) and eng.most == limit


def test_an_engine_failure_ends_the_run_with_it(world):
    proc, tmp, jobs = world
    eng = AsyncScripted(proc, REPLIES, fail_on="q1#1")
    before = threading.active_count()
    with pytest.raises(RuntimeError, match="engine down at q1#1"):
        list(agent(eng, tmp).run(jobs))
    assert threading.active_count() == before  # the loop's thread and tool pool are gone


def test_a_caller_that_stops_early_cancels_the_rest(world):
    proc, tmp, jobs = world
    eng = AsyncScripted(proc, REPLIES, slow={f"{p.id}#{s}" for p, s in jobs[1:]}, pause=5.0)
    before = threading.active_count()
    run = agent(eng, tmp).run(jobs)
    first = next(run)
    assert first["id"] == "q0#0"
    run.close()  # the trajectories still waiting on the engine are cancelled, not awaited
    assert threading.active_count() == before and eng.inflight == 0
