"""The `openai` engine against a scripted OpenAI-compatible server on 127.0.0.1: the agent's
conversation goes out as chat messages with base64 images, replies come back as text;
transient failures are retried, a permanent one ends only its trajectory (`engine_error`),
`--tokenize-with` gives token-exact segments, and the API key is never written anywhere."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from PIL import Image

from marscli.errors import BadInput, RuntimeFailure
from marscli.qwen.tokens import assemble, special_ids
from marscli.stages.rollout import run_rollout

from fakes import FakeServer, chat_reply, current
from helpers import scene

ZOOM = ('<thinking>Too small.</thinking><tool_call>{"name": "image_zoom_in_tool", "arguments": '
        '{"bbox_2d": [500, 500, 1000, 1000], "label": "corner"}}</tool_call>')
ANSWER = "<thinking>Red.</thinking><answer>red</answer>"
CUT = "<thinking>The corner is"  # a reply that ran out of tokens
SENTINEL = "sk-sentinel-7f3a9c"


def question(body: dict) -> str:
    return next(p["text"] for p in body["messages"][1]["content"] if p["type"] == "text")


def script(path: str, body: dict, attempt: int) -> tuple:
    """Chat completions: turn 0 zooms, later turns answer (with `cut`, turn 0 runs out of
    tokens first; with `reasoner`, the thinking comes apart in `reasoning_content`). The question
    picks a misbehaviour: `flaky` (503 once per request), `garbled` (bad JSON once), `slow`
    (first attempt outlasts the client's timeout), `broken` (500 always, echoing the auth
    header)."""
    q, first = question(body), attempt == 1
    if "broken" in q:
        auth = current()["headers"].get("Authorization")
        return 500, {"error": f"internal error; you sent {auth}"}
    if "flaky" in q and first:
        return 503, {"error": "overloaded"}
    if "garbled" in q and first:
        return 200, b"{not json"
    turns = [(CUT, "length")] if "cut" in q else []
    turns += [(ZOOM, "stop"), (ANSWER, "stop")]
    turn = sum(m["role"] == "assistant" for m in body["messages"])
    text, finish = turns[min(turn, len(turns) - 1)]
    extra = {}
    if "reasoner" in q:
        thinking, _, text = text.removeprefix("<thinking>").partition("</thinking>")
        extra["reasoning_content"] = thinking
    return 200, chat_reply(text, finish, (100, 9), **extra), 3.0 if "slow" in q and first else 0.0


@pytest.fixture
def server(fake_server):
    return fake_server(script)


def write_prompts(tmp: Path, questions: list[str]) -> Path:
    scene(tmp / "scene.png")
    path = tmp / "prompts.jsonl"
    path.write_bytes(b"".join(
        orjson.dumps({"v": 1, "id": f"p{i}", "image": "scene.png", "question": q,
                      "answer": ["red"]}) + b"\n" for i, q in enumerate(questions)))
    return path


def read(path: Path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def opts(server: FakeServer, **kw) -> dict:
    return {"base_url": f"{server.url}/v1", "model": "teacher", "backoff": 0.01, **kw}


def test_messages_images_retries(server, tmp_path):
    prompts = write_prompts(tmp_path, ["What colour? flaky", "What colour? garbled",
                                       "What colour? slow"])
    out = tmp_path / "out" / "t.jsonl"
    stats = run_rollout(str(prompts), str(out), engine="openai", n=2, max_turn_tokens=77,
                        seed=5, engine_opts=opts(server, timeout=2.0), progress=False)
    recs = read(out)
    assert sorted(r["id"] for r in recs) == ["p0#0", "p0#1", "p1#0", "p1#1", "p2#0", "p2#1"]
    for r in recs:
        assert r["stop"] == "answer" and r["final_answer"] == "red" and r["turns"] == 2
        assert r["policy"] == "teacher" and r["tool_calls"] == {"image_zoom_in_tool": 1}
        # text only: no token ids without --tokenize-with
        assert [s["role"] for s in r["segments"]] == ["prompt", "model", "tool", "model"]
        assert all("tokens" not in s for s in r["segments"])
        assert r["segments"][1]["text"] == ZOOM and r["segments"][3]["text"] == ANSWER
        assert r["generated_tokens"] == 18  # as the server counted them
        m = r["messages"]
        assert [x["role"] for x in m] == ["system", "user", "assistant", "user", "assistant"]
        assert m[1]["content"][0] == {"type": "image", "image": 0}
        assert m[3]["content"][0]["text"].startswith("<tool_response>\n")
        assert {"type": "image", "image": 1} in m[3]["content"]
        assert m[2]["content"] == ZOOM and "base64" not in orjson.dumps(m).decode()
        assert (out.parent / r["images"][1]["path"]).is_file()
    # each failing first attempt was retried once, and only once
    assert max(server.attempts.values()) == 2
    assert sorted(server.attempts.values()) == [2] * 12  # 3 prompts x 2 samples x 2 turns
    assert stats["trajectories"] == 6 and stats["engine"]["requests"] == server.requests()
    # what went over the wire: data URLs of the very files, sampling options, distinct seeds
    bodies = [r["body"] for r in server.log]
    last = next(b for b in bodies if len(b["messages"]) == 4)
    urls = [p["image_url"]["url"] for msg in last["messages"] if isinstance(msg["content"], list)
            for p in msg["content"] if p["type"] == "image_url"]
    assert len(urls) == 2 and urls[0].startswith("data:image/png;base64,")
    assert base64.b64decode(urls[0].split(",", 1)[1]) == (tmp_path / "scene.png").read_bytes()
    rec = next(r for r in recs if r["id"] == "p0#0")
    assert base64.b64decode(urls[1].split(",", 1)[1]) in {
        (out.parent / im["path"]).read_bytes() for r in recs for im in r["images"][1:]}
    assert last["model"] == "teacher" and last["max_tokens"] == 77 and last["temperature"] == 1.0
    assert "presence_penalty" not in last  # sent only when set (test_presence_penalty_...)
    seeds = {(b["messages"][1]["content"][1]["text"], b["seed"]) for b in bodies}
    assert len(seeds) == 12  # 3 prompts x 2 samples x 2 turns, all different
    assert rec["messages"][3]["content"][1] == {"type": "image", "image": 1}


def test_permanent_failure_ends_only_that_trajectory(server, tmp_path):
    prompts = write_prompts(tmp_path, ["What colour?", "What colour? broken"])
    out = tmp_path / "t.jsonl"
    stats = run_rollout(str(prompts), str(out), engine="openai", n=1,
                        engine_opts=opts(server, retries=2), progress=False)
    by_id = {r["id"]: r for r in read(out)}
    assert by_id["p0#0"]["stop"] == "answer"
    bad = by_id["p1#0"]
    assert bad["stop"] == "engine_error" and bad["final_answer"] is None and bad["turns"] == 0
    assert "HTTP 500" in bad["error"] and "after 3 attempts" in bad["error"]
    assert [s["role"] for s in bad["segments"]] == ["prompt"]
    assert stats["stop"] == {"answer": 1, "engine_error": 1}
    assert [question(r["body"]) for r in server.log].count("What colour? broken") == 3


# vLLM 0.32's refusal of a conversation longer than --max-model-len
# (tests/engines/test_openai_vllm.py)
CONTEXT_400 = {"error": {"message": "This model's maximum context length is 4096 tokens. However, "
                         "your prompt contains at least 4097 input tokens, which exceeds this "
                         "limit even without any output tokens.", "type": "BadRequestError",
                         "param": "input_tokens", "code": 400}}


def test_context_overflow_stops_at_the_limit_not_as_an_engine_error(fake_server, tmp_path):
    """The second turn no longer fits the server's context: the trajectory stops at its token
    limit, asked once (a 400 is not retried), and is no engine failure; another 400 still is."""
    def refuse(path, body, attempt):
        if question(body).endswith("bad max_tokens"):
            return 400, {"error": {"message": "max_tokens=10000 cannot be greater than "
                                              "max_model_len=4096."}}
        if any(m["role"] == "assistant" for m in body["messages"]):
            return 400, CONTEXT_400
        return 200, chat_reply(ZOOM, "stop", (100, 9))

    srv = fake_server(refuse)
    prompts = write_prompts(tmp_path, ["What colour?", "What colour? bad max_tokens"])
    out = tmp_path / "t.jsonl"
    stats = run_rollout(str(prompts), str(out), engine="openai", n=1,
                        engine_opts=opts(srv, retries=2), progress=False)
    by_id = {r["id"]: r for r in read(out)}
    full = by_id["p0#0"]
    assert full["stop"] == "max_tokens" and "error" not in full and full["turns"] == 1
    assert full["tool_calls"] == {"image_zoom_in_tool": 1}
    assert by_id["p1#0"]["stop"] == "engine_error"
    assert "cannot be greater than max_model_len" in by_id["p1#0"]["error"]
    assert stats["stop"] == {"engine_error": 1, "max_tokens": 1}
    assert srv.max_attempts() == 1


def test_all_failed_is_a_runtime_failure(server, tmp_path):
    prompts = write_prompts(tmp_path, ["broken"])
    out = tmp_path / "t.jsonl"
    with pytest.raises(RuntimeFailure, match="every trajectory of this run failed"):
        run_rollout(str(prompts), str(out), engine="openai", n=2,
                    engine_opts=opts(server, retries=0), progress=False)
    assert [r["stop"] for r in read(out)] == ["engine_error", "engine_error"]
    assert not Path(f"{out}.meta.json").exists()


def test_tokenize_with_gives_token_exact_segments(server, tiny_model, tmp_path):
    from marscli.qwen.policy import load_processor

    prompts = write_prompts(tmp_path, ["What colour is the corner?", "cut: what colour?"])
    out = tmp_path / "t.jsonl"
    run_rollout(str(prompts), str(out), engine="openai", n=1,
                engine_opts=opts(server, tokenize_with=str(tiny_model)), progress=False)
    recs = {r["id"]: r for r in read(out)}
    proc = load_processor(str(tiny_model))
    ids = special_ids(proc.tokenizer)
    plain, cut = recs["p0#0"]["segments"], recs["p1#0"]["segments"]
    assert [s["role"] for s in plain] == ["prompt", "model", "tool", "model"]
    assert plain[1]["tokens"][-1] == ids.im_end and plain[3]["tokens"][-1] == ids.im_end
    # a reply cut by the token limit has no <|im_end|>: the tool segment closes the turn
    assert [s["role"] for s in cut] == ["prompt"] + ["model", "tool"] * 2 + ["model"]
    assert cut[1]["text"] == CUT and cut[1]["tokens"][-1] != ids.im_end
    assert cut[2]["tokens"][0] == ids.im_end and cut[2]["ok"] is False
    for rec in recs.values():
        assert rec["logprobs_mode"] is None  # the server's text has no log-probs: null
        assert all(s["logprobs"] is None for s in rec["segments"] if s["role"] == "model")
        ours = assemble(rec["segments"], ids.image_pad)
        images = [Image.open(tmp_path / im["path"]).convert("RGB") for im in rec["images"]]
        text = proc.apply_chat_template(rec["messages"], tokenize=False)
        theirs = proc(text=[text], images=images, return_tensors="pt")["input_ids"][0].tolist()
        assert theirs[-1:] == proc.tokenizer.encode("\n", add_special_tokens=False)
        assert ours.input_ids == theirs[:-1]
        model_toks = [t for s in rec["segments"] if s["role"] == "model" for t in s["tokens"]]
        assert [t for t, m in zip(ours.input_ids, ours.loss_mask) if m] == model_toks


def test_reasoning_content_is_put_back(server, tmp_path):
    """Servers with a reasoning parser return the thinking apart; the turn keeps it."""
    prompts = write_prompts(tmp_path, ["reasoner: what colour?"])
    out = tmp_path / "t.jsonl"
    run_rollout(str(prompts), str(out), engine="openai", n=1, engine_opts=opts(server),
                progress=False)
    (rec,) = read(out)
    assert rec["stop"] == "answer" and rec["final_answer"] == "red"
    assert rec["segments"][-1]["text"] == "<think>Red.</think><answer>red</answer>"


def test_options_are_checked(tmp_path):
    prompts = write_prompts(tmp_path, ["q"])
    out = tmp_path / "t.jsonl"
    with pytest.raises(BadInput, match="--base-url"):
        run_rollout(str(prompts), str(out), engine="openai", engine_opts={"model": "m"})
    with pytest.raises(BadInput, match="--model"):
        run_rollout(str(prompts), str(out), engine="openai",
                    engine_opts={"base_url": "http://127.0.0.1:9/v1"})
    with pytest.raises(BadInput, match="--policy: not used by --engine openai"):
        run_rollout(str(prompts), str(out), engine="openai", policy="x",
                    engine_opts={"base_url": "http://127.0.0.1:9/v1", "model": "m"})
    assert not out.exists()


def test_presence_penalty_reaches_the_server_and_is_refused_where_no_engine_has_it(
        server, tmp_path):
    prompts = write_prompts(tmp_path, ["What colour? plain"])
    run_rollout(str(prompts), str(tmp_path / "t.jsonl"), engine="openai", n=1,
                presence_penalty=1.5, engine_opts=opts(server), progress=False)
    assert {r["body"]["presence_penalty"] for r in server.log} == {1.5}
    out = tmp_path / "hf.jsonl"
    with pytest.raises(BadInput, match=r"--presence-penalty: the hf engine has none — use "
                                       r"--engine openai or server or vllm"):
        run_rollout(str(prompts), str(out), policy="x", presence_penalty=1.5)
    with pytest.raises(BadInput, match=r"--presence-penalty: 3\.0 is out of range"):
        run_rollout(str(prompts), str(out), engine="openai", presence_penalty=3.0,
                    engine_opts=opts(server))
    assert not out.exists()


def test_cli_never_writes_the_api_key(server, tmp_path):
    prompts = write_prompts(tmp_path, ["What colour?", "What colour? broken"])
    out = tmp_path / "t.jsonl"
    env = {**os.environ, "OPENAI_API_KEY": SENTINEL, "COLUMNS": "200"}
    res = subprocess.run(
        [sys.executable, "-m", "marscli", "rollout", str(prompts), "-o", str(out), "-n", "2",
         "--engine", "openai", "--base-url", f"{server.url}/v1", "--model", "teacher",
         "--retries", "0", "--concurrency", "2"],
        capture_output=True, text=True, env=env, timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    auth = {r["headers"].get("Authorization") for r in server.log}
    assert auth == {f"Bearer {SENTINEL}"}  # it was sent...
    recs = read(out)
    assert sorted(r["stop"] for r in recs) == ["answer", "answer", "engine_error", "engine_error"]
    assert all("<redacted>" in r["error"] for r in recs if r["stop"] == "engine_error")
    written = [out, Path(f"{out}.meta.json"), *sorted((tmp_path / "t.media").iterdir())]
    for f in written:  # ...and never written
        assert SENTINEL.encode() not in f.read_bytes(), f
        assert SENTINEL not in f.name
    assert SENTINEL not in res.stdout + res.stderr
    assert "engine_error" in res.stderr  # the warning names what happened
