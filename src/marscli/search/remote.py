"""Backends behind HTTP: a Search-R1 retrieval server, Serper (Google) search and Lens.

The Serper key travels only in the `X-API-KEY` header of requests to Serper, never to fetched
pages or thumbnails, and never into a message (`SearchError` text is redacted).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from html.parser import HTMLParser
from typing import Any, ClassVar
from urllib.parse import urlparse

from marscli.errors import BadInput
from marscli.search import (
    IMAGE_BACKENDS,
    TEXT_BACKENDS,
    Hit,
    ImageHit,
    NoInput,
    SearchOptions,
    need_arg,
    no_arg,
)
from marscli.search.cache import cache_key, open_cache, public_spec
from marscli.search.errors import SearchError
from marscli.search.text_index import split_contents

SERPER_DEFAULT = "https://google.serper.dev"
PAGE_CHARS = 20_000  # page text kept per fetched page (the summariser's input)


def _http_url(url: str) -> str:
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    p = urlparse(url)
    if p.scheme not in ("http", "https") or not p.netloc:
        raise BadInput(f"{public_spec(url)}: not an http(s) URL")
    return url


def _shape(what: str, e: Exception) -> SearchError:
    return SearchError(f"{what}: unexpected reply shape ({type(e).__name__}: {e})")


class RetrieverBackend:
    """Search-R1's retrieval server: POST {queries, topk, return_scores} → result[0][i]."""

    cacheable = True

    def __init__(self, url: str, opts: SearchOptions) -> None:
        url = _http_url(url).rstrip("/")
        self.url = url if url.endswith("/retrieve") else url + "/retrieve"
        self.spec = f"retriever:{self.url}"
        self.client = opts.client()

    def search(self, query: str, k: int) -> list[Hit]:
        data = self.client.post_json(self.url, {"queries": [query], "topk": k,
                                                "return_scores": True})
        try:
            hits = []
            for item in data["result"][0][:k]:
                doc = item.get("document", item)  # without return_scores: bare documents
                if "contents" in doc:
                    title, text = split_contents(doc["contents"])
                else:
                    title, text = doc.get("title", ""), doc["text"]
                score = item.get("score")
                hits.append(Hit(title=title, text=text,
                                score=float(score) if score is not None else None))
            return hits
        except (KeyError, IndexError, TypeError, AttributeError, ValueError) as e:
            raise _shape("retriever", e) from None


def serper_key() -> str:
    key = os.environ.get("SERPER_API_KEY", "").strip()
    if not key:
        raise BadInput("serper search needs an API key — set the environment variable "
                       "SERPER_API_KEY (https://serper.dev)")
    return key


def serper_base() -> str:
    return _http_url(os.environ.get("SERPER_BASE_URL") or SERPER_DEFAULT).rstrip("/")


class SerperBackend:
    """Google results from serper.dev; with `fetch_pages`, the top-k pages' text instead of
    Google's snippets (what the paper summarises)."""

    cacheable = True

    def __init__(self, opts: SearchOptions) -> None:
        self._key = serper_key()
        self.url = serper_base() + "/search"
        self.spec = f"serper {self.url}" + (" +pages" if opts.fetch_pages else "")
        self.fetch_pages = opts.fetch_pages
        self.max_bytes = opts.max_download_bytes
        self.client = opts.client()
        self.pages = opts.client()  # separate client: never sends the key to third parties

    def search(self, query: str, k: int) -> list[Hit]:
        data = self.client.post_json(self.url, {"q": query}, headers={"X-API-KEY": self._key})
        try:
            hits = [Hit(title=o.get("title", ""), text=o.get("snippet", ""), url=o.get("link"))
                    for o in data.get("organic", [])[:k]]
        except (AttributeError, TypeError) as e:
            raise _shape("serper", e) from None
        if self.fetch_pages and hits:
            with ThreadPoolExecutor(len(hits)) as pool:
                texts = list(pool.map(self._page_text, hits))
            for h, t in zip(hits, texts):
                h.text = t or h.text  # an unreadable page keeps Google's snippet
                h.fetched = None if not h.url else t is not None  # counted as tool health
        return hits

    def _page_text(self, hit: Hit) -> str | None:
        if not hit.url:
            return None
        try:
            body = self.pages.get_bytes(hit.url, max_bytes=self.max_bytes, attempts=1)
        except SearchError:
            return None
        if body.lstrip()[:5] == b"%PDF-":
            return None
        return html_text(body.decode("utf-8", "replace"))[:PAGE_CHARS] or None


class _Text(HTMLParser):
    SKIP: ClassVar[set[str]] = {"script", "style", "noscript", "svg", "template", "head"}
    BLOCK: ClassVar[set[str]] = {"p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "h5", "h6",
                                 "section", "article", "table", "ul", "ol", "blockquote", "pre"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skipping = 0

    def handle_starttag(self, tag: str, attrs: Any) -> None:
        if tag in self.SKIP:
            self.skipping += 1
        elif tag in self.BLOCK:
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in self.SKIP and self.skipping:
            self.skipping -= 1
        elif tag in self.BLOCK:
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        if not self.skipping:
            self.parts.append(data)


def html_text(html: str) -> str:
    """Visible text of an HTML page, one paragraph a line."""
    p = _Text()
    p.feed(html)
    p.close()
    lines = (" ".join(line.split()) for line in "".join(p.parts).split("\n"))
    return "\n".join(line for line in lines if line)


class SerperLensBackend:
    """Reverse image search of the row's public `image_url` with Google Lens via serper.dev."""

    def __init__(self, opts: SearchOptions) -> None:
        self._key = serper_key()
        self.url = serper_base() + "/lens"
        self.spec = "serper-lens"
        self.client = opts.client()
        self.cache = open_cache(opts.cache_dir())

    def find(self, ctx: Any, k: int) -> list[ImageHit]:
        image_url = (ctx.row or {}).get("image_url")
        if not isinstance(image_url, str) or not image_url.startswith(("http://", "https://")):
            raise NoInput("this image has no public image_url, so reverse image search "
                          "(serper-lens) cannot run on it")
        if self.cache is None:
            return [ImageHit(**h) for h in self._lens(image_url, k)]
        key = cache_key(public_spec(self.url), image_url, k)
        found = self.cache.get(key)
        if found is not None:
            return [ImageHit(**h, cached=True) for h in found]
        found = self._lens(image_url, k)
        self.cache.put(key, found)
        return [ImageHit(**h) for h in found]

    def _lens(self, image_url: str, k: int) -> list[dict]:
        data = self.client.post_json(self.url, {"url": image_url},
                                     headers={"X-API-KEY": self._key})
        try:
            items = list(data.get("organic") or []) + list(data.get("visualMatches") or [])
            out = []
            for it in items:
                thumb = it.get("thumbnailUrl") or it.get("imageUrl") or it.get("thumbnail")
                if it.get("title") and thumb:
                    out.append({"title": it["title"], "thumbnail": thumb})
            return out[:k]
        except (AttributeError, TypeError) as e:
            raise _shape("serper lens", e) from None


@TEXT_BACKENDS.register("retriever")
def _retriever(arg: str | None, opts: SearchOptions) -> RetrieverBackend:
    return RetrieverBackend(need_arg("retriever", arg, "url"), opts)


@TEXT_BACKENDS.register("serper")
def _serper(arg: str | None, opts: SearchOptions) -> SerperBackend:
    no_arg("serper", arg)
    return SerperBackend(opts)


@IMAGE_BACKENDS.register("serper-lens")
def _serper_lens(arg: str | None, opts: SearchOptions) -> SerperLensBackend:
    no_arg("serper-lens", arg)
    return SerperLensBackend(opts)
