"""Search backends against local HTTP servers speaking the documented JSON: retries, timeouts,
bounded attempts, the cache, Serper, Lens, the summariser, and API keys that never leak."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
from PIL import Image

import marscli.http
from marscli.errors import BadInput
from marscli.http import HttpClient, HttpError
from marscli.search import SearchOptions, check_text_spec
from marscli.tools import ConvImage, ToolContext
from marscli.tools.search import ImageSearchTool, TextSearchTool, tool_failed

from fakes import chat_reply, retrieve_reply, serper_reply

SENTINEL = "SENTINEL-KEY-7f3a9c"
FAST = {"timeout": 2.0, "backoff": 0.01, "cache": None}


@pytest.fixture
def fake(fake_server):
    return fake_server()


@pytest.fixture(autouse=True)
def _env(tmp_path, monkeypatch):
    monkeypatch.setenv("MARSCLI_CACHE_DIR", str(tmp_path / "cache"))
    for k in ("SERPER_API_KEY", "SERPER_BASE_URL", "OPENAI_API_KEY", "SUMMARIZER_API_KEY"):
        monkeypatch.delenv(k, raising=False)


def png(size=(40, 30), color=(200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()


# ---------------------------------------------------------------------------- retriever


@pytest.mark.parametrize("suffix", ["", "/retrieve", "/"])
def test_retriever_protocol(fake, suffix):
    fake.on("/retrieve", retrieve_reply("Alpha", "Beta"))
    res = TextSearchTool(f"retriever:{fake.url}{suffix}", k=2, **FAST)({"query": "q?"}, None)
    assert res.ok and res.text == "[1] Alpha\nAlpha is a thing.\n\n[2] Beta\nBeta is a thing."
    assert fake.log[0]["body"] == {"queries": ["q?"], "topk": 2, "return_scores": True}


def test_500_then_success_is_retried(fake):
    fake.on("/retrieve", (500, b"oops"), (503, b"busy"), retrieve_reply("Alpha"))
    res = TextSearchTool(f"retriever:{fake.url}", **FAST)({"query": "q"}, None)
    assert res.ok and "Alpha" in res.text and fake.requests("/retrieve") == 3


def test_permanent_500_is_an_observation_after_bounded_attempts(fake):
    fake.on("/retrieve", (500, b"down"))
    tool = TextSearchTool(f"retriever:{fake.url}", attempts=3, **FAST)
    res = tool({"query": "q"}, None)
    assert not res.ok and res.text.startswith("search failed:") and tool_failed(res)
    assert "HTTP 500" in res.text and "3 attempts" in res.text
    assert fake.requests("/retrieve") == 3 and tool.stats()["attempts"] == 3
    assert tool.stats()["failures"] == 1


def test_429_is_retried_and_400_is_not(fake):
    fake.on("/retrieve", (429, b"slow down"), retrieve_reply("Alpha"))
    assert TextSearchTool(f"retriever:{fake.url}", **FAST)({"query": "q"}, None).ok
    fake.log.clear()
    fake.on("/retrieve", (400, b"bad request"))
    res = TextSearchTool(f"retriever:{fake.url}", attempts=5, **FAST)({"query": "q"}, None)
    assert tool_failed(res) and "HTTP 400" in res.text and fake.requests("/retrieve") == 1


def test_slow_replies_time_out_within_the_bound(fake):
    # The reply would take 5 s; two 0.2 s attempts must give up long before (a wide margin, so
    # that a loaded machine's scheduling delays cannot fail the test).
    fake.on("/retrieve", (200, retrieve_reply("Late"), 5.0))
    t0 = time.time()
    res = TextSearchTool(f"retriever:{fake.url}", timeout=0.2, attempts=2, backoff=0.01,
                         cache=None)({"query": "q"}, None)
    assert tool_failed(res) and "Timeout" in res.text
    assert fake.requests("/retrieve") == 2 and time.time() - t0 < 3.0


def test_malformed_json_is_retried_then_fails(fake):
    fake.on("/retrieve", (200, b"{not json"), retrieve_reply("Alpha"))
    assert TextSearchTool(f"retriever:{fake.url}", **FAST)({"query": "q"}, None).ok
    assert fake.requests("/retrieve") == 2
    fake.log.clear()
    fake.on("/retrieve", (200, b"<html>proxy error</html>"))
    res = TextSearchTool(f"retriever:{fake.url}", **FAST)({"query": "q"}, None)
    assert tool_failed(res) and "malformed JSON" in res.text and fake.requests("/retrieve") == 3
    fake.on("/retrieve", {"unexpected": True})  # JSON of the wrong shape: not retried
    fake.log.clear()
    res = TextSearchTool(f"retriever:{fake.url}", **FAST)({"query": "q"}, None)
    assert tool_failed(res) and "shape" in res.text and fake.requests("/retrieve") == 1


def test_unreachable_server_is_an_observation():
    res = TextSearchTool("retriever:http://127.0.0.1:9", **FAST)({"query": "q"}, None)
    assert tool_failed(res) and "ConnectionError" in res.text


def test_cache_hit_sends_no_second_request(fake, tmp_path):
    fake.on("/retrieve", retrieve_reply("Alpha"))
    opts = {"timeout": 2.0, "backoff": 0.01, "cache": str(tmp_path / "c")}
    first = TextSearchTool(f"retriever:{fake.url}", **opts)({"query": "q"}, None)
    again = TextSearchTool(f"retriever:{fake.url}", **opts)({"query": "q"}, None)
    assert first.text == again.text and fake.requests("/retrieve") == 1
    TextSearchTool(f"retriever:{fake.url}", k=3, **opts)({"query": "q"}, None)  # k is in the key
    assert fake.requests("/retrieve") == 2


def test_failures_are_not_cached(fake, tmp_path):
    opts = {"timeout": 2.0, "backoff": 0.01, "attempts": 1, "cache": str(tmp_path / "c")}
    fake.on("/retrieve", (500, b"down"), retrieve_reply("Alpha"))
    tool = TextSearchTool(f"retriever:{fake.url}", **opts)
    assert tool_failed(tool({"query": "q"}, None))
    assert tool({"query": "q"}, None).ok and fake.requests("/retrieve") == 2


def test_concurrency_limit_per_backend(fake):
    fake.on("/retrieve", (200, retrieve_reply("A"), 0.15))
    client = HttpClient(timeout=5, concurrency=2)
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda _: client.post_json(fake.url + "/retrieve", {}), range(6)))
    assert fake.max_in_flight == 2 and client.attempts == 6


def test_download_size_limit(fake):
    fake.on("/big", (200, b"x" * 10_000))
    client = HttpClient(timeout=2)
    assert len(client.get_bytes(fake.url + "/big", max_bytes=20_000)) == 10_000
    with pytest.raises(HttpError, match="byte limit"):
        client.get_bytes(fake.url + "/big", max_bytes=1000)
    assert fake.requests("/big") == 2  # too large: not retried


def test_validator_rejection_is_retried_and_sent_credentials_never_show(fake):
    fake.on("/v1/chat", {"bad": 1}, {"ok": 1})
    client = HttpClient(timeout=2, backoff=0.01, headers={"Authorization": "Bearer tok-4b9e1"})
    assert client.post_json(fake.url + "/v1/chat", {}, validate=lambda d: d["ok"]) == 1
    assert client.attempts == 2
    fake.on("/v1/chat", (401, b"bad key tok-4b9e1"))  # in no known variable: scrubbed anyway
    with pytest.raises(HttpError) as e:
        client.post_json(fake.url + "/v1/chat", {})
    assert "HTTP 401" in str(e.value) and "(after 1 attempt)" in str(e.value)
    assert "tok-4b9e1" not in str(e.value) + e.value.reason and not e.value.transient


def test_retry_after_is_honoured_up_to_a_minute(fake, monkeypatch):
    waits: list[float] = []
    monkeypatch.setattr(marscli.http, "time", SimpleNamespace(sleep=waits.append))
    fake.on("/r", *((code, "busy", 0, {"Retry-After": wait}) for code, wait in
                    [(503, "2.5"), (429, "3600"), (500, "soon"), (400, "7")]))
    client = HttpClient(timeout=2, attempts=5, backoff=0.01)
    with pytest.raises(HttpError, match="HTTP 400"):
        client.post_json(fake.url + "/r", {})
    # the server's wait, capped at a minute; unparseable: the jittered backoff (0.01 * 2^2 * U)
    assert waits[:2] == [2.5, 60.0] and 0 <= waits[2] < 0.04 and len(waits) == 3
    assert fake.requests("/r") == 4  # a 400 ends the call, whatever its Retry-After


# ---------------------------------------------------------------------------- serper


def test_serper_search_and_key_header(fake, monkeypatch):
    monkeypatch.setenv("SERPER_API_KEY", SENTINEL)
    monkeypatch.setenv("SERPER_BASE_URL", fake.url)
    fake.on("/search", serper_reply(("One", "https://a.example/1", "first snippet"),
                                    ("Two", "https://a.example/2", "second snippet")))
    res = TextSearchTool("serper", k=1, **FAST)({"query": "what is one"}, None)
    assert res.ok and res.text == "[1] One\nfirst snippet"
    assert fake.log[0]["body"] == {"q": "what is one"}
    assert fake.log[0]["headers"]["X-API-KEY"] == SENTINEL


def test_serper_without_key_says_which_variable(monkeypatch):
    with pytest.raises(BadInput, match="SERPER_API_KEY"):
        TextSearchTool("serper")
    with pytest.raises(BadInput, match="SERPER_API_KEY"):
        check_text_spec("serper")


def test_serper_key_never_leaks(fake, monkeypatch):
    monkeypatch.setenv("SERPER_API_KEY", SENTINEL)
    monkeypatch.setenv("SERPER_BASE_URL", fake.url)
    fake.on("/search", (403, f'{{"message": "key {SENTINEL} is not valid"}}'.encode()))
    tool = TextSearchTool("serper", **FAST)
    res = tool({"query": "q"}, None)
    assert tool_failed(res) and "HTTP 403" in res.text and SENTINEL not in res.text
    assert SENTINEL not in repr(tool.stats()) and SENTINEL not in tool.backend.spec


def test_serper_fetch_pages_reads_pages_without_the_key(fake, monkeypatch):
    monkeypatch.setenv("SERPER_API_KEY", SENTINEL)
    monkeypatch.setenv("SERPER_BASE_URL", fake.url)
    fake.on("/search", serper_reply(("P1", fake.url + "/p1", "google snippet 1"),
                                    ("P2", fake.url + "/p2", "google snippet 2")))
    fake.on("/p1", (200, b"<html><script>x()</script><p>The bridge opened in 1932.</p></html>"))
    fake.on("/p2", (404, b"gone"))
    res = TextSearchTool("serper", k=2, fetch_pages=True, **FAST)({"query": "bridge"}, None)
    assert res.text == "[1] P1\nThe bridge opened in 1932.\n\n[2] P2\ngoogle snippet 2"
    pages = [r for r in fake.log if r["path"] in ("/p1", "/p2")]
    assert len(pages) == 2 and all("X-API-KEY" not in r["headers"] for r in pages)


def test_serper_cli_never_prints_the_key(fake, tmp_path):
    fake.on("/search", serper_reply(("One", "l", "s")))
    env = {**os.environ, "SERPER_API_KEY": SENTINEL, "SERPER_BASE_URL": fake.url,
           "MARSCLI_CACHE_DIR": str(tmp_path / "c")}
    ok = subprocess.run([sys.executable, "-m", "marscli", "search", "q", "--text-search",
                         "serper"], capture_output=True, text=True, env=env, timeout=60,
                        check=False)
    assert ok.returncode == 0 and ok.stdout == "[1] One\ns\n"
    fake.on("/search", (401, f"bad key {SENTINEL}".encode()))
    bad = subprocess.run([sys.executable, "-m", "marscli", "search", "other", "--text-search",
                          "serper", "--no-cache"], capture_output=True, text=True, env=env,
                         timeout=60, check=False)
    assert bad.returncode == 1 and "search failed" in bad.stderr
    assert SENTINEL not in ok.stdout + ok.stderr + bad.stdout + bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
    assert all(r["headers"].get("X-API-KEY") == SENTINEL for r in fake.log)


# ---------------------------------------------------------------------------- summariser


def test_llm_summariser_condenses_pages_then_summaries(fake, monkeypatch):
    monkeypatch.setenv("SUMMARIZER_API_KEY", "sum-secret")
    fake.on("/retrieve", retrieve_reply("Alpha", "Beta"))

    page, final = (chat_reply(f"<think>hmm</think>{c}")
                   for c in ("page summary", "Alpha was built in 1900 [1]."))
    fake.on("/v1/chat/completions", page, page, final)
    tool = TextSearchTool(f"retriever:{fake.url}", k=2, summarizer=fake.url + "/v1",
                          summarizer_model="qwen3-32b", **FAST)
    res = tool({"query": "when was alpha built"}, None)
    assert res.ok
    assert res.text == ("Summary: Alpha was built in 1900 [1].\n\n[1] Alpha\npage summary"
                        "\n\n[2] Beta\npage summary")
    chats = [r for r in fake.log if r["path"] == "/v1/chat/completions"]
    assert len(chats) == 3 and chats[0]["body"]["model"] == "qwen3-32b"
    assert "at most five sentences" in chats[0]["body"]["messages"][0]["content"]
    assert "[2] page summary" in chats[2]["body"]["messages"][0]["content"]
    assert chats[0]["headers"]["Authorization"] == "Bearer sum-secret"


def test_summariser_failure_is_a_search_failure(fake):
    fake.on("/retrieve", retrieve_reply("Alpha"))
    fake.on("/v1/chat/completions", (500, b"llm down"))
    res = TextSearchTool(f"retriever:{fake.url}", summarizer=fake.url + "/v1",
                         summarizer_model="m", **FAST)({"query": "q"}, None)
    assert tool_failed(res)


# ---------------------------------------------------------------------------- serper lens


def test_serper_lens_results_and_thumbnails(fake, monkeypatch):
    monkeypatch.setenv("SERPER_API_KEY", SENTINEL)
    monkeypatch.setenv("SERPER_BASE_URL", fake.url)
    fake.on("/lens", {"organic": [{"title": "Golden Gate", "thumbnailUrl": fake.url + "/t1.png"},
                                  {"title": "No picture"}],
                      "visualMatches": [{"title": "Bridge", "thumbnailUrl": fake.url + "/t2"},
                                        {"title": "Huge", "thumbnailUrl": fake.url + "/big"}]})
    fake.on("/t1.png", (200, png()))
    fake.on("/t2", (200, b"not an image"))
    fake.on("/big", (200, b"x" * 5000))
    tool = ImageSearchTool("serper-lens", max_download_bytes=2000, **FAST)
    ctx = ToolContext(images=[], row={"image_url": "https://img.example/q.jpg"})
    res = tool({}, ctx)
    assert res.ok and fake.log[0]["body"] == {"url": "https://img.example/q.jpg"}
    assert res.text.splitlines() == ["Reverse image search results:", "[1] Golden Gate <image>",
                                     "[2] Bridge (thumbnail unavailable)",
                                     "[3] Huge (thumbnail unavailable)"]
    assert [n.meta for n in res.images] == [{"title": "Golden Gate",
                                             "thumbnail": fake.url + "/t1.png"}]
    assert res.images[0].image.size == (40, 30)
    thumbs = [r for r in fake.log if r["path"] != "/lens"]
    assert thumbs and all("X-API-KEY" not in r["headers"] for r in thumbs)


def test_serper_lens_without_image_url_is_an_error_observation(fake, monkeypatch):
    monkeypatch.setenv("SERPER_API_KEY", SENTINEL)
    monkeypatch.setenv("SERPER_BASE_URL", fake.url)
    im = Image.new("RGB", (8, 8))
    res = ImageSearchTool("serper-lens", **FAST)({}, ToolContext(
        images=[ConvImage(image=im, ref={})], row={}))
    assert not res.ok and res.text.startswith("error:") and "image_url" in res.text
    assert fake.log == []


def test_serper_lens_failure_and_cache(fake, monkeypatch, tmp_path):
    monkeypatch.setenv("SERPER_API_KEY", SENTINEL)
    monkeypatch.setenv("SERPER_BASE_URL", fake.url)
    fake.on("/lens", (502, b"bad gateway"), {"organic": [{"title": "T", "imageUrl": "u"}]})
    opts = {"timeout": 2.0, "backoff": 0.01, "attempts": 1, "cache": str(tmp_path / "c")}
    ctx = ToolContext(images=[], row={"image_url": "https://img.example/q.jpg"})
    assert tool_failed(ImageSearchTool("serper-lens", **opts)({}, ctx))
    for _ in range(2):
        assert "[1] T" in ImageSearchTool("serper-lens", **opts)({}, ctx).text
    assert fake.requests("/lens") == 2


def test_options_are_shared_by_both_tools(fake):
    # build_tools passes one set of options to both tools
    opts = dict(k=3, image_k=2, max_chars=500, **FAST)
    TextSearchTool(f"retriever:{fake.url}", **opts)
    ImageSearchTool("data", **opts)
    assert SearchOptions.from_opts(**opts).k == 3
