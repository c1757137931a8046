"""A small, seeded chaos HTTP server on 127.0.0.1 for fault-injection and secret-leak tests.

One `ThreadingHTTPServer` in a daemon thread answers three protocols by path:

  POST .../chat/completions   OpenAI-compatible chat: the rollout/eval engine (`--engine openai
                              --base-url URL`) and the judge (`--judge openai:MODEL@URL`)
  POST .../retrieve           a Search-R1 retrieval server (`--text-search retriever:URL`)
  POST .../search             serper.dev (`SERPER_BASE_URL=URL`, `--text-search serper`)

A fraction `fail_rate` of the requests misbehave, in four equal parts: HTTP 500 (its body
echoes the credentials the request carried, so a client that copies error bodies into records
leaks them), a timeout (the reply waits `timeout_s + 0.5` s, past the client's timeout),
malformed JSON, and a slow but valid reply (`slow_s`, under the timeout). The draw is a hash of
(seed, path, request body, attempt number), so the same requests get the same faults whatever
the order threads send them in. Attempts are counted per distinct (path, body): a client's
retry bound shows in `max_attempts()`.

The chat replies follow a script (`chat_script`): turn 0 searches with a query unique to the
trajectory (from the request's seed), turn 1 zooms, turn 2 answers `<gold> <seed>`, so every
answer is inexact and reaches the judge; the judge says Yes when the candidate contains the
reference.
"""

from __future__ import annotations

import hashlib
import json
import random
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Self

FAULTS = ("http500", "timeout", "malformed", "slow")


def _reference(text: str, key: str) -> str:
    for line in text.splitlines():
        if line.startswith(key):
            return line[len(key):].strip()
    return ""


def chat_script(body: dict) -> dict:
    """The chat-completions reply (engine or judge) for a request body."""
    msgs = body.get("messages") or []
    first = msgs[0] if msgs else {}
    content = first.get("content")
    text = " ".join(p.get("text", "") for p in content if isinstance(p, dict)) \
        if isinstance(content, list) else str(content or "")
    if "Reference answer:" in text:  # the judge
        gold = _reference(text, "Reference answer:").lower()
        cand = _reference(text, "Candidate answer:").lower()
        reply = "<judge>Yes</judge>" if gold and gold in cand else "<judge>No</judge>"
    else:  # the agent
        seed = body.get("seed", 0)
        turn = sum(m.get("role") == "assistant" for m in msgs)
        reply = [
            ('<thinking>Search.</thinking><tool_call>{"name": "text_search_tool", "arguments": '
            f'{{"query": "chaos query {seed}"}}}}</tool_call>'),
            ('<thinking>Zoom.</thinking><tool_call>{"name": "image_zoom_in_tool", "arguments": '
            '{"bbox_2d": [0, 0, 500, 500]}}</tool_call>'),
            f"<thinking>Done.</thinking><answer>red {seed}</answer>",
        ][min(turn, 2)]
    return {"id": "chaos", "object": "chat.completion",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": reply}}],
            "usage": {"prompt_tokens": 50, "completion_tokens": 12}}


def retriever_script(body: dict) -> dict:
    q = (body.get("queries") or [""])[0]
    return {"result": [[{"document": {"contents": f'"Doc {i}"\nA passage about {q}.'},
                         "score": 1.0 / (i + 1)} for i in range(int(body.get("topk", 3)))]]}


def serper_script(body: dict) -> dict:
    q = body.get("q", "")
    return {"organic": [{"title": f"Result {i}", "snippet": f"About {q}.",
                         "link": f"http://127.0.0.1:9/page{i}"} for i in range(3)]}


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # the default backlog (5) refuses connections under a burst


class ChaosServer:
    def __init__(self, *, seed: int = 0, fail_rate: float = 0.3, timeout_s: float = 1.0,
                 slow_s: float = 0.2) -> None:
        self.seed, self.fail_rate = seed, fail_rate
        self.timeout_s, self.slow_s = timeout_s, slow_s
        self.attempts: Counter = Counter()  # (path, body sha256) -> requests received
        self.faults: Counter = Counter()  # fault kind -> times injected
        self.headers_seen: list[dict] = []  # credentials the requests carried
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # keep pytest output clean
                pass

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, data, delay = server.handle(self.path, raw, dict(self.headers))
                time.sleep(delay)
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client timed out
                    pass

        self.httpd = _Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,),
                                        daemon=True)
        self._thread.start()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # ------------------------------------------------------------------ faults

    def fault(self, path: str, digest: str, attempt: int) -> str | None:
        """The fault for this attempt at this request, or None; independent of arrival order."""
        h = hashlib.sha256(f"{self.seed}\0{path}\0{digest}\0{attempt}".encode()).digest()
        u = random.Random(h).random()
        if u >= self.fail_rate:
            return None
        return FAULTS[min(len(FAULTS) - 1, int(u / self.fail_rate * len(FAULTS)))]

    def handle(self, path: str, raw: bytes, headers: dict) -> tuple[int, bytes, float]:
        # A failure's text (with this server's port in it) can travel back in a later
        # request; the port is left out of the digest so that runs repeat their faults.
        port = str(self.httpd.server_address[1]).encode()
        digest = hashlib.sha256(raw.replace(port, b"PORT")).hexdigest()
        creds = {k.lower(): v for k, v in headers.items()
                 if k.lower() in ("authorization", "x-api-key")}
        with self.lock:
            self.attempts[(path, digest)] += 1
            attempt = self.attempts[(path, digest)]
            self.headers_seen.append(creds)
        kind = self.fault(path, digest, attempt)
        if kind:
            with self.lock:
                self.faults[kind] += 1
        if kind == "http500":
            return 500, json.dumps({"error": f"internal error; you sent {creds}"}).encode(), 0.0
        if kind == "malformed":
            return 200, b'{"choices": [{"message": ', 0.0
        delay = (self.timeout_s + 0.5 if kind == "timeout"
                 else self.slow_s if kind == "slow" else 0.0)
        try:
            body = json.loads(raw)
        except ValueError:
            return 400, b'{"error": "bad json"}', delay
        if path.endswith("/chat/completions"):
            reply = chat_script(body)
        elif path.endswith("/retrieve"):
            reply = retriever_script(body)
        elif path.endswith("/search"):
            reply = serper_script(body)
        else:
            return 404, b'{"error": "no such path"}', delay
        return 200, json.dumps(reply).encode(), delay

    # ------------------------------------------------------------------ counts

    def max_attempts(self, suffix: str = "") -> int:
        """Most attempts the server saw at any one distinct request (under a path suffix)."""
        with self.lock:
            return max((n for (p, _), n in self.attempts.items() if p.endswith(suffix)),
                       default=0)

    def requests(self, suffix: str = "") -> int:
        with self.lock:
            return sum(n for (p, _), n in self.attempts.items() if p.endswith(suffix))
