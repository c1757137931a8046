"""Tool health in eval's summary (issue 34 item 3): an eval against fake backends that fail a
known share — a Serper-shaped search server (HTTP 500s, a slow reply, an empty result, pages
that 404), a summariser that fails one query, the data image search with and without the
row's results, and a judge that needs a retry once and never answers once — gives summary
health fields equal to the counts computed by hand below, per benchmark and per category; the
broken-backend warning appears above `--max-tool-failure-rate` and not below; the endpoints
are named with their credentials redacted; `eval summarize RUN` carries the health columns."""

from __future__ import annotations

import json
import re
import shutil

import orjson
import pytest
from PIL import Image

from marscli.evaluation.summary import summarize
from marscli.scoring.judge import JudgeOptions
from marscli.stages.eval import run_eval

from fakes import FakeServer, chat_reply, serper_reply
from helpers import answer, invoke, write_bench

TIMEOUT = 0.5  # the search timeout; the slow query's reply comes after SLOW
SLOW = 2.0


def call(name: str, **args) -> str:
    return (f"<thinking>Look it up.</thinking><tool_call>"
            f"{json.dumps({'name': name, 'arguments': args})}</tool_call>")


def text(q: str) -> str:
    return call("text_search_tool", query=q)


IMAGE = call("image_search_tool")
THUMB = [{"title": "A red thing", "thumbnail": "thumb.png"}]

# Category a: alpha (2 pages, 1 read) + image search from the row's cache; fail (HTTP 500);
# slow (timeout). Category b: beta (2 pages, 1 read) then alpha again (the search cache
# answers: turn 1 comes after every turn-0 call); none (empty) + image search with no results
# (empty); sumfail (the summariser fails: a backend error). Answers: red is exact (no judge);
# retry needs one judge retry; blue is judged No; broken gets no verdict (unscored).
ROWS = [
    {"id": "r1", "category": "a", "replies": [text("alpha"), IMAGE, answer("red")],
     "image_search": THUMB},
    {"id": "r2", "category": "a", "replies": [text("fail"), answer("retry")]},
    {"id": "r3", "category": "a", "replies": [text("slow"), answer("blue")]},
    {"id": "r4", "category": "b", "replies": [text("beta"), text("alpha"), answer("broken")]},
    {"id": "r5", "category": "b", "replies": [text("none"), IMAGE, answer("red")],
     "image_search": []},
    {"id": "r6", "category": "b", "replies": [text("sumfail"), answer("red")]},
]


def search_server() -> FakeServer:
    srv = FakeServer()

    def search(path, body, attempt):
        q = body["q"]
        if q == "fail":
            return 500, "backend down"
        if q == "none":
            return 200, {"organic": []}
        hits = serper_reply((f"{q} one", f"{srv.url}/page/ok", "snippet one"),
                            (f"{q} two", f"{srv.url}/{q}/bad", "snippet two"))
        return (200, hits, SLOW if q == "slow" else 0.0)

    srv.routes.update({
        "/search": search,
        "/page/ok": lambda p, b, a: (200, "<html><body><p>Alpha was built in 1900.</p></body>"
                                     "</html>", 0, {"Content-Type": "text/html"}),
        "/bad": lambda p, b, a: (404, "gone"),
    })
    return srv


def summariser(path, body, attempt):
    prompt = body["messages"][0]["content"]
    if "query: sumfail" in prompt:
        return 500, "summariser down"
    return 200, chat_reply("A short summary.")


def judge(path, body, attempt):
    cand = re.search(r"Candidate answer: (.*)", body["messages"][0]["content"][-1]["text"])[1]
    if cand == "retry":
        return (500, "busy") if attempt == 1 else (200, chat_reply("<judge>Yes</judge>"))
    if cand == "broken":
        return 200, chat_reply("I cannot tell.")  # no verdict tag: malformed, retried, fails
    return 200, chat_reply("<judge>No</judge>")


@pytest.fixture(scope="module")
def health_run(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("health")
    bench = write_bench(tmp / "bench" / "fvqa.jsonl",
                        [{"benchmark": "fvqa", "question": "What colour?", "answer": ["red"],
                          **r} for r in ROWS])
    Image.new("RGB", (32, 32), (200, 30, 30)).save(bench.parent / "thumb.png")
    srv, llm, jdg = search_server(), FakeServer(summariser), FakeServer(judge)
    mp = pytest.MonkeyPatch()
    mp.setenv("SERPER_API_KEY", "serper-key-123")
    mp.setenv("SERPER_BASE_URL", srv.url)
    authed = jdg.url.replace("http://", "http://user:sekrit99@")
    try:
        out = tmp / "run" / "r.jsonl"
        summary = run_eval(
            str(bench), str(out), policy=str(tiny_model), engine="replay", max_turns=4,
            progress=False, text_search="serper", image_search="data",
            search_timeout=TIMEOUT, search_retries=0,
            search_opts={"fetch_pages": True, "summarizer": llm.url + "/v1",
                         "summarizer_model": "sum-m", "cache": str(tmp / "cache"),
                         "backoff": 0.01},
            judge_spec=f"openai:judge-m@{authed}/v1", max_unscored=1.0,
            judge_opts=JudgeOptions(attempts=2, backoff_s=0.01, timeout_s=10,
                                    cache_path=str(tmp / "judge.sqlite")))
    finally:
        mp.undo()
        for s in (srv, llm, jdg):
            s.close()
    return out, summary


def test_benchmark_health_equals_the_known_counts(health_run):
    out, s = health_run
    h = s["benchmarks"]["fvqa"]["health"]
    assert h["tools"]["text_search_tool"] == {
        "calls": 7, "failures": {"backend_error": 2, "timeout": 1, "empty": 1},
        "failure_rate": round(4 / 7, 4), "cache_hits": 1}
    assert h["tools"]["image_search_tool"] == {"calls": 2, "failures": {"empty": 1},
                                               "failure_rate": 0.5, "cache_hits": 1}
    assert h["failure_rate"] == round(4 / 7, 4)
    assert h["pages"] == {"fetched": 4, "ok": 2, "success_rate": 0.5}
    assert h["summarizer_failures"] == 1
    assert h["judge"] == {"asked": 3, "retries": 2, "failures": 1, "cache_hits": 0,
                          "failure_rate": round(1 / 3, 4)}
    assert h["image_search_cache_hits"] == 1
    assert s["benchmarks"]["fvqa"]["broken_backend"] is True
    assert s["broken_backend"] == ["fvqa"] and s["max_tool_failure_rate"] == 0.05
    assert s["benchmarks"]["fvqa"]["unscored"] == 1  # broken: the judge's one failure
    assert s == orjson.loads(out.with_name("r.summary.json").read_bytes())


def test_category_health_equals_the_known_counts(health_run):
    _, s = health_run
    a, b = (s["benchmarks"]["fvqa"]["categories"][c]["health"] for c in "ab")
    assert a["tools"]["text_search_tool"]["failures"] == {"backend_error": 1, "timeout": 1}
    assert a["tools"]["image_search_tool"] == {"calls": 1, "failures": {},
                                              "failure_rate": 0.0, "cache_hits": 1}
    assert (a["pages"]["fetched"], a["pages"]["ok"], a["summarizer_failures"]) == (2, 1, 0)
    assert (a["judge"]["asked"], a["judge"]["retries"], a["judge"]["failures"]) == (2, 1, 0)
    assert b["tools"]["text_search_tool"] == {
        "calls": 4, "failures": {"backend_error": 1, "empty": 1}, "failure_rate": 0.5,
        "cache_hits": 1}
    assert b["tools"]["image_search_tool"]["failure_rate"] == 1.0
    assert (b["pages"]["fetched"], b["pages"]["ok"], b["summarizer_failures"]) == (2, 1, 1)
    assert (b["judge"]["asked"], b["judge"]["retries"], b["judge"]["failures"]) == (1, 1, 1)


def test_records_carry_health_and_redacted_endpoints(health_run):
    out, s = health_run
    recs = {r["id"]: r for r in map(orjson.loads, out.read_bytes().splitlines())}
    assert recs["r3#0"]["tool_health"] == {"text_search_tool": {"timeout": 1}}
    assert recs["r4#0"]["tool_health"] == {"text_search_tool": {
        "cache_hits": 1, "pages_fetched": 2, "pages_ok": 1}}
    assert recs["r4#0"]["score"]["judge_calls"] == {"asked": 1, "retries": 1, "failures": 1}
    assert recs["r4#0"]["score"]["status"] == "unscored"
    ends = s["benchmarks"]["fvqa"]["health"]["endpoints"]
    assert set(ends) == {"text_search", "summarizer", "image_search", "judge"}
    assert ends["image_search"] == ["data"]
    assert ends["text_search"][0].startswith("serper http://127.0.0.1:")
    assert ends["judge"][0].startswith("openai:judge-m@http://<redacted>@127.0.0.1:")
    blob = out.read_bytes() + out.with_name("r.summary.json").read_bytes()
    assert b"sekrit99" not in blob and b"serper-key-123" not in blob


def test_warning_above_the_threshold_and_not_below(health_run):
    """The worst benchmark-level rate is text search's 4/7 = 0.5714: at 0.57 the benchmark is
    broken, at 0.58 it is not (its categories still are: a's text search failed 2 of 3, b's
    image search 1 of 1)."""
    out, _ = health_run
    res = out.parent / "again.jsonl"
    shutil.copy(out, res)
    code, _, err = invoke(["eval", "summarize", str(res), "--max-tool-failure-rate", "0.57",
                             "--max-unscored", "1"])
    assert code == 0, err
    assert "warning: fvqa: broken backend — text_search_tool: 57.1% of 7 calls failed" in err
    assert "measured with a broken backend" in err
    assert re.search(r"fvqa\s.*\ball\b.*\s!\s", err)  # the accuracy cell is marked
    s = orjson.loads(res.with_name("again.summary.json").read_bytes())
    assert s["broken_backend"] == ["fvqa"] and s["max_tool_failure_rate"] == 0.57
    code, _, err = invoke(["eval", "summarize", str(res), "--max-tool-failure-rate", "0.58",
                             "--max-unscored", "1"])
    assert code == 0, err
    assert "warning: fvqa: broken backend" not in err
    assert "warning: fvqa/a: broken backend — text_search_tool: 66.7% of 3 calls" in err
    assert "warning: fvqa/b: broken backend — image_search_tool: 100.0% of 1 calls" in err
    s = orjson.loads(res.with_name("again.summary.json").read_bytes())
    assert s["broken_backend"] == [] and not s["benchmarks"]["fvqa"]["broken_backend"]
    assert all(c["broken_backend"] for c in s["benchmarks"]["fvqa"]["categories"].values())
    # the health lines name every count
    assert ("health: fvqa: tool calls image_search_tool 2, text_search_tool 7" in err
            and "pages read 2/4; summariser failures 1; judge 3 asked, 2 retries, 1 failed"
            in err)


def test_healthy_run_has_no_warning(tiny_model, tmp_path):
    """Zoom-in only (no backend): every rate is 0 or undefined, nothing is marked."""
    bench = write_bench(tmp_path / "b.jsonl", [
        {"id": "z", "benchmark": "vstar", "question": "Colour?\nA. red\nB. blue",
         "answer": ["A"], "choices": ["red", "blue"],
         "replies": [call("image_zoom_in_tool", bbox_2d=[0, 0, 500, 500]), answer("A")]}])
    s = run_eval(str(bench), str(tmp_path / "r.jsonl"), policy=str(tiny_model),
                 engine="replay", max_turns=3, progress=False)
    h = s["benchmarks"]["vstar"]["health"]
    assert h["tools"] == {"image_zoom_in_tool": {"calls": 1, "failures": {},
                                                 "failure_rate": 0.0, "cache_hits": 0}}
    assert h["warnings"] == [] and s["broken_backend"] == []
    assert h["pages"]["success_rate"] is None and h["judge"]["failure_rate"] is None
    assert h["endpoints"] == {"judge": ["exact"]}


def test_checkpoint_table_has_the_health_columns(health_run, tmp_path):
    out, _ = health_run
    run = tmp_path / "run" / "eval"
    run.mkdir(parents=True)
    shutil.copy(out.with_name("r.summary.json"), run / "ckpt-1.summary.json")
    old = orjson.loads(out.with_name("r.summary.json").read_bytes())
    for b in old["benchmarks"].values():  # a summary from before health was recorded
        b.pop("health")
    (run / "ckpt-2.summary.json").write_bytes(orjson.dumps(old))
    code, stdout, err = invoke(["eval", "summarize", str(run.parent), "--json"])
    assert code == 0, err
    doc = json.loads(stdout)
    h1, h2 = (r["health"] for r in doc["checkpoints"])
    assert h1["failure_rate"] == round(4 / 7, 4) and h1["broken_backend"] == ["fvqa"]
    assert h1["pages"] == {"fetched": 4, "ok": 2, "success_rate": 0.5}
    assert h1["judge"] == {"asked": 3, "retries": 2, "failures": 1}
    assert h2["known"] is False and h2["broken_backend"] == []
    assert doc["checkpoints"][0]["benchmarks"]["fvqa"]["broken_backend"] is True
    for col in ("tool fail %", "pages ok %", "judge fail/retry"):
        assert col in err
    assert re.search(r"ckpt-1.*\s57\.1\s.*\s50\.0\s.*1/2", err)
    assert "warning: ckpt-1: fvqa measured with a broken backend" in err
    assert "ckpt-2: fvqa" not in err


def test_summarize_refuses_a_bad_threshold(health_run):
    out, _ = health_run
    code, _, err = invoke(["eval", "summarize", str(out), "--max-tool-failure-rate", "2"])
    assert code == 2 and "--max-tool-failure-rate" in err


def test_records_without_kinds_count_as_unknown(tmp_path):
    """Records written before failure kinds were: their `tool_failures` count as `unknown`."""
    rec = {"v": 1, "id": "q#0", "prompt_id": "q", "benchmark": "fvqa", "stop": "answer",
           "turns": 2, "tool_calls": {"text_search_tool": 2},
           "tool_failures": {"text_search_tool": 1},
           "score": {"protocol": "mars", "accuracy": 1.0, "method": "exact"}}
    res = tmp_path / "old.jsonl"
    res.write_bytes(orjson.dumps(rec) + b"\n")
    h = summarize(str(res))["benchmarks"]["fvqa"]["health"]
    assert h["tools"]["text_search_tool"]["failures"] == {"unknown": 1}
    assert h["failure_rate"] == 0.5 and h["warnings"]
