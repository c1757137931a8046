"""The one HTTP client every search backend uses: timeouts, bounded retries, a concurrency cap.

Retried (exponential backoff with full jitter): connection errors, timeouts, 429, 5xx and a
reply that is not JSON when JSON was expected — all things a second try can fix. Other 4xx are
the request's fault and fail at once. `attempts` counts every request sent, for sidecar stats.
Error messages pass through `redact`, so an API key echoed back by a server never leaks.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import orjson
import requests

from marscli.errors import RuntimeFailure
from marscli.jsonl import redact


class SearchError(RuntimeFailure):
    """A backend failed after its retries; the tools turn it into a `search failed:` observation."""


class TooLarge(SearchError):
    pass


# A private generator: jitter must not consume the global `random` state a stage has seeded.
_JITTER = random.Random()
_TRANSIENT = (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError)


def _retryable_status(code: int) -> bool:
    return code == 429 or code >= 500


class HttpClient:
    def __init__(self, *, timeout: float = 30.0, attempts: int = 3, backoff: float = 0.5,
                 concurrency: int = 32, headers: dict[str, str] | None = None) -> None:
        if attempts < 1:
            raise ValueError("attempts must be >= 1")
        self.timeout = timeout
        self.max_attempts = attempts
        self.backoff = backoff
        self.headers = headers or {}
        self._sem = threading.BoundedSemaphore(concurrency)
        self._local = threading.local()  # one Session per thread: Session is not thread-safe
        self._lock = threading.Lock()
        self.attempts = 0  # requests sent, all calls together
        self.failures = 0  # calls that gave up

    def _session(self) -> requests.Session:
        s = getattr(self._local, "session", None)
        if s is None:
            s = self._local.session = requests.Session()
        return s

    def _count(self, name: str) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + 1)

    def post_json(self, url: str, payload: dict, *, headers: dict[str, str] | None = None) -> Any:
        """POST JSON, return the parsed JSON reply; raise SearchError after the retries."""
        return self._request("POST", url, json=payload, headers=headers, want_json=True)

    def get_bytes(self, url: str, *, max_bytes: int, attempts: int | None = None) -> bytes:
        """GET a body of at most `max_bytes` (streamed, so a huge page costs nothing)."""
        return self._request("GET", url, max_bytes=max_bytes, attempts=attempts)

    def _request(self, method: str, url: str, *, json: dict | None = None,
                 headers: dict[str, str] | None = None, want_json: bool = False,
                 max_bytes: int | None = None, attempts: int | None = None) -> Any:
        n = attempts or self.max_attempts
        last = "no attempt made"
        for i in range(n):
            if i:
                time.sleep(_JITTER.uniform(0, self.backoff * 2 ** (i - 1)))
            self._count("attempts")
            try:
                with self._sem:
                    r = self._session().request(
                        method, url, json=json, headers={**self.headers, **(headers or {})},
                        timeout=self.timeout, stream=max_bytes is not None,
                        # a redirect would carry an API key header to another host
                        allow_redirects=method == "GET")
                    body = _read_limited(r, max_bytes) if max_bytes is not None else r.content
            except TooLarge as e:
                self._count("failures")
                raise TooLarge(redact(str(e))) from None
            except _TRANSIENT as e:
                last = f"{type(e).__name__}: {e}"
                continue
            except requests.RequestException as e:  # invalid URL and the like: not transient
                self._count("failures")
                raise SearchError(redact(f"{method} {url}: {type(e).__name__}: {e}")) from None
            if r.status_code >= 300:  # 3xx: a POST redirect we chose not to follow
                last = f"HTTP {r.status_code}: {body[:200].decode('utf-8', 'replace')}"
                if _retryable_status(r.status_code):
                    continue
                break
            if not want_json:
                return body
            try:
                return orjson.loads(body)
            except orjson.JSONDecodeError:
                last = f"malformed JSON reply: {body[:100].decode('utf-8', 'replace')!r}"
                continue
        self._count("failures")
        raise SearchError(redact(f"{method} {url}: {last} (after {i + 1} attempt"
                                 f"{'s' if i else ''})"))


def _read_limited(r: requests.Response, max_bytes: int) -> bytes:
    declared = r.headers.get("Content-Length")
    if declared and declared.isdigit() and int(declared) > max_bytes:
        r.close()
        raise TooLarge(f"{r.url}: {declared} bytes, over the {max_bytes:,} byte limit")
    chunks, size = [], 0
    for chunk in r.iter_content(64 * 1024):
        size += len(chunk)
        if size > max_bytes:
            r.close()
            raise TooLarge(f"{r.url}: over the {max_bytes:,} byte limit")
        chunks.append(chunk)
    return b"".join(chunks)
