"""The server's HTTP side: one handler class over a `PolicyServer` (state.py), JSON in and out,
errors as `{"error": reason}`; a waiting /generate polls its client's socket and aborts the
request in the engine when the client is gone. With a token every request but `GET /health`
needs it (`token_check`, as vLLM's `--api-key`)."""

from __future__ import annotations

import hashlib
import hmac
import select
import socket
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from typing import Any

import orjson

from marscli.engines import Generation
from marscli.engines.server import TOKEN_ENV
from marscli.serving.guard import IDLE_S, HttpFailure
from marscli.serving.state import PolicyServer

MAX_BODY = 64 << 20  # bytes of one request: a prompt of 100k ids and a few images inline
POLL_S = 0.2  # how often a waiting handler checks that its client is still there


UNAUTHORIZED = ("Unauthorized — send Authorization: Bearer <token>, the token in the file "
                f"the server got with --api-key-file (clients: {TOKEN_ENV}=FILE)")


def token_check(token: str | None) -> Callable[[str | None], bool]:
    """Whether an Authorization header carries `token` (always, without one): as vLLM checks
    its --api-key, the scheme `Bearer` in any case and the SHA-256 digests compared in
    constant time, so neither the length nor a prefix of the token leaks through timing."""
    if token is None:
        return lambda header: True
    want = hashlib.sha256(token.encode()).digest()

    def check(header: str | None) -> bool:
        scheme, _, sent = (header or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            hashlib.sha256(sent.strip().encode()).digest(), want)

    return check


class _JsonHandler(BaseHTTPRequestHandler):
    """What `make_handler`'s handler needs of HTTP apart from the server it serves: JSON bodies
    in and out, and whether the client is still there."""

    protocol_version = "HTTP/1.1"
    timeout = IDLE_S  # an idle connection is closed, and its thread freed

    def log_message(self, fmt: str, *args: Any) -> None:  # no line per request
        pass

    def _gone(self) -> bool:
        """The client closed its end (readable, and a peek reads nothing)."""
        try:
            ready, _, _ = select.select([self.connection], [], [], 0)
            return bool(ready) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _body(self) -> Any:
        size = self.headers.get("Content-Length", "")
        if not size.isdigit():
            raise HttpFailure(411, "Content-Length required")
        if int(size) > MAX_BODY:
            raise HttpFailure(413, f"a {int(size):,} byte request, over {MAX_BODY:,}")
        if int(size) == 0:  # `curl -X POST URL/sleep`: the defaults
            return {}
        try:
            return orjson.loads(self.rfile.read(int(size)))
        except orjson.JSONDecodeError as e:
            raise HttpFailure(400, f"not JSON ({e})") from None

    def _send(self, code: int, payload: dict, headers: dict[str, str] | None = None) -> None:
        data = orjson.dumps(payload)
        if code in (401, 503):  # its body may be unread: this connection cannot carry another
            self.close_connection = True
            headers = {**(headers or {}), "Connection": "close"}
        try:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the client went away: nothing to tell it
            self.close_connection = True


def make_handler(server: PolicyServer, token: str | None = None
                 ) -> type[BaseHTTPRequestHandler]:
    """The HTTP handler over `server`; with `token`, every request but GET /health needs it."""
    authorized = token_check(token)

    class Handler(_JsonHandler):
        def _refused(self) -> bool:
            """401 (its body unread) unless the request carries the token."""
            if authorized(self.headers.get("Authorization")):
                return False
            self._send(401, {"error": UNAUTHORIZED}, {"WWW-Authenticate": "Bearer"})
            return True

        def do_GET(self) -> None:
            if self.path == "/health":  # public, as vLLM's: what serve-wait and probes ask
                return self._send(200, server.health())
            if not self._refused():
                self._send(404, {"error": f"no such endpoint: GET {self.path}"})

        def do_POST(self) -> None:
            if self._refused():
                return
            try:
                if self.path == "/generate" and server.level is not None:
                    raise server.asleep_failure()  # before the body: nothing to read for it
                body = self._body()
                if self.path == "/generate":
                    self._generate(body)
                else:
                    self._send(200, _control(server, self.path, body))
            except HttpFailure as e:
                self._send(e.code, {"error": str(e)}, e.headers)
            except Exception as e:  # one request fails, the server stays
                self._send(500, {"error": f"{type(e).__name__}: {e}"})

        def _generate(self, body: Any) -> None:
            engine, r, pending = server.submit(body)
            if isinstance(pending, Generation):
                return self._send(200, server.reply(engine, r, pending))
            while True:
                try:
                    result = pending.result(timeout=POLL_S)
                    break
                except TimeoutError:
                    if self._gone():
                        engine.loop.abort(pending.request_id)
                        self.close_connection = True
                        return
            self._send(200, server.reply(engine, r, result))

    return Handler


def _control(server: PolicyServer, path: str, body: Any) -> dict:
    """The reply to a POST that changes the server's state rather than generating: /reload,
    /wake, /sleep; any other path is no endpoint (404)."""
    if path == "/reload":
        return server.reload(_field(body, "policy"))
    if path == "/wake":
        return server.wake(_field(body, "policy"))
    if path == "/sleep":
        return server.sleep(_field(body, "level", 1))
    raise HttpFailure(404, f"no such endpoint: POST {path}")


def _field(body: Any, key: str, default: Any = None) -> Any:
    if not isinstance(body, dict):
        raise HttpFailure(400, "expected a JSON object")
    return body.get(key, default)
