"""The one HTTP client marscli talks to servers with: the openai engine, the judge and the
search backends (retriever, Serper, Lens, the summariser, page and thumbnail downloads).

It owns, so that no caller repeats them:
- a total deadline per attempt, `timeout` seconds from the moment a request slot is free to the
  last byte of the body (connect and headers are bounded by what is left of it, and before each
  read of the body the socket's timeout is set to what is left, so a server trickling one byte
  every half second is cut off at the deadline, not after `timeout` per byte); at most
  `concurrency` requests in flight (one Session per thread). Not bounded in total: a server
  trickling its status line and headers (each read then waits at most `timeout`). Optional:
  `connect_timeout`, a connect bounded apart (a host that is down is known in seconds while
  a reply may take minutes), and `total`, a bound on a whole call, its retries and waits
  included (no retry starts that its wait would push past it; each attempt gets what is left);
- a byte cap on every reply body, `max_bytes` per client (default `MAX_JSON_BYTES`, 8 MiB: far
  above any chat completion or search reply) or per call (downloads): the body is streamed
  and the request fails past the cap (or at once when Content-Length says so), decompressed
  bytes counted, so a 300 MB reply never costs more than the cap. Redirects (GET only, at most
  `MAX_REDIRECTS`) are followed here, so their bodies are never read at all;
- bounded retries, `attempts` in all. Retried: connection errors, timeouts, HTTP 429 and 5xx,
  and a reply that parses badly — not JSON, or JSON the caller's `validate` rejects (it raises
  KeyError, IndexError, TypeError or ValueError). Other 4xx, local errors (a bad URL), a reply
  over the byte cap (it would be too big again) and a redirect of a POST (never followed: it
  would carry an API key header to another host) fail at once;
- the wait before retry k: a 429/5xx's `Retry-After`, up to a minute, else
  min(30 s, backoff * 2^(k-1)) * (floor + U[0, 1)) — full jitter at floor 0 — drawn from a
  private generator, so that no stage's seeded `random` is consumed; `on_retry(reason, k,
  attempts, elapsed)` before it (a progress line); `retry_refused=False`: a refused connect
  (nothing listens at that port) fails at once;
- typed failures: the caller's `error` class (an `HttpError`), whose message is
  `METHOD URL: reason (after N attempts)`, with `reason`, `attempts`, `transient` (the
  attempts ran out, rather than a request that retrying cannot fix) and `timed_out` (the last
  attempt ran out of time: the health counts tell timeouts from other backend errors) for
  callers that say it their own way;
- secrets: a URL's userinfo (`http://user:PW@host/`) is sent as Basic auth and never kept in
  the URL; every message goes through `redact` (URL userinfo, secret query parameters, known
  keys) and loses the credentials this client sent (the token of an Authorization or X-API-KEY
  header, the password and Basic token of a userinfo), so that a server echoing them back
  never puts them in a record;
- counts for the sidecars: `attempts` (requests sent) and `failures` (calls that gave up);
  and per thread, `last_attempts()`: the requests the thread's last call sent (the judge
  records its retries per verdict).

A small loop rather than urllib3's `Retry` on a requests adapter: `Retry` cannot retry a 200
whose body does not parse (the judge's and the engine's commonest fault), its schedule is not
this one (no wait before the first retry, additive jitter), and it hides the attempts that the
sidecars count and the tests bound.
"""

from __future__ import annotations

import base64
import random
import threading
import time
from collections.abc import Callable
from time import monotonic
from typing import Any
from urllib.parse import urljoin, urlsplit

import orjson
import requests
import urllib3.exceptions

from marscli.errors import RuntimeFailure
from marscli.secrets import REDACTED, redact, split_userinfo

MAX_BACKOFF_S = 30.0
MAX_RETRY_AFTER_S = 60.0
MAX_JSON_BYTES = 8 * 2**20  # per reply of a JSON API: chat completions are ~100 KB
MAX_REDIRECTS = 5
# The bounds of a caller's options, so that a typo is refused: far above any real setting.
MAX_RETRIES = 100  # --search-retries, --judge-retries
MAX_TIMEOUT = 86_400.0  # seconds: --search-timeout, --judge-timeout
CHUNK = 64 * 1024
SNIPPET = 200  # characters of a failing reply quoted in the message
_JITTER = random.Random()
_MALFORMED = (KeyError, IndexError, TypeError, ValueError)
_CREDENTIALS = ("authorization", "x-api-key")
_TIMEOUTS = (requests.Timeout, urllib3.exceptions.TimeoutError, TimeoutError)
_BROKEN = (requests.ConnectionError, requests.exceptions.ChunkedEncodingError,
           urllib3.exceptions.HTTPError, OSError)


class HttpError(RuntimeFailure):
    """A request failed for good (see the module docstring for `reason`, `attempts`,
    `transient`)."""

    def __init__(self, message: str, reason: str = "", attempts: int = 0,
                 transient: bool = False, timed_out: bool = False) -> None:
        super().__init__(message)
        self.reason, self.attempts, self.transient = reason or message, attempts, transient
        self.timed_out = timed_out


class _Failed(Exception):
    """One attempt failed; `transient`: another may succeed; `wait`: the server's Retry-After;
    `timed_out`: the deadline cut it."""

    def __init__(self, reason: str, transient: bool, wait: float | None = None,
                 timed_out: bool = False) -> None:
        super().__init__(reason)
        self.transient, self.wait, self.timed_out = transient, wait, timed_out


class HttpClient:
    def __init__(self, *, timeout: float = 30.0, attempts: int = 3, backoff: float = 0.5,
                 backoff_floor: float = 0.0, concurrency: int = 32,
                 headers: dict[str, str] | None = None, error: type[HttpError] = HttpError,
                 auth_hint: str = "", max_bytes: int = MAX_JSON_BYTES,
                 connect_timeout: float | None = None, total: float | None = None,
                 retry_refused: bool = True,
                 on_retry: Callable[[str, int, int, float], None] | None = None) -> None:
        """`headers` go with every request; `auth_hint` is added to a 401/403's reason;
        `timeout` is the total per attempt, `total` per call (None: unbounded); `max_bytes`
        caps every reply body."""
        if attempts < 1:
            raise ValueError("attempts must be >= 1")
        if max_bytes < 1:
            raise ValueError("max_bytes must be >= 1")
        self.timeout, self.max_attempts, self.max_bytes = timeout, attempts, max_bytes
        self.backoff, self.backoff_floor = backoff, backoff_floor
        self.connect_timeout, self.total, self.retry_refused = connect_timeout, total, retry_refused
        self.on_retry = on_retry
        self.headers, self.error, self.auth_hint = headers or {}, error, auth_hint
        self._sem = threading.BoundedSemaphore(concurrency)
        self._local = threading.local()  # one Session per thread: Session is not thread-safe
        self._lock = threading.Lock()
        self.attempts = 0  # requests sent, all calls together
        self.failures = 0  # calls that gave up

    def post_json(self, url: str, payload: Any, *, headers: dict[str, str] | None = None,
                  validate: Callable[[Any], Any] | None = None,
                  max_bytes: int | None = None) -> Any:
        """POST JSON (`payload` as requests encodes it, or bytes already encoded); the parsed
        reply, or what `validate` makes of it."""
        return self._request("POST", url, payload=payload, validate=validate,
                             max_bytes=max_bytes,
                             headers={"Content-Type": "application/json", **(headers or {})})

    def get_bytes(self, url: str, *, max_bytes: int, attempts: int | None = None) -> bytes:
        """GET a body of at most `max_bytes` (streamed, so a huge page costs nothing)."""
        return self._request("GET", url, max_bytes=max_bytes, attempts=attempts)

    def scrub(self, msg: str, headers: dict[str, str] | None = None, url: str = "") -> str:
        """`msg` without any known API key or any credential this client sends (headers, and
        the userinfo of `url`)."""
        msg = redact(msg)
        for token in _sent_secrets({**self.headers, **(headers or {})}, url):
            msg = msg.replace(token, REDACTED)
        return msg

    def _request(self, method: str, url: str, *, payload: Any = None,
                 headers: dict[str, str] | None = None, validate: Callable | None = None,
                 max_bytes: int | None = None, attempts: int | None = None) -> Any:
        headers = {**self.headers, **(headers or {})}
        failed = _Failed("no attempt made", False)
        start, n = monotonic(), attempts or self.max_attempts
        end = start + self.total if self.total is not None else None
        for i in range(n):
            if i:
                wait = self._wait(i, failed.wait)
                if end is not None and monotonic() + wait >= end:
                    i -= 1  # the call's time is spent: no attempt i + 1
                    break
                if self.on_retry:
                    self.on_retry(self.scrub(str(failed), headers, url), i, n, monotonic() - start)
                time.sleep(wait)
            self._count("attempts")
            self._local.last_attempts = i + 1
            try:
                return self._attempt(method, url, payload, headers, validate,
                                     max_bytes or self.max_bytes, end)
            except _Failed as e:
                failed = e
                if not e.transient:
                    break
        self._count("failures")
        reason = self.scrub(str(failed), headers, url)
        raise self.error(self.scrub(f"{method} {url}: {reason} (after {i + 1} attempt"
                                    f"{'s' if i else ''})", headers, url),
                         reason, i + 1, failed.transient, timed_out=failed.timed_out)

    def last_attempts(self) -> int:
        """The requests this thread's last call sent (0 before its first call)."""
        return getattr(self._local, "last_attempts", 0)

    def _wait(self, i: int, retry_after: float | None) -> float:
        if retry_after:
            return min(MAX_RETRY_AFTER_S, retry_after)
        step = min(MAX_BACKOFF_S, self.backoff * 2 ** (i - 1))
        return step * (self.backoff_floor + _JITTER.random())

    def _attempt(self, method: str, url: str, payload: Any, headers: dict[str, str],
                 validate: Callable | None, max_bytes: int, end: float | None) -> Any:
        with self._sem:  # the deadline starts once a slot is ours: queueing is not the server's
            began = monotonic()
            deadline = min(began + self.timeout, end if end is not None else float("inf"))
            try:
                r = self._send(method, url, payload, headers, deadline)
                body = _read_body(r, max_bytes, deadline)
            except _TIMEOUTS as e:
                raise self._timed_out(e, deadline - began) from None
            except _BROKEN as e:
                if monotonic() >= deadline:  # the deadline cut a read short
                    raise self._timed_out(e, deadline - began) from None
                if not self.retry_refused and _refused(e):
                    raise _Failed("connection failed (refused: nothing listens at that port "
                                  "— is the server running?)", False) from None
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
        return _parse(body, validate)

    def _timed_out(self, e: BaseException, seconds: float) -> _Failed:
        return _Failed(f"timed out after {round(seconds, 1):g} s in all ({type(e).__name__})", True,
                       timed_out=True)

    def _send(self, method: str, url: str, payload: Any, headers: dict[str, str],
              deadline: float) -> requests.Response:
        """The response with its headers read and its body not; GET redirects followed here,
        so that no redirect's body is read, and credentials never go to another host."""
        raw = isinstance(payload, bytes)
        for _ in range(MAX_REDIRECTS + 1):
            left = max(0.001, deadline - monotonic())
            connect = min(left, self.connect_timeout) if self.connect_timeout else left
            plain, auth = split_userinfo(url)
            r = self._session().request(
                method, plain, data=payload if raw else None, json=None if raw else payload,
                headers=headers, auth=auth, timeout=(connect, left), stream=True,
                allow_redirects=False)
            if method != "GET" or not r.is_redirect:
                return r
            url = urljoin(plain, r.headers["Location"])
            r.close()
            if urlsplit(url).netloc != urlsplit(plain).netloc:
                headers = {k: v for k, v in headers.items() if k.lower() not in _CREDENTIALS}
        raise _Failed(f"more than {MAX_REDIRECTS} redirects", False)

    def _session(self) -> requests.Session:
        s = getattr(self._local, "session", None)
        if s is None:
            s = self._local.session = _Session()
        return s

    def _count(self, name: str) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + 1)


class _Session(requests.Session):
    """A Session that leaves a 3xx reply's body unread: even with `allow_redirects=False`,
    requests reads it whole (to prepare `Response.next`), however big or slow it is.
    `HttpClient._send` follows redirects itself."""

    def resolve_redirects(self, resp: Any, req: Any, **kwargs: Any) -> Any:
        yield None


def _refused(e: BaseException | None) -> bool:
    """Whether a connection error comes from a refused connect (ECONNREFUSED), however deep
    requests and urllib3 wrap it."""
    for _ in range(8):  # requests -> urllib3 MaxRetryError -> NewConnectionError -> OSError
        if e is None or isinstance(e, ConnectionRefusedError):
            return e is not None
        reason = getattr(e, "reason", None)
        e = reason if isinstance(reason, BaseException) else \
            e.args[0] if e.args and isinstance(e.args[0], BaseException) else e.__cause__
    return False


def _sent_secrets(headers: dict[str, str], url: str) -> list[str]:
    """What this request sends that must never be shown: header tokens, the userinfo's
    password and its Basic token."""
    out = [v.rpartition(" ")[2] for k, v in headers.items() if k.lower() in _CREDENTIALS]
    _, auth = split_userinfo(url)
    if auth:
        user, password = auth
        out.append(base64.b64encode(f"{user}:{password}".encode()).decode())
        out.append(password if len(password) >= 4 else "")  # a 1-letter one would maul text
    return [t for t in out if t]


def _read_body(r: requests.Response, max_bytes: int, deadline: float) -> bytes:
    """The body, decompressed, of at most `max_bytes`, read before `deadline`: each read waits
    at most what is left (the socket's timeout is set before it)."""
    ok = False
    try:
        declared = r.headers.get("Content-Length", "")
        if declared.isdigit() and int(declared) > max_bytes:
            raise _Failed(f"a {int(declared):,} byte reply, over the {max_bytes:,} byte limit",
                          False)
        sock = getattr(getattr(r.raw, "connection", None), "sock", None)
        before = sock.gettimeout() if sock is not None else None
        chunks, size = [], 0
        while True:
            left = deadline - monotonic()
            if left <= 0:
                raise TimeoutError("deadline passed while reading the body")
            if sock is not None:
                sock.settimeout(left)
            chunk = r.raw.read1(CHUNK, decode_content=True)
            if not chunk:
                break
            size += len(chunk)
            if size > max_bytes:
                raise _Failed(f"over the {max_bytes:,} byte limit", False)
            chunks.append(chunk)
        if sock is not None:
            sock.settimeout(before)  # a kept-alive connection sends its next request unhurried
        ok = True
        return b"".join(chunks)
    finally:
        if ok:
            r.raw.release_conn()
        else:
            r.close()


def _parse(body: bytes, validate: Callable | None) -> Any:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise _Failed(f"malformed JSON reply: {_snippet(body)!r}", True) from None
    try:
        return data if validate is None else validate(data)
    except _MALFORMED as e:
        raise _Failed(f"malformed reply ({type(e).__name__}: {e}): {_snippet(body)!r}",
                      True) from None


def _snippet(body: bytes) -> str:
    return body[:SNIPPET].decode("utf-8", "replace")


def _retry_after(r: requests.Response) -> float | None:
    try:
        return max(0.0, float(r.headers.get("Retry-After", "")))
    except ValueError:
        return None
