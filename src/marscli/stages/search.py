"""`marscli search`: print what `text_search_tool(QUERY)` or `image_search_tool()` would return
to the model (tools/search.py), as text or as JSON; a backend that failed exits 1, a bad query
or backend spec exits 2."""

from __future__ import annotations

import orjson

from marscli.errors import BadInput, RuntimeFailure, check_range
from marscli.tools.search import load_row, query_image, query_text, result_json, tool_failed

MAX_K, MAX_CHARS = 100, 1 << 24  # --k, --max-chars


def main(query: str | None = None, text_search: str | None = None, image: str | None = None,
         image_search: str = "data", row: str | None = None, k: int = 5, max_chars: int = 8192,
         fetch_pages: bool = False, summarizer: str | None = None,
         summarizer_model: str | None = None, no_cache: bool = False,
         as_json: bool = False) -> None:
    """A text search (QUERY with `text_search`) or an image search (`image` and/or the prompt
    `row` ROWS.jsonl[:LINE], with `image_search`), its result printed to stdout."""
    check_range("--k", k, 1, MAX_K)
    check_range("--max-chars", max_chars, 1, MAX_CHARS)
    if (query is None) == (image is None and row is None):
        raise BadInput("give either a QUERY (text search) or --image/--row (image search)")
    opts = {"k": k, "max_chars": max_chars, "fetch_pages": fetch_pages,
            "summarizer": summarizer, "summarizer_model": summarizer_model}
    if no_cache:
        opts["cache"] = None
    if query is not None:
        if not text_search:
            raise BadInput("a QUERY needs --text-search SPEC — e.g. local:index.sqlite, "
                           "retriever:http://127.0.0.1:8000, serper")
        res = query_text(query, text_search, **opts)
    else:
        res = query_image(image, image_search, load_row(row) if row else None, **opts)
    if tool_failed(res):
        raise RuntimeFailure(res.text)
    if not res.ok:
        raise BadInput(res.text.removeprefix("error: "))
    print(orjson.dumps(result_json(res)).decode() if as_json else res.text)
