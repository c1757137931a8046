"""`text_search_tool(query)` and `image_search_tool()`: the agent's two search tools.

Three kinds of outcome, told apart by `ok` and the text's first word:
- success: `ok=True`, a numbered list (`[1] Title\\nsnippet`; images as `[1] Title <image>`);
- the model's mistake (no query, a query that is not a string, nothing to search with):
  `ok=False`, text `error: ...` (from `marscli.tools.error`), counted by the format reward;
- the backend failing after its retries (a timeout is a total per request; a reply over the
  byte cap fails unretried): `ok=False`, text `search failed: ...` — a tool failure, not the
  model's fault (`tool_failed(result)` says which). Never an exception. The text is redacted:
  a password in the backend's URL (`retriever:http://user:PW@host`) never reaches the model.
Each result's `health` counts how the backend did (`marscli.tools.HEALTH_KEYS`): the failure's
kind (`timeout`, `backend_error`, or `empty` for a search that found nothing), a cache hit,
the pages read and tried, a summariser failure.
Text from the web is neutralised before the model sees it: `<image>` would be read as an image
marker and `<|...|>` as a special token.
"""

from __future__ import annotations

import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from io import BytesIO
from pathlib import Path
from typing import Any, ClassVar

from PIL import Image

from marscli.errors import MarsError
from marscli.qwen.images import MAX_INPUT_PIXELS, fit_pixels, open_image
from marscli.search import (
    Hit,
    ImageHit,
    NoInput,
    SearchOptions,
    make_image_backend,
    make_text_backend,
)
from marscli.search.cache import cache_key, open_cache, public_spec
from marscli.search.errors import SearchError
from marscli.search.summarize import LlmSummarizer, SummarizerError, extractive
from marscli.secrets import redact
from marscli.tools import (
    TOOLS,
    ConvImage,
    NewImage,
    ToolContext,
    ToolResult,
    error,
    function_schema,
)

FAILED = "search failed:"
THUMB_MAX_PIXELS = 512 * 512
TITLE_CHARS = 200
_SPECIAL = re.compile(r"<\|")


TEXT_SCHEMA = function_schema(
    "text_search_tool",
    "Search the web for text information related to your query. Use this when you need to find "
    "facts, news, or information.",
    {"query": {"type": "string", "description": "The search query to find relevant information"}},
    required=("query",))
IMAGE_SCHEMA = function_schema(
    "image_search_tool",
    "Perform a reverse image search to find similar images and related information. This can "
    "help identify objects, places, or find more context about the image.")


def failure(e: SearchError) -> ToolResult:
    """The observation of a backend failure, without a credential the model could read back
    (the message is redacted at the HTTP client already; this holds for any other source),
    and its kind as tool health."""
    health = {"timeout" if e.timed_out else "backend_error": 1}
    if isinstance(e, SummarizerError):
        health["summarizer_failures"] = 1
    return ToolResult(text=f"{FAILED} {redact(str(e))}", ok=False, failed=True, health=health)


def tool_failed(result: ToolResult) -> bool:
    """True when a search tool's backend failed (not the model's mistake)."""
    return result.failed


def clean(text: str) -> str:
    return _SPECIAL.sub("< |", text.replace("<image>", "[image]"))


def truncate(text: str, max_chars: int) -> str:
    mark = "\n…[truncated]"
    return text if len(text) <= max_chars else text[: max(0, max_chars - len(mark))] + mark


class _Counts:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.calls = self.errors = self.failures = 0

    def add(self, name: str) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + 1)


@TOOLS.register("text_search_tool")
class TextSearchTool:
    name = "text_search_tool"
    schema: ClassVar[dict] = TEXT_SCHEMA

    def __init__(self, spec: str, **opts: Any) -> None:
        """`spec`: a text backend (`local:INDEX`, `retriever:URL`, `serper`); `opts`: the
        fields of `SearchOptions` (k, max_chars, cache, summarizer, ...)."""
        self.opts = SearchOptions.from_opts(**opts)
        self.backend = make_text_backend(spec, self.opts)
        self.summarizer = (LlmSummarizer(self.opts.summarizer, self.opts.summarizer_model,
                                         self.opts) if self.opts.summarizer else None)
        # A local index answers faster than the cache; remote backends and LLMs do not.
        worth = self.backend.cacheable or self.summarizer is not None
        self.cache = open_cache(self.opts.cache_dir()) if worth else None
        self.counts = _Counts()

    def __call__(self, args: dict[str, Any], ctx: ToolContext | None = None) -> ToolResult:
        self.counts.add("calls")
        query = args.get("query") if isinstance(args, dict) else None
        if not isinstance(query, str):
            self.counts.add("errors")
            got = "nothing" if query is None else type(query).__name__
            return error(f'text_search_tool needs "query" as a string, got {got}')
        if not query.strip():
            self.counts.add("errors")
            return error("text_search_tool got an empty query")
        try:
            found, cached = self.lookup(query)
        except SearchError as e:
            self.counts.add("failures")
            return failure(e)
        return ToolResult(text=self.format(query, found), health=_health(found, cached))

    def search(self, query: str) -> dict:
        """`{"summary": str | None, "hits": [Hit as dict]}`, cached when worth it."""
        return self.lookup(query)[0]

    def lookup(self, query: str) -> tuple[dict, bool]:
        """`search`'s result, and whether the cache answered it."""
        def compute() -> dict:
            hits = self.backend.search(query, self.opts.k)
            summary = None
            if self.summarizer is not None:
                summary, hits = self.summarizer.summarize(query, hits)
            return {"summary": summary, "hits": [asdict(h) for h in hits]}

        if self.cache is None:
            return compute(), False
        llm = (public_spec(self.summarizer.url), self.summarizer.model) if self.summarizer \
            else None
        key = cache_key("text", public_spec(self.backend.spec), query, self.opts.k, llm)
        got = self.cache.get(key)
        if got is not None:
            return got, True
        found = compute()
        self.cache.put(key, found)  # only successes are stored
        return found, False

    def endpoints(self) -> dict[str, str]:
        """The servers this tool asks, redacted (eval's summary names them)."""
        out = {"text_search": redact(self.backend.spec)}
        if self.summarizer is not None:
            out["summarizer"] = redact(f"{self.summarizer.model}@{self.summarizer.url}")
        return out

    def format(self, query: str, found: dict) -> str:
        hits = [Hit(**h) for h in found["hits"]]
        if not hits:
            return clean(f"No results found for: {query}")
        parts = [f"Summary: {found['summary']}"] if found.get("summary") else []
        for i, h in enumerate(hits, 1):
            # Summaries are already short; raw passages and pages get the extractive cut.
            text = h.text if found.get("summary") else extractive(query, h.text,
                                                                  self.opts.snippet_chars)
            parts.append(f"[{i}] {h.title}\n{text}".strip())
        return truncate(clean("\n\n".join(parts)), self.opts.max_chars)

    def stats(self) -> dict:
        client = getattr(self.backend, "client", None)
        return {"calls": self.counts.calls, "errors": self.counts.errors,
                "failures": self.counts.failures,
                "attempts": getattr(client, "attempts", None),
                "cache_hits": self.cache.hits if self.cache else None}


def _health(found: dict, cached: bool) -> dict[str, int]:
    """A text search's health: empty, a cache hit, or the pages it read (a cached result
    fetched nothing this time)."""
    health = {"empty": 1} if not found["hits"] else {}
    if cached:
        return {**health, "cache_hits": 1}
    tried = [h.get("fetched") for h in found["hits"] if h.get("fetched") is not None]
    if tried:
        health.update(pages_fetched=len(tried), pages_ok=sum(tried))
    return health


def _decode(data: bytes, what: str) -> Image.Image:
    im = Image.open(BytesIO(data))
    if im.width * im.height > MAX_INPUT_PIXELS:
        raise ValueError(f"{what}: {im.width}x{im.height} pixels, too large")
    im.draft("RGB", (512, 512))
    return im.convert("RGB")


@TOOLS.register("image_search_tool")
class ImageSearchTool:
    name = "image_search_tool"
    schema: ClassVar[dict] = IMAGE_SCHEMA

    def __init__(self, spec: str = "data", **opts: Any) -> None:
        """`spec`: an image backend (`data`, `local:INDEX`, `serper-lens`); `opts`: the fields
        of `SearchOptions` (image_k, timeout, attempts, max_download_bytes, cache, ...)."""
        self.opts = SearchOptions.from_opts(**opts)
        self.backend = make_image_backend(spec, self.opts)
        self.downloads = self.opts.client()  # thumbnails: no API key on this client
        self.counts = _Counts()

    def __call__(self, args: dict[str, Any], ctx: ToolContext) -> ToolResult:
        self.counts.add("calls")
        try:
            hits = self.backend.find(ctx, self.opts.image_k)
        except NoInput as e:
            self.counts.add("errors")
            return error(str(e))
        except SearchError as e:
            self.counts.add("failures")
            return failure(e)
        if not hits:
            return ToolResult(text="No matching images were found.", health={"empty": 1})
        with ThreadPoolExecutor(min(8, len(hits))) as pool:
            thumbs = list(pool.map(self._thumbnail, hits))
        lines, images = ["Reverse image search results:"], []
        for i, (h, im) in enumerate(zip(hits, thumbs), 1):
            title = clean(" ".join(h.title.split()))[:TITLE_CHARS]
            if im is None:
                lines.append(f"[{i}] {title} (thumbnail unavailable)")
            else:
                lines.append(f"[{i}] {title} <image>")
                images.append(NewImage(im, {"title": h.title, "thumbnail": h.thumbnail}))
        health = {"cache_hits": 1} if all(h.cached for h in hits) else {}
        return ToolResult(text="\n".join(lines), images=images, health=health)

    def _thumbnail(self, hit: ImageHit) -> Image.Image | None:
        """The thumbnail's pixels (at most THUMB_MAX_PIXELS), or None if it cannot be had."""
        try:
            if hit.thumbnail.startswith(("http://", "https://")):
                data = self.downloads.get_bytes(hit.thumbnail,
                                                max_bytes=self.opts.max_download_bytes)
                im = _decode(data, hit.thumbnail)
            else:
                im = open_image(hit.thumbnail, max_pixels=THUMB_MAX_PIXELS, what="thumbnail")
        except (MarsError, OSError, ValueError, SyntaxError):
            return None
        if im.width * im.height > THUMB_MAX_PIXELS:
            h, w = fit_pixels(im.height, im.width, THUMB_MAX_PIXELS)
            im = im.resize((w, h), Image.BICUBIC)
        return im

    def stats(self) -> dict:
        client = getattr(self.backend, "client", None)
        return {"calls": self.counts.calls, "errors": self.counts.errors,
                "failures": self.counts.failures,
                "attempts": getattr(client, "attempts", None)}

    def endpoints(self) -> dict[str, str]:
        """The server this tool asks, redacted (eval's summary names it)."""
        spec, url = self.backend.spec, getattr(self.backend, "url", None)
        return {"image_search": redact(f"{spec} {url}" if url and url not in spec else spec)}


def query_text(query: str, spec: str, **opts: Any) -> ToolResult:
    """What `text_search_tool` returns for `query` (the `marscli search QUERY` command)."""
    return TextSearchTool(spec, **opts)({"query": query}, ToolContext(images=[]))


def query_image(image: str | None, spec: str, row: dict | None = None,
                **opts: Any) -> ToolResult:
    """What `image_search_tool` returns for an image file or public URL (`marscli search
    --image`); `row` stands in for the prompt row (the `data` backend reads it)."""
    row = dict(row or {})
    images: list[ConvImage] = []
    if image and image.startswith(("http://", "https://")):
        row.setdefault("image_url", image)
    elif image:
        im = open_image(image)
        images.append(ConvImage(image=im, ref={"path": str(Path(image))}, source=im))
    return ImageSearchTool(spec, **opts)({}, ToolContext(images=images, row=row))


def result_json(result: ToolResult) -> dict:
    return {"ok": result.ok, "text": result.text, "images": [n.meta for n in result.images]}


def load_row(spec: str) -> dict:
    """`ROWS.jsonl[:LINE]` → that row (default: the first), with `_base` set to its folder."""
    from marscli.errors import BadInput
    from marscli.records.jsonl import iter_rows

    path, _, line = spec.rpartition(":") if re.search(r":\d+$", spec) else (spec, "", "")
    want = int(line) if line else None
    for n, row in iter_rows(path):
        if want is None or n == want:
            return {**row, "_base": str(Path(path).resolve().parent)}
    raise BadInput(f"{spec}: no row at line {want}" if want else f"{path}: empty file")
