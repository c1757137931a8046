"""The `server` engine: token ids in and out against a `marscli serve` process (serving/), which
keeps one vLLM engine up for a whole RL run and reloads its weights in place each iteration.

`--engine server:http://HOST:PORT` (or `--engine server --base-url URL`). With `--policy CKPT`
the engine makes the server hold CKPT first (`POST /reload`, a no-op when it already does), so
a `make rl` iteration's rollout moves the server to that iteration's checkpoint by itself;
without one, it generates with whatever the server holds (`GET /health` names it). The prompt
is built here, from that checkpoint's processor (the same folder, on a shared file system), and
images go as absolute paths, which the server decodes exactly as the agent did.

Policy consistency: every reply names the policy the server generated it with. A reply from
another policy than the one this engine started with (the server was reloaded during the
rollout, by another run) fails the stage loudly — never a trajectory mixing two policies —
and the records already written stay, so a re-run resumes.

Failures: connection errors, timeouts and 5xx are retried (marscli.http: bounded, exponential
backoff with jitter; the defaults wait out a server restart, ~30-60 s for vLLM to load). A
connect waits at most CONNECT_TIMEOUT_S (a host that is down is known in seconds; only the reply
to a generation may take minutes), and a call besides generation (/health, /reload, /sleep,
/wake) takes at most `timeout` in all, its retries included, never `timeout` per attempt; when
the retries run out the server is gone, and the stage fails (RuntimeFailure, exit 1) rather
than recording every remaining trajectory as an engine error: a re-run resumes after the
server is back, with nothing lost or duplicated (records are written whole, per trajectory).
A 4xx (the server refused this request: a prompt over its context, a bad image) ends that
trajectory with `stop: "engine_error"` and the server's reason.

A sleeping server (`POST /sleep`, the trainer's turn on its GPUs): `--policy CKPT` wakes it
with CKPT (its `/reload` is a wake); without one, each request's 503 is retried after the
server's `Retry-After` (5 s) until `--retries` run out (8: 40 s), then the stage fails as for a
server gone, naming the sleep. `ServeClient` holds the calls besides generation
(`marscli serve-ctl`).

The run's token: a server started with `--api-key-file` answers only requests that carry its
token. The client reads it from the file MARSCLI_SERVE_TOKEN_FILE names (`make rl SERVE=1`
sets it: RUN/serve/token, mode 0600) and sends `Authorization: Bearer <token>` with every call;
the token is never in a sidecar, a record or an error (marscli.http scrubs what it sends).
A 401 (no token, or another run's) fails the stage in one line: every request would get it.

Asynchronous: `agenerate` sends one request from a thread pool of `concurrency` (a trajectory's
turn), so the agent's asyncio loop keeps every trajectory moving while the server batches
their requests continuously.
"""

from __future__ import annotations

import asyncio
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import orjson

from marscli.engines import ENGINES, Generation, GenRequest, SamplingParams
from marscli.errors import BadInput, RuntimeFailure, check_range
from marscli.http import HttpClient, HttpError
from marscli.records.provenance import weights_fingerprint
from marscli.secrets import redact

ASLEEP = "asleep (level"  # how a sleeping server's 503 starts its reason (serving/state.py)
CONNECT_TIMEOUT_S = 10.0  # a TCP connect to a live host takes milliseconds, even under load
TOKEN_ENV = "MARSCLI_SERVE_TOKEN_FILE"  # names the file holding the servers' token
AUTH_HINT = (f"the server wants the run's token: set {TOKEN_ENV} to the file it was started "
             "with (--api-key-file; make rl SERVE=1: RUN/serve/token)")


def read_token(path: str, flag: str) -> str:
    """The token in `path` (its first line), BadInput naming `flag` when the file cannot be
    read, is empty, or others than its owner may read it (a secret: chmod 600, as ssh asks
    of a key). Never echoed."""
    try:
        mode = os.stat(path).st_mode
        with open(path, encoding="utf-8") as f:
            token = f.readline().strip()
    except (OSError, UnicodeDecodeError) as e:
        why = getattr(e, "strerror", None) or type(e).__name__
        raise BadInput(f"{flag}: {path}: cannot read the token ({why})") from None
    if mode & 0o077:
        raise BadInput(f"{flag}: {path}: others may read this secret (mode {mode & 0o777:o}) — "
                       f"chmod 600 {path}")
    if not token:
        raise BadInput(f"{flag}: {path}: empty — write the token on its first line")
    return token


def token_headers() -> dict[str, str]:
    """`Authorization: Bearer <token>` when TOKEN_ENV names a token file, else nothing."""
    path = os.environ.get(TOKEN_ENV)
    return {"Authorization": f"Bearer {read_token(path, TOKEN_ENV)}"} if path else {}


def same_policy(a: str | None, b: str | None) -> bool:
    """Two spellings of one checkpoint folder (relative, absolute, through a link)."""
    if not a or not b:
        return False
    return a == b or Path(a).resolve() == Path(b).resolve()


class ServeClient:
    """The calls to a `marscli serve` besides generation: /health, /reload, /sleep, /wake
    (`marscli serve-ctl`, and the server engine below). Each takes at most `timeout` seconds in
    all: connection errors, timeouts and 5xx are retried (at most `retries` times) while time
    is left, each attempt given what is left; a server gone for good, or one refusing the call
    (4xx), is a RuntimeFailure. `progress`: a line on stderr per retry, starting with it.
    `refused_final`: a refused connection fails at once (serve-ctl: nothing to wait for)."""

    def __init__(self, base_url: str, *, timeout: float = 600.0, retries: int = 8,
                 backoff: float = 2.0, concurrency: int = 1, refused_final: bool = False,
                 progress: str | None = None) -> None:
        self.url = base_url.rstrip("/")
        common = {"backoff": backoff, "backoff_floor": 0.5, "headers": token_headers(),
                  "auth_hint": AUTH_HINT, "connect_timeout": CONNECT_TIMEOUT_S,
                  "attempts": retries + 1}
        # generation: `timeout` per attempt (a long generation is no fault)
        self.http = HttpClient(timeout=timeout, concurrency=concurrency, **common)
        # the other calls: `timeout` in all
        self.ctl = HttpClient(timeout=timeout, total=timeout, concurrency=1,
                              retry_refused=not refused_final,
                              on_retry=self._say if progress else None, **common)
        self.timeout, self.progress = timeout, progress

    def health(self) -> dict:
        return self._call("GET", "/health")

    def reload(self, policy: str) -> dict:
        """Make the server hold `policy` (an absolute path: the server's cwd is not ours); a
        sleeping server wakes with it."""
        return self._call("POST", "/reload", {"policy": str(Path(policy).resolve())})

    def sleep(self, level: int = 1) -> dict:
        return self._call("POST", "/sleep", {"level": level})

    def wake(self, policy: str | None = None) -> dict:
        """Wake the server with `policy` (default: the one it holds)."""
        return self._call("POST", "/wake", {} if policy is None else
                          {"policy": str(Path(policy).resolve())})

    def _call(self, method: str, path: str, payload: dict | None = None) -> dict:
        try:
            if method == "GET":
                reply = orjson.loads(self.ctl.get_bytes(self.url + path, max_bytes=1 << 20))
            else:
                reply = self.ctl.post_json(self.url + path, orjson.dumps(payload))
        except HttpError as e:
            spent = (f" — gave up after {e.attempts} attempt{'s' if e.attempts > 1 else ''}, "
                     f"of the {self.timeout:g} s allowed (--timeout)" if e.transient else "")
            raise RuntimeFailure(f"marscli serve at {redact(self.url)}: {e.reason}{spent}") \
                from None
        except orjson.JSONDecodeError:
            reply = None
        if not isinstance(reply, dict) or not isinstance(reply.get("policy", 0), str | None):
            raise RuntimeFailure(f"{redact(self.url)}{path}: not a marscli serve reply — is "
                                 "that URL a `marscli serve`?")
        return reply

    def _say(self, reason: str, k: int, attempts: int, elapsed: float) -> None:
        print(f"{self.progress}: {redact(self.url)} not answering ({reason}; attempt "
              f"{k}/{attempts}, {elapsed:.0f} s of {self.timeout:g} s) — retrying",
              file=sys.stderr, flush=True)


CTL_ACTIONS = ("sleep", "wake", "health")  # what `marscli serve-ctl` asks a server


def control(client: ServeClient, action: str, policy: str | None = None,
            level: int | None = None, if_awake: bool = False) -> dict:
    """serve-ctl's call (one of CTL_ACTIONS) and the server's reply. `if_awake` (sleep): a
    server asleep already answers with its health instead, so that the loop's sleep before an
    update may run twice."""
    if action == "wake":
        return client.wake(policy)
    if action == "health":
        return client.health()
    health = client.health() if if_awake else {}
    return health if health.get("asleep") else client.sleep(1 if level is None else level)


@ENGINES.register("server")
class ServerEngine(ServeClient):
    presence_penalty = True
    logprobs_mode = "raw"  # the server's vLLM engine: see engines/vllm.py, point 2
    options = ("base_url", "timeout", "retries", "concurrency", "backoff")

    @staticmethod
    def check_options(engine: str, policy: str | None, opts: dict) -> None:
        if not opts.get("base_url"):
            raise BadInput("--engine server needs the server's URL: --engine server:http://HOST:PORT")
        if not str(opts["base_url"]).startswith(("http://", "https://")):
            raise BadInput(f"--engine server: {redact(opts['base_url'])}: expected an http:// or "
                           "https:// URL")
        check_range("--timeout", opts.get("timeout"), 0, lo_open=True)
        check_range("--retries", opts.get("retries"), 0)
        check_range("--concurrency", opts.get("concurrency"), 1)

    def __init__(self, policy: str | None = None, *, base_url: str, timeout: float = 600.0,
                 retries: int = 8, concurrency: int = 64, backoff: float = 2.0,
                 **_: Any) -> None:
        from marscli.qwen.policy import load_processor

        super().__init__(base_url, timeout=timeout, retries=retries, backoff=backoff,
                         concurrency=concurrency)
        self.concurrency = concurrency
        self._pool: ThreadPoolExecutor | None = None
        # every reply must come from this policy, as its folder was when the server loaded it
        self.held, self.fingerprint = self._hold(policy)
        # the server's vLLM context: the agent refuses a first prompt past it (prompt_too_long)
        self.max_context: int | None = self.health().get("max_model_len")
        self.policy_name = policy if policy is not None else self.held
        self.processor = load_processor(self.held)
        self._config = {"base_url": redact(self.url), "timeout": timeout, "retries": retries,
                        "concurrency": concurrency, "server_policy": self.held}

    def _hold(self, policy: str | None) -> tuple[str, str | None]:
        """The policy the server generates with and its fingerprint: `policy`, which it is
        made to hold (a sleeping server wakes with it; one holding this folder as it was before
        it was rewritten reloads it), else whatever it holds."""
        state = self.health()
        if policy is not None and (state.get("asleep")
                                   or not same_policy(policy, state["policy"])
                                   or state.get("fingerprint") != weights_fingerprint(policy)):
            state = self.reload(policy)
        if state["policy"] is None:
            raise RuntimeFailure(f"marscli serve at {redact(self.url)} holds no policy yet: "
                                 "name one with --policy CKPT")
        return state["policy"], state.get("fingerprint")

    def config(self) -> dict:
        return dict(self._config)

    def stats(self) -> dict:
        return {"requests": self.http.attempts + self.ctl.attempts,
                "failed_requests": self.http.failures + self.ctl.failures}

    # ------------------------------------------------------------------ generation

    def generate(self, requests: list[GenRequest], params: SamplingParams) -> list[Generation]:
        """The lock-step loop's batch: every request in flight at once (the server batches)."""
        with ThreadPoolExecutor(max(1, min(self.concurrency, len(requests)))) as pool:
            return list(pool.map(lambda r: self._one(r, params), requests))

    async def agenerate(self, request: GenRequest, params: SamplingParams) -> Generation:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="marscli-server")
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._one, request,
                                                                params)

    def body(self, r: GenRequest, params: SamplingParams) -> dict:
        if len(r.image_files) != len(r.images):
            raise ValueError("the server engine needs each image's file (GenRequest.image_files)")
        return {"tokens": r.tokens, "images": [{"path": str(Path(f).resolve())}
                                               for f in r.image_files],
                "max_new_tokens": r.max_new_tokens or params.max_new_tokens,
                "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                "presence_penalty": params.presence_penalty, "seed": params.seed,
                "key": r.key, "turn": r.turn}

    def _one(self, r: GenRequest, params: SamplingParams) -> Generation:
        try:
            reply = self.http.post_json(f"{self.url}/generate",
                                        orjson.dumps(self.body(r, params)), validate=_check_reply)
        except HttpError as e:
            if e.reason.startswith("HTTP 401"):  # every request would get it: not one record's
                raise RuntimeFailure(f"marscli serve at {redact(self.url)}: {e.reason}") \
                    from None
            if e.transient:  # the attempts ran out: the server is gone or asleep
                todo = ("wake it (marscli serve-ctl URL wake)" if ASLEEP in e.reason
                        else "start it again")
                raise RuntimeFailure(f"marscli serve at {redact(self.url)}: {e.reason} — "
                                     f"{todo} and re-run: the rollout resumes") from None
            return Generation([], None, "error", error=str(e))
        if not same_policy(reply["policy"], self.held) or \
                reply.get("fingerprint") != self.fingerprint:
            raise RuntimeFailure(
                f"marscli serve at {redact(self.url)} now holds {reply['policy']}, not "
                f"{self.held}: it was reloaded during this run, so its trajectories would mix "
                "two policies — re-run the stage (finished records are kept)")
        return Generation(reply["tokens"], reply["logprobs"], reply["finish"])


def _check_reply(reply: dict) -> dict:
    """A generation reply; anything else is retried as malformed."""
    if not (isinstance(reply["tokens"], list) and isinstance(reply["logprobs"], list)
            and reply["finish"] in ("stop", "length") and isinstance(reply["policy"], str)):
        raise TypeError("not a marscli serve generation")
    return reply
