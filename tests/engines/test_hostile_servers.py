"""Hostile servers (issue 22, points 5-8): replies bounded in bytes and time, passwords in URLs
kept out of everything recorded or shown to the model, image paths that are not regular files,
and a judge cache keyed by the endpoint. Every server here is tests/fakes.py's FakeServer."""

from __future__ import annotations

import base64
import gzip
import os
import time
import tracemalloc
from pathlib import Path

import orjson
import pytest
from PIL import Image

from marscli.errors import BadInput
from marscli.http import HttpClient, HttpError
from marscli.qwen.images import open_image
from marscli.scoring.judge import JudgeError, JudgeOptions, make_judge
from marscli.secrets import redact, split_userinfo
from marscli.stages.reward import main as reward_main
from marscli.tools.search import TextSearchTool, tool_failed

from fakes import Huge, Trickle, always, chat_reply, current, retrieve_reply
from helpers import judge_options

PW = "PW-hunter2-77"
BASIC = base64.b64encode(f"alice:{PW}".encode()).decode()
YES, NO = chat_reply("<judge>Yes</judge>"), chat_reply("<judge>No</judge>")


@pytest.fixture(autouse=True)
def _env(tmp_path, monkeypatch):
    monkeypatch.setenv("MARSCLI_CACHE_DIR", str(tmp_path / "cache"))
    for k in ("OPENAI_API_KEY", "JUDGE_API_KEY", "OPENAI_BASE_URL", "SERPER_API_KEY"):
        monkeypatch.delenv(k, raising=False)


def with_userinfo(url: str) -> str:
    return url.replace("http://", f"http://alice:{PW}@")


def echo_auth(status: int = 500):
    """A script that echoes the credentials it received (a hostile or careless server)."""
    return lambda path, body, attempt: (status, f"denied {current()['headers']}")


def assert_no_secret(text: str) -> None:
    assert PW not in text and BASIC not in text, text


@pytest.fixture
def traj(tmp_path):
    """A trajectory file whose one row needs the judge."""
    (tmp_path / "im").mkdir()
    Image.new("RGB", (64, 48), (200, 30, 30)).save(tmp_path / "im" / "q.png")
    row = {"v": 1, "id": "q#0", "question": "Which city?", "answer_gt": ["Paris"],
           "images": [{"path": "im/q.png"}], "final_answer": "Paris, France", "stop": "answer",
           "segments": [{"role": "model", "text": "<answer>Paris, France</answer>"}]}
    path = tmp_path / "traj.jsonl"
    path.write_bytes(orjson.dumps(row) + b"\n")
    return path


def score(path: Path, spec: str, **kw) -> tuple[dict, dict, str]:
    """(reward, stats, sidecar text) of scoring `path` with `spec`."""
    out = path.with_name("scored.jsonl")
    judge = {k.removeprefix("judge_"): kw.pop(k) for k in list(kw) if k.startswith("judge_")}
    stats = reward_main(str(path), str(out), spec, judge_options=judge_options(**judge), **kw)
    reward = orjson.loads(out.read_bytes().splitlines()[0])["reward"]
    return reward, stats, Path(f"{out}.meta.json").read_text()


# ---------------------------------------------------------------------------- 22.7 secrets


def test_redact_strips_userinfo_and_secret_query_parameters():
    s = redact(f"POST http://alice:{PW}@h:1/r?api_key=K9&max_tokens=5&token=T7#x: HTTP 500")
    assert s == ("POST http://<redacted>@h:1/r?api_key=<redacted>&max_tokens=5"
                 "&token=<redacted>#x: HTTP 500")
    assert redact({"cmd": [f"--base-url=https://u:{PW}@x/v1"]}) == \
        {"cmd": ["--base-url=https://<redacted>@x/v1"]}
    # a raw @ in the password; an e-mail address in prose is left alone
    assert redact("http://a:p@ss@host/x and bob@example.com") == \
        "http://<redacted>@host/x and bob@example.com"
    assert split_userinfo(f"http://alice:{PW}@h/x") == ("http://h/x", ("alice", PW))


def test_retriever_userinfo_goes_as_basic_auth_and_never_to_the_model(fake_server):
    srv = fake_server({"/retrieve": lambda p, b, a: (200, retrieve_reply("Alpha"))})
    tool = TextSearchTool(f"retriever:{with_userinfo(srv.url)}", cache=None, backoff=0.01,
                          timeout=2.0, attempts=2)
    assert tool({"query": "q"}, None).ok
    assert srv.log[0]["headers"]["Authorization"] == f"Basic {BASIC}"
    srv.routes["/retrieve"] = echo_auth()
    res = tool({"query": "q"}, None)
    assert tool_failed(res) and "HTTP 500" in res.text and "<redacted>" in res.text
    assert_no_secret(res.text)


def test_judge_spec_with_userinfo_parses_and_nothing_records_the_password(fake_server, traj,
                                                                           capsys):
    srv = fake_server(always(200, YES))
    spec = f"openai:judge-m@{with_userinfo(srv.url)}/v1"
    reward, _, meta = score(traj, spec)
    assert reward["accuracy"] == 1.0 and reward["judge"] == "openai:judge-m"
    assert srv.log[0]["headers"]["Authorization"] == f"Basic {BASIC}"
    assert srv.log[0]["path"] == "/v1/chat/completions"
    assert_no_secret(meta)
    assert "/v1/chat/completions" in meta  # the endpoint is named, its password is not
    srv.routes[""] = echo_auth(401)  # refused, echoing what it got: an unscored row
    reward, _, meta = score(traj, spec, judge_cache=str(traj.with_name("other.sqlite")),
                            max_unscored=1.0)
    assert reward["status"] == "unscored"
    assert_no_secret(orjson.dumps(reward).decode() + meta + "".join(capsys.readouterr()))


def test_bad_judge_url_is_refused_without_echoing_the_password():
    with pytest.raises(BadInput) as e:
        make_judge(f"openai:m@ftp://alice:{PW}@host/v1")
    assert "must start with http" in str(e.value)
    assert_no_secret(str(e.value))


def test_openai_engine_base_url_userinfo(fake_server):
    from marscli.engines import GenRequest, SamplingParams
    from marscli.engines.openai import OpenAIEngine

    srv = fake_server(echo_auth())
    eng = OpenAIEngine(base_url=with_userinfo(srv.url) + "/v1", model="m", retries=0,
                       backoff=0.01, timeout=2)
    assert_no_secret(orjson.dumps(eng.config()).decode())
    gen = eng.generate([GenRequest(tokens=[], key="t#0", turn=0, max_new_tokens=4,
                                   messages=[{"role": "user", "content": "hi"}])],
                       SamplingParams(max_new_tokens=4))[0]
    assert gen.finish == "error" and "HTTP 500" in gen.error
    assert srv.log[0]["headers"]["Authorization"] == f"Basic {BASIC}"
    assert_no_secret(gen.error)


# ---------------------------------------------------------------------------- 22.6 time


def test_trickling_server_is_cut_at_the_total_timeout(fake_server):
    """1 byte every 0.2 s of a 100-byte reply: 20 s per attempt against a per-read timeout."""
    srv = fake_server(always(200, Trickle(b"x" * 100, every=0.2)))
    client = HttpClient(timeout=1.0, attempts=2, backoff=0.01)
    t0 = time.monotonic()
    with pytest.raises(HttpError, match="timed out after 1 s in all") as e:
        client.post_json(srv.url + "/r", {})
    assert time.monotonic() - t0 < 1.0 * 2 + 0.8
    assert e.value.transient and srv.requests() == 2


def test_trickling_judge_and_retriever_hold_their_timeouts(fake_server):
    srv = fake_server(always(200, Trickle(b"{" + b" " * 200 + b"}", every=0.1)))
    judge = make_judge(f"openai:m@{srv.url}/v1",
                       JudgeOptions(timeout_s=0.6, attempts=2, backoff_s=0.01))
    tool = TextSearchTool(f"retriever:{srv.url}", cache=None, timeout=0.6, attempts=2,
                          backoff=0.01)
    t0 = time.monotonic()
    with pytest.raises(JudgeError, match="timed out"):
        judge.verdict("q", "gold", "answer", None)
    t1 = time.monotonic()
    res = tool({"query": "q"}, None)
    t2 = time.monotonic()
    judge.close()
    # judge retries wait backoff * (1 + U): a few hundredths of a second here
    assert t1 - t0 < 0.6 * 2 + 0.8 and t2 - t1 < 0.6 * 2 + 0.8
    assert tool_failed(res) and "timed out" in res.text


def test_deadline_reads_keep_the_connection_alive():
    """The body is read under a deadline, yet the connection goes back to the pool (with its
    socket's timeout restored) and serves the next calls."""
    from fakes import FakeServer

    with FakeServer(always(200, {"ok": 1}), keep_alive=True) as srv:
        client = HttpClient(timeout=5.0, attempts=1)
        assert [client.post_json(srv.url + "/r", {"i": i}) for i in range(3)] == [{"ok": 1}] * 3
        assert len({r["client"] for r in srv.log}) == 1


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_image_path_that_is_a_fifo_is_refused_at_once(tmp_path):
    fifo = tmp_path / "q.png"
    os.mkfifo(fifo)
    t0 = time.monotonic()
    with pytest.raises(BadInput, match="named pipe") as e:
        open_image(fifo)
    assert str(fifo) in str(e.value) and time.monotonic() - t0 < 1
    from marscli.engines.openai import data_url

    with pytest.raises(BadInput, match="named pipe"):
        data_url(str(fifo))
    with pytest.raises(BadInput, match="is a folder"):
        open_image(tmp_path)


# ---------------------------------------------------------------------------- 22.5 bytes


@pytest.mark.parametrize("declare", [True, False])
def test_huge_json_reply_fails_at_the_cap_unretried_in_bounded_memory(fake_server, declare):
    srv = fake_server(always(200, Huge(60 * 2**20, declare=declare)))
    client = HttpClient(timeout=10, attempts=3, backoff=0.01, max_bytes=2**20)
    tracemalloc.start()
    try:
        with pytest.raises(HttpError, match="byte limit") as e:
            client.post_json(srv.url + "/r", {})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert not e.value.transient and srv.requests() == 1  # too big once, too big again
    assert peak < 8 * 2**20  # a 60 MB reply, never held


def test_gzip_bomb_counts_decompressed_bytes(fake_server):
    bomb = gzip.compress(b"\0" * (20 * 2**20))  # ~20 KB on the wire
    srv = fake_server(always(200, bomb, 0, {"Content-Encoding": "gzip"}))
    with pytest.raises(HttpError, match="byte limit"):
        HttpClient(timeout=10, max_bytes=2**20).post_json(srv.url + "/r", {})


def test_oversized_judge_reply_is_an_unscored_row(fake_server, traj):
    srv = fake_server(always(200, Huge(20 * 2**20, declare=False)))
    reward, _, _ = score(traj, f"openai:m@{srv.url}/v1", max_unscored=1.0)
    assert reward["status"] == "unscored" and "byte limit" in reward["error"]
    assert srv.requests() == 1


def test_oversized_retriever_reply_is_a_failed_tool_call(fake_server):
    srv = fake_server(always(200, Huge(20 * 2**20)))
    tool = TextSearchTool(f"retriever:{srv.url}", cache=None, attempts=3, backoff=0.01,
                          max_reply_bytes=2**20)
    res = tool({"query": "q"}, None)
    assert tool_failed(res) and "byte limit" in res.text and srv.requests() == 1


def test_redirect_body_is_never_read_and_credentials_stay_home(fake_server):
    other = fake_server(always(200, b"page"))
    # `localhost` and 127.0.0.1 are different hosts to the client
    target = other.url.replace("127.0.0.1", "localhost") + "/page"
    slow_body = Trickle(b"x" * 50, every=0.2)  # 10 s to read: it must not be read at all
    home = fake_server({"/go": always(302, slow_body, 0, {"Location": target}),
                        "/loop": always(302, b"", 0, {"Location": "/loop"})})
    client = HttpClient(timeout=5, headers={"Authorization": "Bearer tok-5x"})
    t0 = time.monotonic()
    assert client.get_bytes(home.url + "/go", max_bytes=100) == b"page"
    assert time.monotonic() - t0 < 3
    assert home.log[0]["headers"]["Authorization"] == "Bearer tok-5x"
    assert "Authorization" not in other.log[0]["headers"]
    with pytest.raises(HttpError, match="redirects"):
        client.get_bytes(home.url + "/loop", max_bytes=100)


# ---------------------------------------------------------------------------- 22.8 cache


def test_judge_cache_is_keyed_on_the_endpoint(fake_server, traj):
    a, b = fake_server(always(200, YES)), fake_server(always(200, NO))
    reward, stats, _ = score(traj, f"openai:same-model@{a.url}/v1")
    assert reward["accuracy"] == 1.0 and stats["judge_calls"] == 1
    reward, _, _ = score(traj, f"openai:same-model@{b.url}/v1")
    assert reward["accuracy"] == 0.0 and b.requests() == 1  # asked, not A's verdict replayed
    reward, _, _ = score(traj, f"openai:same-model@{with_userinfo(a.url)}/v1")
    assert reward["accuracy"] == 1.0 and a.requests() == 1  # same server, other credentials


def test_report_never_prints_a_password_an_old_record_carries(tmp_path):
    from marscli.view.report import build

    leak = f"search failed: POST http://alice:{PW}@h:8/retrieve?token=T0K3N: HTTP 500"
    rec = {"v": 1, "id": "q#0", "prompt_id": "q", "question": "Which city?", "images": [],
           "stop": "answer", "turns": 2, "final_answer": "Paris", "segments": [
               {"role": "model", "text": '<think>x</think><tool_call>{"name": '
                '"text_search_tool", "arguments": {"query": "q"}}</tool_call>'},
               {"role": "tool", "tool": "text_search_tool", "ok": False, "failed": True,
                "text": leak},
               {"role": "model", "text": "<answer>Paris</answer>"}]}
    path = tmp_path / "rollouts.jsonl"
    path.write_bytes(orjson.dumps(rec) + b"\n")
    html, info = build(str(path))
    assert info["shown"] == 1 and "search failed: POST http://&lt;redacted&gt;@h:8" in html
    assert PW not in html and "T0K3N" not in html
