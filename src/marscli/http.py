"""The one HTTP client marscli talks to servers with: the openai engine, the judge and the
search backends (retriever, Serper, Lens, the summariser, page and thumbnail downloads).

It owns, so that no caller repeats them:
- a timeout per attempt, and at most `concurrency` requests in flight (one Session per thread);
- bounded retries, `attempts` in all. Retried: connection errors, timeouts, HTTP 429 and 5xx,
  and a reply that parses badly — not JSON, or JSON the caller's `validate` rejects (it raises
  KeyError, IndexError, TypeError or ValueError). Other 4xx, local errors (a bad URL), a reply
  over `max_bytes` and a redirect of a POST (never followed: it would carry an API key header to
  another host) fail at once;
- the wait before retry k: a 429/5xx's `Retry-After`, up to a minute, else
  min(30 s, backoff * 2^(k-1)) * (floor + U[0, 1)) — full jitter at floor 0 — drawn from a
  private generator, so that no stage's seeded `random` is consumed;
- typed failures: the caller's `error` class (an `HttpError`), whose message is
  `METHOD URL: reason (after N attempts)`, with `reason`, `attempts` and `transient` (the
  attempts ran out, rather than a request that retrying cannot fix) for callers that say it
  their own way;
- secrets: every message goes through `redact` and loses the credentials this client sent (the
  token of an Authorization or X-API-KEY header), so that a server echoing a key back never
  puts it in a record;
- counts for the sidecars: `attempts` (requests sent) and `failures` (calls that gave up).

A small loop rather than urllib3's `Retry` on a requests adapter: `Retry` cannot retry a 200
whose body does not parse (the judge's and the engine's commonest fault), its schedule is not
this one (no wait before the first retry, additive jitter), and it hides the attempts that the
sidecars count and the tests bound.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

import orjson
import requests

from marscli.errors import RuntimeFailure
from marscli.secrets import redact

MAX_BACKOFF_S = 30.0
MAX_RETRY_AFTER_S = 60.0
SNIPPET = 200  # characters of a failing reply quoted in the message
_JITTER = random.Random()
_MALFORMED = (KeyError, IndexError, TypeError, ValueError)
_CREDENTIALS = ("authorization", "x-api-key")


class HttpError(RuntimeFailure):
    """A request failed for good (see the module docstring for `reason`, `attempts`,
    `transient`)."""

    def __init__(self, message: str, reason: str = "", attempts: int = 0,
                 transient: bool = False) -> None:
        super().__init__(message)
        self.reason, self.attempts, self.transient = reason or message, attempts, transient


class _Failed(Exception):
    """One attempt failed; `transient`: another may succeed; `wait`: the server's Retry-After."""

    def __init__(self, reason: str, transient: bool, wait: float | None = None) -> None:
        super().__init__(reason)
        self.transient, self.wait = transient, wait


class HttpClient:
    def __init__(self, *, timeout: float = 30.0, attempts: int = 3, backoff: float = 0.5,
                 backoff_floor: float = 0.0, concurrency: int = 32,
                 headers: dict[str, str] | None = None, error: type[HttpError] = HttpError,
                 auth_hint: str = "") -> None:
        """`headers` go with every request; `auth_hint` is added to a 401/403's reason."""
        if attempts < 1:
            raise ValueError("attempts must be >= 1")
        self.timeout, self.max_attempts = timeout, attempts
        self.backoff, self.backoff_floor = backoff, backoff_floor
        self.headers, self.error, self.auth_hint = headers or {}, error, auth_hint
        self._sem = threading.BoundedSemaphore(concurrency)
        self._local = threading.local()  # one Session per thread: Session is not thread-safe
        self._lock = threading.Lock()
        self.attempts = 0  # requests sent, all calls together
        self.failures = 0  # calls that gave up

    def post_json(self, url: str, payload: Any, *, headers: dict[str, str] | None = None,
                  validate: Callable[[Any], Any] | None = None) -> Any:
        """POST JSON (`payload` as requests encodes it, or bytes already encoded); the parsed
        reply, or what `validate` makes of it."""
        return self._request("POST", url, payload=payload, validate=validate,
                             headers={"Content-Type": "application/json", **(headers or {})})

    def get_bytes(self, url: str, *, max_bytes: int, attempts: int | None = None) -> bytes:
        """GET a body of at most `max_bytes` (streamed, so a huge page costs nothing)."""
        return self._request("GET", url, max_bytes=max_bytes, attempts=attempts)

    def scrub(self, msg: str, headers: dict[str, str] | None = None) -> str:
        """`msg` without any known API key or any credential this client sends."""
        msg = redact(msg)
        for name, value in {**self.headers, **(headers or {})}.items():
            token = value.rpartition(" ")[2] if name.lower() in _CREDENTIALS else ""
            msg = msg.replace(token, "<redacted>") if token else msg
        return msg

    def _request(self, method: str, url: str, *, payload: Any = None,
                 headers: dict[str, str] | None = None, validate: Callable | None = None,
                 max_bytes: int | None = None, attempts: int | None = None) -> Any:
        headers = {**self.headers, **(headers or {})}
        failed = _Failed("no attempt made", False)
        for i in range(attempts or self.max_attempts):
            if i:
                time.sleep(self._wait(i, failed.wait))
            self._count("attempts")
            try:
                return self._attempt(method, url, payload, headers, validate, max_bytes)
            except _Failed as e:
                failed = e
                if not e.transient:
                    break
        self._count("failures")
        reason = self.scrub(str(failed), headers)
        raise self.error(self.scrub(f"{method} {url}: {reason} (after {i + 1} attempt"
                                    f"{'s' if i else ''})", headers),
                         reason, i + 1, failed.transient)

    def _wait(self, i: int, retry_after: float | None) -> float:
        if retry_after:
            return min(MAX_RETRY_AFTER_S, retry_after)
        step = min(MAX_BACKOFF_S, self.backoff * 2 ** (i - 1))
        return step * (self.backoff_floor + _JITTER.random())

    def _attempt(self, method: str, url: str, payload: Any, headers: dict[str, str],
                 validate: Callable | None, max_bytes: int | None) -> Any:
        raw = isinstance(payload, bytes)
        try:
            with self._sem:
                r = self._session().request(
                    method, url, data=payload if raw else None, json=None if raw else payload,
                    headers=headers, timeout=self.timeout, stream=max_bytes is not None,
                    allow_redirects=method == "GET")
                body = r.content if max_bytes is None else _read_limited(r, max_bytes)
        except requests.Timeout as e:
            raise _Failed(f"timed out after {self.timeout:g} s ({type(e).__name__})",
                          True) from None
        except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError) as e:
            raise _Failed(f"connection failed ({type(e).__name__})", True) from None
        except requests.RequestException as e:
            raise _Failed(f"{type(e).__name__}: {e}", False) from None
        if r.status_code >= 300:  # 3xx: a POST redirect not followed
            code, text = r.status_code, _snippet(body)
            transient = code == 429 or code >= 500
            hint = f" — {self.auth_hint}" if self.auth_hint and code in (401, 403) else ""
            raise _Failed(f"HTTP {code}{': ' + text if text else ''}{hint}", transient,
                          _retry_after(r) if transient else None)
        if method == "GET":
            return body
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError:
            raise _Failed(f"malformed JSON reply: {_snippet(body)!r}", True) from None
        try:
            return data if validate is None else validate(data)
        except _MALFORMED as e:
            raise _Failed(f"malformed reply ({type(e).__name__}: {e}): {_snippet(body)!r}",
                          True) from None

    def _session(self) -> requests.Session:
        s = getattr(self._local, "session", None)
        if s is None:
            s = self._local.session = requests.Session()
        return s

    def _count(self, name: str) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + 1)


def _snippet(body: bytes) -> str:
    return body[:SNIPPET].decode("utf-8", "replace")


def _retry_after(r: requests.Response) -> float | None:
    try:
        return max(0.0, float(r.headers.get("Retry-After", "")))
    except ValueError:
        return None


def _read_limited(r: requests.Response, max_bytes: int) -> bytes:
    declared = r.headers.get("Content-Length")
    if declared and declared.isdigit() and int(declared) > max_bytes:
        r.close()
        raise _Failed(f"{declared} bytes, over the {max_bytes:,} byte limit", False)
    chunks, size = [], 0
    for chunk in r.iter_content(64 * 1024):
        size += len(chunk)
        if size > max_bytes:
            r.close()
            raise _Failed(f"over the {max_bytes:,} byte limit", False)
        chunks.append(chunk)
    return b"".join(chunks)
