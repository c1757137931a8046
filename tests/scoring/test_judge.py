"""The HTTP judge against a local OpenAI-compatible server: verdicts, retries, timeouts,
the attempt bound, concurrency, the verdict cache, and API keys kept out of every output."""

from __future__ import annotations

import base64
import io
import os
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import orjson
import pytest
from PIL import Image

from marscli.errors import BadInput, RuntimeFailure
from marscli.scoring.judge import JudgeOptions, VerdictCache, make_judge
from marscli.stages.reward import main

from fakes import always, chat_reply, sequence
from helpers import judge_options

SENTINEL = "sk-SENTINEL-9f8e7d6c5b4a"

YES, NO = chat_reply("<judge>Yes</judge>"), chat_reply("The answer matches.\n<judge>No</judge>")


@pytest.fixture
def serve(fake_server):
    """A fake judge: `serve(script)` answers every path by `script`."""
    def start(script):
        srv = fake_server(script)
        srv.spec = f"openai:judge-model@{srv.url}/v1"
        return srv

    return start


@pytest.fixture
def data(tmp_path):
    """A trajectory file whose rows need the judge (answers never match exactly)."""
    (tmp_path / "images").mkdir()
    Image.new("RGB", (1200, 800), (200, 30, 30)).save(tmp_path / "images" / "q.png")

    def write(answers=("Paris, France",), gold=("Paris",)) -> Path:
        rows = [{"v": 1, "id": f"q#{i}", "question": "Which city is this?", "answer_gt": list(gold),
                 "images": [{"path": "images/q.png"}], "final_answer": a, "stop": "answer",
                 "segments": [{"role": "model", "text": f"<answer>{a}</answer>"}]}
                for i, a in enumerate(answers)]
        path = tmp_path / "traj.jsonl"
        path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
        return path

    return write


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("MARSCLI_CACHE_DIR", str(tmp_path / "cache"))
    for k in ("OPENAI_API_KEY", "JUDGE_API_KEY", "OPENAI_BASE_URL"):
        monkeypatch.delenv(k, raising=False)


def score(path: Path, spec: str, **kw) -> tuple[list[dict], dict]:
    out = str(path.with_name("scored.jsonl"))
    judge = {k.removeprefix("judge_"): kw.pop(k) for k in list(kw) if k.startswith("judge_")}
    stats = main(str(path), out, spec, judge_options=judge_options(**judge), **kw)
    return [orjson.loads(x) for x in Path(out).read_bytes().splitlines()], stats


def test_yes_scores_one_and_request_is_openai_shaped(serve, data, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", SENTINEL)
    srv = serve(always(200, YES))
    rows, stats = score(data(), srv.spec)
    assert rows[0]["reward"] == {"total": 1.5, "accuracy": 1.0, "format": 0.5,
                                 "judge": "openai:judge-model"}
    body = srv.log[0]["body"]
    assert body["model"] == "judge-model" and body["temperature"] == 0 and body["max_tokens"] > 0
    image, text = body["messages"][0]["content"]
    assert "Which city is this?" in text["text"] and "Paris, France" in text["text"]
    head, b64 = image["image_url"]["url"].split(",", 1)
    assert head == "data:image/jpeg;base64"
    assert max(Image.open(io.BytesIO(base64.b64decode(b64))).size) == 512  # 1200x800 downscaled
    assert srv.log[0]["headers"]["Authorization"] == f"Bearer {SENTINEL}"
    assert stats["judge_calls"] == 1 and stats["judge_requests"] == 1


def test_no_is_a_real_zero_not_a_failure(serve, data):
    srv = serve(always(200, NO))
    rows, stats = score(data(), srv.spec)
    assert rows[0]["reward"] == {"total": 0.5, "accuracy": 0.0, "format": 0.5,
                                 "judge": "openai:judge-model"}
    assert stats["unscored"] == 0


def test_one_question_per_gold_answer_any_yes_wins(serve, data):
    srv = serve(lambda path, body, n: (200, YES if "Reference answer: Lutetia" in
                                 body["messages"][0]["content"][-1]["text"] else NO, 0))
    rows, _ = score(data(answers=("the French capital",), gold=("Lyon", "Lutetia")), srv.spec)
    assert rows[0]["reward"]["accuracy"] == 1.0 and srv.requests() == 2


def test_exact_match_and_missing_answer_ask_nobody(serve, data):
    srv = serve(always(200, YES))
    path = data(answers=("paris",))
    rows, _ = score(path, srv.spec)
    assert rows[0]["reward"]["accuracy"] == 1.0 and srv.requests() == 0


def test_judge_api_key_fallback(serve, data, monkeypatch):
    monkeypatch.setenv("JUDGE_API_KEY", SENTINEL)
    srv = serve(always(200, YES))
    score(data(), srv.spec)
    assert srv.log[0]["headers"]["Authorization"] == f"Bearer {SENTINEL}"


@pytest.mark.parametrize("bad", [chat_reply("Yes"), chat_reply("<judge>maybe</judge>"), "{not json",
                                 '{"choices": []}'])
def test_malformed_reply_is_retried(serve, data, bad):
    srv = serve(sequence((200, bad), (200, YES)))
    rows, stats = score(data(), srv.spec)
    assert rows[0]["reward"]["accuracy"] == 1.0
    assert srv.requests() == 2 and stats["judge_retries"] == 1


def test_http_500_then_success_counts_the_retry(serve, data):
    srv = serve(sequence((500, "oops"), (200, YES)))
    rows, stats = score(data(), srv.spec)
    assert rows[0]["reward"]["total"] == 1.5
    assert stats["judge_requests"] == 2 and stats["judge_retries"] == 1
    assert stats["judge_calls"] == 1


def test_permanent_malformed_leaves_row_unscored(serve, data):
    srv = serve(always(200, chat_reply("no tag at all")))
    rows, _ = score(data(), srv.spec, max_unscored=1.0)
    rw = rows[0]["reward"]
    assert rw["status"] == "unscored" and "total" not in rw and "accuracy" not in rw
    assert "malformed" in rw["error"] and srv.requests() == 3


@pytest.mark.parametrize("retries", [0, 1, 3])
def test_attempts_never_exceed_the_bound(serve, data, retries):
    srv = serve(always(503, "busy"))
    _, stats = score(data(answers=("x", "y")), srv.spec, judge_retries=retries,
                     max_unscored=1.0)
    assert srv.requests() == 2 * (retries + 1)  # two rows, one gold answer each
    assert stats["unscored"] == 2 and stats["judge_requests"] == srv.requests()


def test_client_error_is_not_retried(serve, data):
    srv = serve(always(400, '{"error": "unknown model"}'))
    rows, _ = score(data(), srv.spec, max_unscored=1.0)
    assert srv.requests() == 1 and "HTTP 400" in rows[0]["reward"]["error"]


def test_slow_judge_times_out(serve, data):
    srv = serve(always(200, YES, delay=5.0))  # two 0.2 s attempts give up long before
    t0 = time.time()
    rows, _ = score(data(), srv.spec, judge_timeout=0.2, judge_retries=1, max_unscored=1.0)
    assert rows[0]["reward"]["status"] == "unscored" and "timed out" in rows[0]["reward"]["error"]
    assert srv.requests() == 2 and time.time() - t0 < 3.0


def test_permanent_500_exits_1_writing_only_the_partial_file(serve, data):
    srv = serve(always(500, "down"))
    path = data(answers=("a1", "a2", "paris", "a4"))
    out = path.with_name("scored.jsonl")
    with pytest.raises(RuntimeFailure, match=r"3 of 4 rows unscored"):
        main(str(path), str(out), srv.spec, judge_options=judge_options())
    assert not out.exists() and not out.with_name("scored.jsonl.meta.json").exists()
    partial = out.with_name("scored.jsonl.partial")
    kept = [orjson.loads(x) for x in partial.read_bytes().splitlines()]
    assert [(r["id"], r["reward"]["total"]) for r in kept] == [("q#2", 1.5)]  # the exact match
    assert srv.requests() == 9



def test_a_rerun_that_fails_again_keeps_the_partial_file_and_exits_1(serve, data):
    """The re-run reads OUT.partial (its reused rewards), fails again, and rewrites it: the
    judge's failure (RuntimeFailure, exit 1), not "an input of this stage" (exit 2)."""
    srv = serve(always(500, "down"))
    path = data(answers=("a1", "a2", "paris", "a4"))
    out = path.with_name("scored.jsonl")
    for _ in range(2):
        with pytest.raises(RuntimeFailure, match=r"3 of 4 rows unscored"):
            main(str(path), str(out), srv.spec, judge_options=judge_options(retries=0))
    partial = out.with_name("scored.jsonl.partial")
    kept = [orjson.loads(x) for x in partial.read_bytes().splitlines()]
    assert [r["id"] for r in kept] == ["q#2"] and not out.exists()

def test_few_unscored_rows_under_the_threshold_pass(serve, data):
    srv = serve(lambda path, body, n: (500, "", 0) if "Marseille" in str(body) else (200, YES, 0))
    rows, stats = score(data(answers=("Marseille", "b", "c", "d")), srv.spec, max_unscored=0.25)
    assert stats["unscored"] == 1 and rows[1]["reward"]["accuracy"] == 1.0


def test_rerun_hits_the_cache_and_failures_are_not_cached(serve, data):
    srv = serve(always(200, YES))
    path = data(answers=("x", "y", "z"))
    score(path, srv.spec)
    assert srv.requests() == 3
    rows, stats = score(path, srv.spec)
    assert srv.requests() == 3 and stats["cache_hits"] == 3 and stats["judge_calls"] == 0
    assert all(r["reward"]["accuracy"] == 1.0 for r in rows)

    down = serve(always(500, ""))
    score(path, down.spec.replace("judge-model", "other"), judge_retries=0, max_unscored=1.0)
    up = serve(always(200, NO))
    rows, stats = score(path, up.spec.replace("judge-model", "other"))
    assert up.requests() == 3 and stats["cache_hits"] == 0  # the failures left nothing behind


def test_cache_path_option_and_shared_file(tmp_path, serve, data):
    srv = serve(always(200, YES))
    cache = tmp_path / "elsewhere" / "v.sqlite"
    score(data(), srv.spec, judge_cache=str(cache))
    con = sqlite3.connect(cache)
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert con.execute("SELECT count(*) FROM verdicts").fetchone()[0] == 1
    other = VerdictCache(str(cache))  # a second process' view
    (key,) = con.execute("SELECT key FROM verdicts").fetchone()
    assert other.get(key) is True
    other.close()


def test_concurrency_is_bounded(serve, data):
    srv = serve(always(200, YES, delay=0.15))
    score(data(answers=tuple(f"a{i}" for i in range(8))), srv.spec, judge_concurrency=2)
    assert srv.requests() == 8 and srv.max_in_flight == 2


def test_judge_semaphore_bounds_callers_that_bring_their_own_threads(serve, tmp_path):
    srv = serve(always(200, YES, delay=0.15))
    judge = make_judge(srv.spec, JudgeOptions(concurrency=2, cache_path=str(tmp_path / "c.db")))
    threads = [threading.Thread(target=judge.verdict, args=("q", "g", f"r{i}", None))
               for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    judge.close()
    assert srv.requests() == 6 and srv.max_in_flight == 2


def test_missing_image_is_bad_input_before_any_call(serve, data, tmp_path):
    srv = serve(always(200, YES))
    path = data()
    (tmp_path / "images" / "q.png").unlink()
    with pytest.raises(BadInput, match=r"traj\.jsonl:1: images\[0\]\.path: "):
        score(path, srv.spec)
    assert srv.requests() == 0 and not (tmp_path / "scored.jsonl").exists()


@pytest.mark.parametrize("spec,msg", [
    ("gpt-4o", "valid forms: exact, openai:MODEL@URL"),
    ("openai:", "no model name"),
    ("openai:@http://x/v1", "no model name"),
    ("openai:m@ftp://x", "must start with http"),
    ("exact:x", "takes no argument"),
])
def test_bad_specs(spec, msg):
    with pytest.raises(BadInput, match=msg):
        make_judge(spec, JudgeOptions())


def test_spec_forms(tmp_path):
    j = make_judge("openai:Qwen/Qwen2.5-VL@http://h:8000/v1/", JudgeOptions(
        cache_path=str(tmp_path / "c.sqlite")))
    assert (j.name, j.model, j.url) == ("openai:Qwen/Qwen2.5-VL", "Qwen/Qwen2.5-VL",
                                        "http://h:8000/v1/chat/completions")
    j.close()
    assert make_judge("exact").name == "exact"


def test_api_key_never_leaks_cli(serve, data, tmp_path):
    """A server that echoes the key in its error; the key must reach no output, sidecar or log,
    whether the stage fails (too many unscored rows) or writes the unscored rows."""
    srv = serve(always(401, '{"error": "Incorrect API key provided: ' + SENTINEL + '"}'))
    path = data(answers=("x", "y"))
    out = tmp_path / "scored.jsonl"
    env = {**os.environ, "OPENAI_API_KEY": SENTINEL}

    def reward(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "marscli", "reward", str(path), "--judge",
                               srv.spec, "-o", str(out), *extra], env=env, text=True,
                              capture_output=True, timeout=60, check=False)

    p = reward()
    assert p.returncode == 1, p.stderr
    assert srv.log[0]["headers"]["Authorization"] == f"Bearer {SENTINEL}"  # sent, to the judge
    assert srv.requests() == 2  # 401: no retries
    assert p.stderr.strip().splitlines()[-1].startswith("error: 2 of 2 rows unscored")
    q = reward("--max-unscored", "1")
    assert q.returncode == 0, q.stderr
    files = [f.read_bytes().decode("utf-8", "replace") for f in tmp_path.rglob("*")
             if f.is_file()]
    assert all(SENTINEL not in t for t in [p.stdout, p.stderr, q.stdout, q.stderr, *files])
    assert "<redacted>" in out.read_text()


def test_cli_judge_options(serve, data, tmp_path):
    srv = serve(always(500, ""))
    out = tmp_path / "scored.jsonl"
    p = subprocess.run([sys.executable, "-m", "marscli", "reward", str(data()), "--judge", srv.spec,
                        "--judge-retries", "0", "--judge-timeout", "5", "--judge-cache",
                        str(tmp_path / "c.sqlite"), "--max-unscored", "0", "-o", str(out)],
                       text=True, capture_output=True, timeout=60, check=False)
    assert p.returncode == 1 and srv.requests() == 1, p.stderr
    assert not out.exists()  # a failed stage leaves nothing done
    assert (tmp_path / "c.sqlite").exists()
