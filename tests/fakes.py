"""One scriptable fake HTTP server on 127.0.0.1 for the tests of everything marscli talks to
(the openai engine, the judge, the search backends, downloads), and the helpers that script it.

`FakeServer(routes)` serves GET and POST from a daemon thread (a context manager, or `close()`).
`routes` maps path suffixes to scripts (the first suffix that the path, query string dropped,
ends with), or is one script for every path; `on(path, *replies)` sets a route. A script is a
callable `(path, body, attempt) -> (status, body[, delay[, headers]])`: the request body parsed
as JSON (None when empty, the raw bytes when not JSON); `attempt` counts from 1 per distinct
(path, request body); a reply body is bytes, text, a JSON-able object, or a hostile stream:
`Trickle(data, every)` (a few bytes at a time, seconds apart) or `Huge(size)` (`size` bytes
written in chunks, never held in memory; with `declare=False`, no Content-Length). Inside a script,
`current()` is the request being answered (path, body, headers, digest, attempt).

The server records every request in `log` (dicts as `current()`, with `client`, the client's
(host, port): one port for requests that shared a connection), attempts in `attempts`
((path, digest) -> n), and the most requests it answered at once in `max_in_flight`. The digest
(a SHA-256 of the body) leaves this server's port out: a failure's text, which names it, can
travel back in a later request, and runs should repeat what they send.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

Reply = tuple  # (status, body[, delay[, headers]])
Script = Callable[[str, Any, int], Reply]
_local = threading.local()


@dataclass
class Trickle:
    """A reply body sent `step` bytes at a time, `every` seconds apart (Content-Length true)."""

    data: bytes
    every: float = 0.5
    step: int = 1

    def chunks(self):
        for i in range(0, len(self.data), self.step):
            if i:
                time.sleep(self.every)
            yield self.data[i:i + self.step]


@dataclass
class Huge:
    """A reply body of `size` bytes of `fill`, written 1 MiB at a time."""

    size: int
    fill: bytes = b" "
    declare: bool = True  # send Content-Length; False: the body ends when the server hangs up

    def chunks(self):
        block = (self.fill * (2**20 // len(self.fill) + 1))[:2**20]
        for i in range(0, self.size, len(block)):
            yield block[:min(len(block), self.size - i)]


def current() -> dict:
    """In a script: the request being answered."""
    return _local.request


def always(status: int, body: Any = "", delay: float = 0.0, headers: dict | None = None) -> Script:
    return lambda path, req, attempt: (status, body, delay, headers)


def sequence(*replies: Any) -> Script:
    """The i-th reply to the i-th request of this route (the last one repeats); a reply is a
    tuple as a script returns, or a JSON-able object for a 200."""
    calls = itertools.count()  # next() is atomic: safe across handler threads

    def script(path: str, body: Any, attempt: int) -> Reply:
        r = replies[min(next(calls), len(replies) - 1)]
        return r if isinstance(r, tuple) else (200, r)

    return script


def chat_reply(content: str, finish: str = "stop", usage: tuple[int, int] = (50, 12),
               **message: Any) -> dict:
    """An OpenAI chat-completions reply; `message` adds fields (e.g. `reasoning_content`)."""
    return {"id": "fake", "object": "chat.completion",
            "choices": [{"index": 0, "finish_reason": finish,
                         "message": {"role": "assistant", "content": content, **message}}],
            "usage": {"prompt_tokens": usage[0], "completion_tokens": usage[1]}}


def retrieve_reply(*docs: str | tuple[str, str]) -> dict:
    """A Search-R1 /retrieve reply; a doc is (title, text), or a title ("TITLE is a thing.")."""
    docs = tuple(d if isinstance(d, tuple) else (d, f"{d} is a thing.") for d in docs)
    return {"result": [[{"document": {"contents": f'"{title}"\n{text}'}, "score": 1.0 / (i + 1)}
                        for i, (title, text) in enumerate(docs)]]}


def serper_reply(*hits: tuple[str, str, str]) -> dict:
    """A serper.dev /search reply of (title, link, snippet) hits."""
    return {"organic": [{"title": t, "link": link, "snippet": s} for t, link, s in hits]}


class _Handler(BaseHTTPRequestHandler):
    def _serve(self) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.fake.serve(self, self.path.partition("?")[0], raw)

    do_GET = do_POST = _serve

    def log_message(self, *args) -> None:  # keep pytest output clean
        pass


class _Handler11(_Handler):
    protocol_version = "HTTP/1.1"


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # the default backlog (5) refuses connections under a burst


class FakeServer:
    def __init__(self, routes: Script | dict[str, Script] | None = None, *,
                 keep_alive: bool = False) -> None:
        """`keep_alive`: speak HTTP/1.1, so a client may send several requests on one
        connection (the default, HTTP/1.0, closes it after each reply)."""
        self.routes = dict(routes or {}) if not callable(routes) else {"": routes}
        self.log: list[dict] = []
        self.attempts: Counter = Counter()
        self.in_flight = self.max_in_flight = 0
        self.lock = threading.Lock()
        handler = _Handler11 if keep_alive else _Handler
        self.httpd = _Server(("127.0.0.1", 0), handler)
        self.httpd.fake = self
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        self._port = str(self.httpd.server_port).encode()
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def on(self, path: str, *replies: Any) -> None:
        self.routes[path] = sequence(*replies)

    def serve(self, handler: BaseHTTPRequestHandler, path: str, raw: bytes) -> None:
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw
        digest = hashlib.sha256(raw.replace(self._port, b"PORT")).hexdigest()
        with self.lock:
            self.attempts[(path, digest)] += 1
            req = _local.request = {"path": path, "body": body, "headers": dict(handler.headers),
                                    "digest": digest, "attempt": self.attempts[(path, digest)],
                                    "client": handler.client_address}
            self.log.append(req)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            script = next((s for p, s in self.routes.items() if path.endswith(p)),
                          always(404, {"error": "no such path"}))
            status, data, delay, headers = (*script(path, body, req["attempt"]), None, None)[:4]
            if isinstance(data, str):
                data = data.encode()
            elif not isinstance(data, bytes | Trickle | Huge):
                data = json.dumps(data).encode()
            if delay:
                time.sleep(delay)
        finally:
            # Out of flight before the reply is sent: once the client has its reply it may send
            # the next request, which must not find this one still counted.
            with self.lock:
                self.in_flight -= 1
        try:
            self._reply(handler, status, data, headers or {})
        except OSError:
            pass  # the client timed out and hung up

    @staticmethod
    def _reply(handler: BaseHTTPRequestHandler, status: int, data: bytes | Trickle | Huge,
               headers: dict) -> None:
        size = len(data) if isinstance(data, bytes) else len(data.data) \
            if isinstance(data, Trickle) else data.size if data.declare else None
        handler.send_response(status)
        length = {} if size is None else {"Content-Length": str(size)}
        for k, v in {"Content-Type": "application/json", **headers, **length}.items():
            handler.send_header(k, v)
        handler.end_headers()
        for chunk in [data] if isinstance(data, bytes) else data.chunks():
            handler.wfile.write(chunk)
            handler.wfile.flush()

    def requests(self, suffix: str = "") -> int:
        """Requests received (at paths ending with `suffix`)."""
        with self.lock:
            return sum(r["path"].endswith(suffix) for r in self.log)

    def max_attempts(self, suffix: str = "") -> int:
        """Most attempts at any one distinct request (at paths ending with `suffix`)."""
        with self.lock:
            return max((n for (p, _), n in self.attempts.items() if p.endswith(suffix)),
                       default=0)
