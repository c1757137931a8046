"""A small, seeded chaos server on 127.0.0.1 (a `fakes.FakeServer`) for fault-injection and
secret-leak tests. It answers three protocols by path:

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
import random
from collections import Counter

from fakes import FakeServer, Reply, chat_reply, current, retrieve_reply, serper_reply

FAULTS = ("http500", "timeout", "malformed", "slow")
CREDENTIALS = ("authorization", "x-api-key")


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
        return chat_reply("<judge>Yes</judge>" if gold and gold in cand else "<judge>No</judge>")
    seed = body.get("seed", 0)  # the agent
    turn = sum(m.get("role") == "assistant" for m in msgs)
    return chat_reply([
        ('<thinking>Search.</thinking><tool_call>{"name": "text_search_tool", "arguments": '
         f'{{"query": "chaos query {seed}"}}}}</tool_call>'),
        ('<thinking>Zoom.</thinking><tool_call>{"name": "image_zoom_in_tool", "arguments": '
         '{"bbox_2d": [0, 0, 500, 500]}}</tool_call>'),
        f"<thinking>Done.</thinking><answer>red {seed}</answer>",
    ][min(turn, 2)])


SCRIPTS = {
    "/chat/completions": chat_script,
    "/retrieve": lambda body: retrieve_reply(*(
        (f"Doc {i}", f"A passage about {(body.get('queries') or [''])[0]}.")
        for i in range(int(body.get("topk", 3))))),
    "/search": lambda body: serper_reply(*(
        (f"Result {i}", f"http://127.0.0.1:9/page{i}", f"About {body.get('q', '')}.")
        for i in range(3))),
}


class ChaosServer(FakeServer):
    def __init__(self, *, seed: int = 0, fail_rate: float = 0.3, timeout_s: float = 1.0,
                 slow_s: float = 0.2) -> None:
        self.seed, self.fail_rate = seed, fail_rate
        self.timeout_s, self.slow_s = timeout_s, slow_s
        self.faults: Counter = Counter()  # fault kind -> times injected
        super().__init__(self.reply)

    @property
    def headers_seen(self) -> list[dict]:
        """The credentials each request carried."""
        with self.lock:
            return [{k.lower(): v for k, v in r["headers"].items() if k.lower() in CREDENTIALS}
                    for r in self.log]

    def fault(self, path: str, digest: str, attempt: int) -> str | None:
        """The fault for this attempt at this request, or None; independent of arrival order."""
        h = hashlib.sha256(f"{self.seed}\0{path}\0{digest}\0{attempt}".encode()).digest()
        u = random.Random(h).random()
        if u >= self.fail_rate:
            return None
        return FAULTS[min(len(FAULTS) - 1, int(u / self.fail_rate * len(FAULTS)))]

    def reply(self, path: str, body, attempt: int) -> Reply:
        req = current()
        kind = self.fault(path, req["digest"], attempt)
        if kind:
            with self.lock:
                self.faults[kind] += 1
        if kind == "http500":
            creds = {k.lower(): v for k, v in req["headers"].items() if k.lower() in CREDENTIALS}
            return 500, {"error": f"internal error; you sent {creds}"}
        if kind == "malformed":
            return 200, b'{"choices": [{"message": '
        delay = {"timeout": self.timeout_s + 0.5, "slow": self.slow_s}.get(kind, 0.0)
        if not isinstance(body, dict):
            return 400, {"error": "bad json"}, delay
        script = next((s for p, s in SCRIPTS.items() if path.endswith(p)), None)
        if script is None:
            return 404, {"error": "no such path"}, delay
        return 200, script(body), delay
