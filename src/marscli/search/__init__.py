"""Search backends for the agent's `text_search_tool` and `image_search_tool`.

A backend is chosen by one spec string, `NAME` or `NAME:ARG` (split at the first colon, so
URLs survive):

  text   local:INDEX.sqlite   SQLite FTS5 / BM25 over a corpus built by `marscli index text`
         retriever:URL        a Search-R1 retrieval server (POST URL[/retrieve])
         serper               Google through serper.dev (env SERPER_API_KEY)
  image  data                 the prompt row's precomputed results (default, as MARS trains)
         local:INDEX.sqlite   perceptual-hash neighbours, built by `marscli index images`
         serper-lens          Google Lens through serper.dev, for rows with an `image_url`

Every factory has one signature, `(arg: str | None, opts: SearchOptions) -> backend`. Text
backends have `search(query, k) -> list[Hit]`; image backends `find(ctx, k) -> list[ImageHit]`.
Both raise `SearchError` (`search.errors`) when the world fails and `BadInput` when the spec
or the environment is wrong, which `check_text_spec` / `check_image_spec` surface before a run.

Remote backends talk through `marscli.http`: `timeout` is a total per request, replies are
capped (`max_reply_bytes` for JSON APIs, `max_download_bytes` for pages and thumbnails), and
credentials in a URL (`retriever:http://user:PW@host`) travel as Basic auth, redacted from every
message, observation and cache key.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Protocol

from marscli.errors import BadInput
from marscli.registry import Registry


@dataclass
class Hit:
    title: str
    text: str  # snippet, page text or page summary
    url: str | None = None
    score: float | None = None
    fetched: bool | None = None  # its page: None not tried, True read, False unreadable


@dataclass
class ImageHit:
    title: str
    thumbnail: str  # absolute path or URL
    cached: bool = False  # from stored results (the row's, or the search cache), not live


class NoInput(Exception):
    """The conversation or prompt row lacks what an image backend searches with (no image, no
    `image_url`): the tool answers with an error observation."""


@dataclass
class SearchOptions:
    """Options shared by both search tools (`build_tools` passes the same ones to each)."""

    k: int = 5  # text results per query
    image_k: int = 5  # reverse-image results (the paper shows up to 5)
    max_chars: int = 8192  # tool text truncation
    snippet_chars: int = 600  # extractive summary: characters kept per result
    cache: str | None = "auto"  # folder, "auto" ($MARSCLI_CACHE_DIR or ~/.cache/marscli), None: off
    timeout: float = 30.0
    attempts: int = 3  # requests per call, all together
    backoff: float = 0.5  # seconds; doubles per retry, with full jitter
    concurrency: int = 32  # in-flight requests per backend
    fetch_pages: bool = False  # serper: fetch and read the top-k pages
    summarizer: str | None = None  # OpenAI-compatible base URL
    summarizer_model: str | None = None
    max_download_bytes: int = 5_000_000  # per fetched page or thumbnail
    max_reply_bytes: int = 8 * 2**20  # per JSON API reply (marscli.http.MAX_JSON_BYTES)

    @classmethod
    def from_opts(cls, **opts: Any) -> SearchOptions:
        valid = {f.name for f in fields(cls)}
        unknown = sorted(set(opts) - valid)
        if unknown:
            raise BadInput(f"unknown search option {unknown[0]!r} — choose from: "
                           f"{', '.join(sorted(valid))}")
        o = cls(**opts)
        for name in ("k", "image_k", "max_chars", "attempts", "concurrency",
                     "max_download_bytes", "max_reply_bytes"):
            if getattr(o, name) < 1:
                raise BadInput(f"search option {name}: {getattr(o, name)} — must be >= 1")
        if o.summarizer and not o.summarizer_model:
            raise BadInput("summarizer is set but summarizer_model is not — name the model the "
                           "endpoint serves (e.g. --summarizer-model qwen3-32b)")
        return o

    def cache_dir(self) -> Path | None:
        if self.cache is None:
            return None
        if self.cache == "auto":
            env = os.environ.get("MARSCLI_CACHE_DIR")
            return Path(env) if env else Path.home() / ".cache" / "marscli"
        return Path(self.cache)

    def client(self, **kw: Any):
        """The retrying client (`marscli.http`) a backend talks through: `timeout` a total per
        attempt, JSON replies capped at `max_reply_bytes`; it fails with `SearchError`."""
        from marscli.http import HttpClient
        from marscli.search.errors import SearchError

        return HttpClient(timeout=self.timeout, attempts=self.attempts, backoff=self.backoff,
                          concurrency=self.concurrency, error=SearchError,
                          max_bytes=self.max_reply_bytes, **kw)


class TextBackend(Protocol):
    spec: str
    cacheable: bool  # remote results are worth caching; a local index is faster than the cache

    def search(self, query: str, k: int) -> list[Hit]: ...


class ImageBackend(Protocol):
    spec: str

    def find(self, ctx: Any, k: int) -> list[ImageHit]: ...


# Each backend's module registers it when first looked up, so `import marscli.search` stays
# cheap (and the backends, which import this module, are not imported by it).
TEXT_BACKENDS: Registry[Callable[[str | None, SearchOptions], TextBackend]] = Registry(
    "text search backend", lazy={"local": "marscli.search.text_index",
                                 "retriever": "marscli.search.remote",
                                 "serper": "marscli.search.remote"})
IMAGE_BACKENDS: Registry[Callable[[str | None, SearchOptions], ImageBackend]] = Registry(
    "image search backend", lazy={"data": "marscli.search.image_data",
                                  "local": "marscli.search.image_index",
                                  "serper-lens": "marscli.search.remote"})


def parse_spec(spec: str) -> tuple[str, str | None]:
    name, sep, arg = spec.partition(":")
    return name.strip(), (arg if sep else None)


def make_text_backend(spec: str, opts: SearchOptions | None = None) -> TextBackend:
    name, arg = parse_spec(spec)
    return TEXT_BACKENDS.get(name)(arg, opts or SearchOptions())


def make_image_backend(spec: str, opts: SearchOptions | None = None) -> ImageBackend:
    name, arg = parse_spec(spec)
    return IMAGE_BACKENDS.get(name)(arg, opts or SearchOptions())


def check_text_spec(spec: str, **opts: Any) -> None:
    """Raise BadInput (listing the valid backends) unless `spec` builds a usable text backend:
    the index exists, the URL parses, the API key is set. Sends no request."""
    make_text_backend(spec, SearchOptions.from_opts(**opts))


def check_image_spec(spec: str, **opts: Any) -> None:
    """Same as `check_text_spec`, for `--image-search`."""
    make_image_backend(spec, SearchOptions.from_opts(**opts))


def need_arg(name: str, arg: str | None, what: str) -> str:
    if not arg:
        raise BadInput(f"search backend {name!r} needs {what}: write {name}:{what.upper()}")
    return arg


def no_arg(name: str, arg: str | None) -> None:
    if arg:
        from marscli.secrets import redact

        raise BadInput(f"search backend {name!r} takes no argument, got {redact(f'{name}:{arg}')}")
