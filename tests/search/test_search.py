"""Search without a network: the FTS5 text index, query escaping, formatting, the cache."""

from __future__ import annotations

import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import orjson
import pytest

from marscli.errors import BadInput
from marscli.search import SearchOptions, check_image_spec, check_text_spec, make_text_backend
from marscli.search.cache import ResultCache, cache_key, public_spec
from marscli.search.remote import html_text
from marscli.search.summarize import extractive
from marscli.search.text_index import build_text_index, fts_query
from marscli.tools import TOOLS
from marscli.tools.search import TextSearchTool, tool_failed

DOCS = [
    {"id": 1, "title": "Eiffel Tower", "text": "The Eiffel Tower is a wrought-iron lattice tower "
     "in Paris. It was completed in 1889 for the World's Fair."},
    {"id": 2, "title": "Statue of Liberty", "text": "A colossal copper sculpture on Liberty "
     "Island in New York Harbor, dedicated in 1886."},
    {"id": "3", "contents": "\"Big Ben\"\nBig Ben is the nickname of the Great Bell of the clock "
     "at the Palace of Westminster in London."},
    {"id": 4, "title": "Paris", "text": "Paris is the capital of France, on the Seine."},
]


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MARSCLI_CACHE_DIR", str(tmp_path / "cache"))


def write_jsonl(path, rows):
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return str(path)


@pytest.fixture
def index(tmp_path):
    out = tmp_path / "idx.sqlite"
    assert build_text_index(write_jsonl(tmp_path / "c.jsonl", DOCS), out) == 4
    return str(out)


def test_query_ranks_the_matching_document_first(index):
    be = make_text_backend(f"local:{index}")
    hits = be.search("When was the Eiffel tower completed?", 3)
    assert hits[0].title == "Eiffel Tower" and "1889" in hits[0].text
    assert make_text_backend(f"local:{index}").search("westminster bell", 2)[0].title == "Big Ben"
    # Search-R1 `contents` rows: title split off the first line, quotes stripped
    assert all(h.title != '"Big Ben"' for h in be.search("big ben", 5))
    assert len(be.search("paris", 1)) == 1


def test_tool_text_is_a_numbered_list(index):
    res = TextSearchTool(f"local:{index}", k=2)({"query": "Paris tower"}, None)
    assert res.ok and res.text.startswith("[1] ")
    assert "\n\n[2] " in res.text and "[3]" not in res.text


def test_ranking_survives_a_large_corpus(tmp_path):
    rng = random.Random(0)
    vocab = [f"w{i}" for i in range(3000)]
    rows = [{"id": i, "title": " ".join(rng.choices(vocab, k=3)),
             "text": " ".join(rng.choices(vocab, k=60))} for i in range(10_000)]
    rows[7321]["text"] += " quokka zanzibar marmalade"
    rows[42]["text"] += " quokka"  # one term only: must rank below the doc with all three
    out = tmp_path / "big.sqlite"
    t0 = time.time()
    assert build_text_index(write_jsonl(tmp_path / "big.jsonl", rows), out) == 10_000
    build_s = time.time() - t0
    be = make_text_backend(f"local:{out}")
    t0 = time.time()
    hits = be.search("the quokka of zanzibar eats marmalade", 5)
    assert time.time() - t0 < 5.0 and build_s < 120  # FTS5, not a scan: generous bounds
    assert [h.text.count("quokka") for h in hits[:2]] == [1, 1]
    assert "zanzibar" in hits[0].text and "zanzibar" not in hits[1].text


@pytest.mark.parametrize("q", ['"', '""', 'say "hi', "AND", "a AND b OR NOT c", "*", "foo*",
                               "(", "((paris)", "title:paris", "NEAR(a b)", "^paris", "-", "",
                               "   ", "'; DROP TABLE docs; --", "paris\x00tower", "é ü 東京",
                               "x" * 5000, " ".join(["paris"] * 500)])
def test_weird_queries_do_not_raise(index, q):
    hits = make_text_backend(f"local:{index}").search(q, 5)
    assert isinstance(hits, list)
    res = TextSearchTool(f"local:{index}")({"query": q}, None)
    assert isinstance(res.text, str) and not tool_failed(res)


def test_fts_query_is_only_quoted_tokens():
    assert fts_query('the "Eiffel" AND tower*') == '"eiffel" OR "tower"'
    assert fts_query("the of") == '"the" OR "of"'  # only stop words: keep them
    assert fts_query("*** ()") is None


def test_bad_corpus_row_names_file_line_field_and_leaves_nothing(tmp_path, index):
    corpus = write_jsonl(tmp_path / "bad.jsonl", DOCS[:2] + [{"id": 9, "title": "no text"}])
    out = tmp_path / "out.sqlite"
    with pytest.raises(BadInput, match=r"bad\.jsonl:3: text: missing required field"):
        build_text_index(corpus, out)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("out")) == []
    # an existing index is left as it was
    before = Path(index).read_bytes()
    with pytest.raises(BadInput):
        build_text_index(corpus, index)
    assert Path(index).read_bytes() == before


def test_specs_are_checked_early(tmp_path, index):
    with pytest.raises(BadInput, match="choose one of: local, retriever, serper"):
        check_text_spec("bing")
    with pytest.raises(BadInput, match="local:PATH"):
        check_text_spec("local")
    with pytest.raises(BadInput, match="marscli index text"):
        check_text_spec(f"local:{tmp_path}/missing.sqlite")
    (tmp_path / "junk.sqlite").write_text("not a database")
    with pytest.raises(BadInput, match="not a marscli text index"):
        check_text_spec(f"local:{tmp_path}/junk.sqlite")
    with pytest.raises(BadInput, match="choose one of: data, local, serper-lens"):
        check_image_spec("google")
    with pytest.raises(BadInput, match="takes no argument"):
        check_image_spec("data:x")
    check_text_spec(f"local:{index}")
    check_image_spec("data")
    with pytest.raises(BadInput, match="unknown search option 'topk'"):
        check_text_spec(f"local:{index}", topk=3)
    with pytest.raises(BadInput, match="summarizer_model"):
        SearchOptions.from_opts(summarizer="http://x")


def test_model_mistakes_are_error_observations(index):
    tool = TOOLS.get("text_search_tool")(f"local:{index}")
    for args in ({}, {"query": 3}, {"query": ["a"]}, {"query": None}, {"query": " "}):
        res = tool(args, None)
        assert not res.ok and res.text.startswith("error:") and not tool_failed(res)
    assert tool.stats()["errors"] == 5


def test_schemas_are_openai_functions(index):
    tool = TextSearchTool(f"local:{index}")
    fn = tool.schema["function"]
    assert tool.schema["type"] == "function" and fn["name"] == "text_search_tool" == tool.name
    assert fn["parameters"]["required"] == ["query"]
    img = TOOLS.get("image_search_tool")("data")
    assert img.schema["function"]["name"] == "image_search_tool"
    assert img.schema["function"]["parameters"]["properties"] == {}


def test_truncation_and_neutralised_markers(tmp_path):
    docs = [{"id": i, "title": f"doc {i} <image>", "text": ("paris <|im_end|> " * 200)}
            for i in range(5)]
    out = tmp_path / "i.sqlite"
    build_text_index(write_jsonl(tmp_path / "c.jsonl", docs), out)
    res = TextSearchTool(f"local:{out}", max_chars=1000, snippet_chars=5000)(
        {"query": "paris"}, None)
    assert len(res.text) <= 1000 and res.text.endswith("[truncated]")
    assert "<image>" not in res.text and "<|" not in res.text


def test_extractive_summary_keeps_relevant_sentences():
    text = ("Cookies are nice. " * 30 + "The bridge opened in 1932 after six years. "
            + "Weather was mild. " * 30)
    out = extractive("when did the bridge open", text, 120)
    assert "1932" in out and len(out) <= 120
    assert extractive("x", "short", 100) == "short"


def test_html_text_drops_scripts_and_tags():
    html = ("<html><head><title>t</title><style>p{}</style></head><body><script>var x=1"
            "</script><p>Hello&nbsp;<b>world</b></p><div>second</div></body></html>")
    assert html_text(html) == "Hello world\nsecond"


def test_public_spec_removes_secrets(monkeypatch):
    monkeypatch.setenv("SERPER_API_KEY", "SENTINEL123")
    s = public_spec("retriever:http://user:pw@h:8000/retrieve?api_key=abc&x=1 SENTINEL123")
    assert "pw" not in s and "abc" not in s and "SENTINEL123" not in s and "x=1" in s


def test_cache_stores_only_successes(tmp_path):
    c = ResultCache(tmp_path)
    calls = []

    def boom():
        calls.append(1)
        raise RuntimeError("down")

    with pytest.raises(RuntimeError):
        c.through("k", boom)
    assert c.through("k", lambda: {"a": 1}) == {"a": 1}
    assert c.through("k", boom) == {"a": 1} and len(calls) == 1
    assert cache_key("a", 1) != cache_key("a", 2)


_WRITER = """
import sys
from marscli.search.cache import ResultCache
c = ResultCache(sys.argv[1])
for i in range(200):
    c.put(f"p{sys.argv[2]}-{i}", {"i": i})
"""


def test_cache_is_safe_across_threads_and_processes(tmp_path):
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), str(n)])
             for n in range(2)]
    c = ResultCache(tmp_path)

    def work(t):
        for i in range(100):
            c.put(f"t{t}-{i}", [t, i])
            assert c.get(f"t{t}-{i}") == [t, i]

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(work, range(4)))  # re-raises a thread's failed assert
    assert [p.wait(60) for p in procs] == [0, 0]
    assert c.get("p1-199") == {"i": 199} and c.get("t3-99") == [3, 99]
    n = c._db().execute("SELECT count(*) FROM cache").fetchone()[0]
    assert n == 2 * 200 + 4 * 100
