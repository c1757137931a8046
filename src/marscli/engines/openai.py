"""The `openai` engine: message-level chat completions against any OpenAI-compatible server
(vLLM, SGLang, OpenAI itself).

This is how teacher trajectories for cold-start SFT come from a strong served model, and how
eval runs against a served model. The agent hands over each trajectory's conversation as chat
messages (images as `{"type": "image", "image": i}` parts); here they become `image_url` parts
with base64 data URLs, and the reply comes back as text, cut by the server before its stop
token. With `tokenize_with=CKPT` the engine carries that checkpoint's processor, and the agent
tokenises the conversation into the same token-exact segments as the hf engine's.

Failures: connection errors, timeouts, 429, 5xx and malformed replies are retried (bounded,
exponential backoff with full jitter, `Retry-After` honoured up to a minute); other 4xx fail at
once. A request that keeps failing becomes `Generation(finish="error", error=...)` — the agent
ends that trajectory with `stop: "engine_error"` — never an exception for the whole run, never
an empty answer. The API key comes from an environment variable and goes only into the
`Authorization` header: error texts are scrubbed of it.

Departures from token-level engines: no log-probs (the server's tokens need not be the
canonical encoding of its text, so they would not align with the re-tokenised segments), and
each request carries a seed derived from (seed, trajectory id, turn), so that the G samples of
a prompt differ on servers that honour per-request seeds.
"""

from __future__ import annotations

import base64
import hashlib
import io
import mimetypes
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path
from typing import Any

import orjson
import requests

from marscli.engines import ENGINES, Generation, GenRequest, SamplingParams
from marscli.errors import BadInput
from marscli.jsonl import redact

_SENT_AS_IS = {"image/jpeg", "image/png", "image/webp", "image/gif"}
MAX_BACKOFF_S = 30.0


class RequestFailed(Exception):
    """One attempt failed; `retry` says whether another attempt may help."""

    def __init__(self, message: str, retry: bool, wait: float | None = None) -> None:
        super().__init__(message)
        self.retry, self.wait = retry, wait


@lru_cache(maxsize=64)
def data_url(path: str) -> str:
    """An image file as a `data:` URL: JPEG/PNG/WebP/GIF as they are, anything else as PNG.
    Cached: the G samples of a prompt, and every turn of a conversation, resend the same files."""
    mime = mimetypes.guess_type(path)[0]
    if mime in _SENT_AS_IS:
        data = Path(path).read_bytes()
    else:
        from PIL import Image

        buf = io.BytesIO()
        with Image.open(path) as im:
            im.convert("RGB").save(buf, format="PNG")
        data, mime = buf.getvalue(), "image/png"
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def request_seed(seed: int, key: str, turn: int) -> int:
    """A stable per-request seed: same run, same seeds; different samples, different seeds."""
    h = hashlib.sha256(f"{seed}\0{key}\0{turn}".encode()).digest()
    return int.from_bytes(h[:4], "big") >> 1  # 31 bits: every server accepts it


@ENGINES.register("openai")
class OpenAIEngine:
    message_level = True

    def __init__(self, policy: str | None = None, *, base_url: str | None = None,
                 model: str | None = None, api_key_env: str | None = "OPENAI_API_KEY",
                 tokenize_with: str | None = None, timeout: float = 300.0, retries: int = 3,
                 concurrency: int = 8, backoff: float = 1.0, **_: Any) -> None:
        if not base_url:
            raise BadInput("--engine openai needs --base-url URL — e.g. http://127.0.0.1:8000/v1 "
                           "for `vllm serve`")
        if not model:
            raise BadInput("--engine openai needs --model NAME — the model name the server serves")
        if not base_url.startswith(("http://", "https://")):
            raise BadInput(f"--base-url: {base_url}: expected an http:// or https:// URL")
        url = base_url.rstrip("/")
        self.url = url if url.endswith("/chat/completions") else f"{url}/chat/completions"
        self.model = model
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self.concurrency = max(1, concurrency)
        self._key_env = api_key_env
        self._key = os.environ.get(api_key_env) if api_key_env else None
        self.processor = None
        if tokenize_with:
            from marscli.policy import check_checkpoint, load_processor

            self.processor = load_processor(check_checkpoint(tokenize_with, "--tokenize-with"))
        self._local = threading.local()  # one requests.Session per thread
        self._lock = threading.Lock()
        self.attempts = self.failures = 0  # for the sidecar

    def config(self) -> dict:
        """What the sidecar records (never the key itself)."""
        return {"base_url": self.url, "model": self.model, "api_key_env": self._key_env,
                "timeout": self.timeout, "retries": self.retries,
                "concurrency": self.concurrency}

    def stats(self) -> dict:
        return {"requests": self.attempts, "failed_requests": self.failures}

    # ------------------------------------------------------------------ generation

    def generate(self, requests_: list[GenRequest], params: SamplingParams) -> list[Generation]:
        """Send a turn's requests concurrently (at most `concurrency` in flight)."""
        if len(requests_) <= 1 or self.concurrency == 1:
            return [self._one(r, params) for r in requests_]
        with ThreadPoolExecutor(min(self.concurrency, len(requests_))) as pool:
            return list(pool.map(lambda r: self._one(r, params), requests_))

    def _one(self, r: GenRequest, params: SamplingParams) -> Generation:
        try:
            body = self.body(r, params)
            reply = self._post(body)
        except RequestFailed as e:
            return Generation([], [], "error", error=self._scrub(str(e)))
        except OSError as e:  # an image file vanished between turns
            return Generation([], [], "error", error=self._scrub(f"{type(e).__name__}: {e}"))
        msg = reply["choices"][0]
        text = msg["message"]["content"]
        reasoning = msg["message"].get("reasoning_content") or msg["message"].get("reasoning")
        if isinstance(reasoning, str) and reasoning and "<think" not in text:
            text = f"<think>{reasoning}</think>{text}"  # servers with a reasoning parser split it
        usage = reply.get("usage") if isinstance(reply.get("usage"), dict) else {}
        n = usage.get("completion_tokens")
        return Generation([], [], "length" if msg.get("finish_reason") == "length" else "stop",
                          text=text, usage=n if isinstance(n, int) else None)

    def body(self, r: GenRequest, params: SamplingParams) -> dict:
        """The chat-completions request: images inlined as data URLs, sampling options."""
        if r.messages is None:
            raise ValueError("the openai engine needs chat messages (GenRequest.messages)")
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [self._message(m, r.image_files) for m in r.messages],
            "max_tokens": r.max_new_tokens or params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "seed": request_seed(params.seed, r.key, r.turn),
        }
        if params.top_k:
            body["top_k"] = params.top_k  # vLLM and SGLang accept it; OpenAI has none
        return body

    @staticmethod
    def _message(m: dict, files: list[Path]) -> dict:
        content = m["content"]
        if isinstance(content, str):
            return {"role": m["role"], "content": content}
        parts = []
        for p in content:
            if p.get("type") == "image":
                parts.append({"type": "image_url",
                              "image_url": {"url": data_url(str(files[p["image"]]))}})
            else:
                parts.append(p)
        return {"role": m["role"], "content": parts}

    # ------------------------------------------------------------------ HTTP

    def _session(self) -> requests.Session:
        s = getattr(self._local, "session", None)
        if s is None:
            s = self._local.session = requests.Session()
        return s

    def _count(self, name: str) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + 1)

    def _post(self, body: dict) -> dict:
        """POST with bounded retries; the parsed reply, or RequestFailed after the last try."""
        headers = {"Content-Type": "application/json"}
        if self._key:
            headers["Authorization"] = f"Bearer {self._key}"
        data = orjson.dumps(body)
        err = RequestFailed("no attempt made", retry=False)
        for attempt in range(self.retries + 1):
            if attempt:
                cap = min(MAX_BACKOFF_S, self.backoff * 2 ** (attempt - 1))
                time.sleep(min(60.0, err.wait) if err.wait else random.uniform(0, cap))
            self._count("attempts")
            try:
                return self._attempt(data, headers)
            except RequestFailed as e:
                err = e
                if not e.retry:
                    break
        self._count("failures")
        tries = f"{attempt + 1} attempt{'s' if attempt else ''}"
        raise RequestFailed(f"POST {self.url}: {err} (after {tries})", retry=False)

    def _attempt(self, data: bytes, headers: dict) -> dict:
        try:
            r = self._session().post(self.url, data=data, headers=headers, timeout=self.timeout)
        except requests.Timeout:
            raise RequestFailed(f"timed out after {self.timeout:g} s", retry=True) from None
        except requests.ConnectionError as e:
            raise RequestFailed(f"connection failed ({type(e).__name__})", retry=True) from None
        except requests.RequestException as e:
            raise RequestFailed(f"{type(e).__name__}: {e}", retry=False) from None
        if r.status_code >= 400:
            snippet = r.content[:300].decode("utf-8", "replace")
            hint = (f" — check ${self._key_env}" if r.status_code in (401, 403) else "")
            retry = r.status_code == 429 or r.status_code >= 500
            raise RequestFailed(f"HTTP {r.status_code}: {snippet}{hint}", retry=retry,
                                wait=_retry_after(r) if retry else None)
        try:
            reply = orjson.loads(r.content)
            choice = reply["choices"][0]
            if not isinstance(choice["message"]["content"], str):
                raise TypeError("message.content is not a string")
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError) as e:
            snippet = r.content[:200].decode("utf-8", "replace")
            raise RequestFailed(f"malformed reply ({type(e).__name__}: {e}): {snippet!r}",
                                retry=True) from None
        return reply

    def _scrub(self, msg: str) -> str:
        msg = redact(msg)
        return msg.replace(self._key, "<redacted>") if self._key else msg


def _retry_after(r: requests.Response) -> float | None:
    v = r.headers.get("Retry-After", "")
    try:
        return max(0.0, float(v))
    except ValueError:
        return None
