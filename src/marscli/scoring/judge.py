"""LLM judges for the reward stage: is a non-exact answer still correct?

Specs (`--judge`):
- `exact`: no judge. An answer that does not match a gold answer exactly scores 0, a real,
  deterministic score (the verdict is always No), not a failure.
- `openai:MODEL@URL` (or `openai:MODEL`, URL from `OPENAI_BASE_URL`, default OpenAI's): an
  OpenAI-compatible `POST {URL}/chat/completions` (vLLM, SGLang, OpenAI...). The API key comes
  from `OPENAI_API_KEY` or `JUDGE_API_KEY` and is only ever put in the Authorization header.
  The spec is split at the first `@` followed by `http://` or `https://`, so a URL with
  credentials (`openai:m@http://user:PW@host/v1`) parses; they are sent as Basic auth, and the
  URL is redacted in the sidecar, in every message and in the cache key.

An HTTP judge asks through `marscli.http`, which retries connection errors, timeouts, HTTP
429/5xx and malformed replies (no verdict tag counts as one) with exponential backoff and
jitter, up to `attempts` in all; other 4xx are not retried (asking again will not help). When it
gives up it raises `JudgeError`, which the reward stage records as an
unscored row. Successful verdicts are cached in SQLite (WAL, one connection per thread, safe for
several processes) keyed by sha256 of (prompt version, endpoint, model, question, gold,
response), the endpoint without its credentials: a re-run after a partial failure only asks what
it has not asked yet, and another server serving a model of the same name is asked afresh.
Replies are read with the HTTP client's byte cap (`max_reply_bytes`); a bigger one is not
retried (it would be too big again) and leaves the row unscored.

Health: inside `with judge_tally() as t:` (one per scored record, in the scoring thread), a
judge counts in `t` the verdicts it asked of its server, their retries, the ones that failed and
the cache hits; eval's scores carry them as `judge_calls` and its summary adds them up.
`Judge.address` names the server (redacted).
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import re
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from pathlib import Path

import orjson

from marscli.errors import BadInput, RuntimeFailure, check_range
from marscli.http import MAX_JSON_BYTES, MAX_RETRIES, MAX_TIMEOUT, HttpClient, HttpError
from marscli.registry import Registry
from marscli.scoring.judge_config import (
    JUDGE_ATTEMPTS,
    JUDGE_CONCURRENCY,
    JUDGE_TIMEOUT,
    JudgeConfig,
)
from marscli.secrets import REDACTED, public, redact

PROMPT_VERSION = 1  # part of the cache key: a new prompt must not reuse the old prompt's verdicts
IMAGE_MAX_SIDE = 512  # the judge needs the gist of the image, not its pixels
_VERDICT = re.compile(r"<judge>\s*(yes|no)\b[^<]*</judge>", re.IGNORECASE)
_URL_AT = re.compile(r"@(?=https?://)", re.IGNORECASE)

PROMPT = """You grade answers to questions about an image. Compare the candidate answer with the \
reference answer (the ground truth) and decide whether the candidate is correct.

Question: {question}
Reference answer: {gold}
Candidate answer: {response}

Principles:
- A candidate that is more specific than the reference but agrees with it is correct \
(e.g. "Lyon, France" for "Lyon"); one that is vaguer, hedges between several answers, or \
names a different thing is not.
- Numbers are correct when they are equal after converting units or notation \
(e.g. "1.5 km" and "1500 m", "3 million" and "3,000,000"); rounding is fine only when the \
reference is itself rounded.
- For a person, both the first and the last name must be right.
- For a yes/no question, the candidate's yes or no must match the reference.
- For a multiple-choice question, be lenient: the option letter, the option text, or both \
are correct when they point to the reference option.
- Spelling variants, abbreviations and translations of the same thing are correct.

Reply with exactly <judge>Yes</judge> if the candidate is correct, otherwise <judge>No</judge>."""


class JudgeError(RuntimeFailure):
    """The judge gave no verdict after all attempts; the reward stage marks the row unscored."""


MAX_CONCURRENCY = 256  # --judge-concurrency: threads, each holding a request in flight


@dataclass
class JudgeOptions:
    timeout_s: float = JUDGE_TIMEOUT
    attempts: int = JUDGE_ATTEMPTS  # in all, the first one included
    concurrency: int = JUDGE_CONCURRENCY  # HTTP requests in flight at once
    cache_path: str | None = None  # None: $MARSCLI_CACHE_DIR/judge.sqlite or ~/.cache/marscli
    backoff_s: float = 1.0  # first retry waits backoff_s * (1..2), then doubles
    max_tokens: int = 256  # room for a judge that thinks before its tag
    max_reply_bytes: int = MAX_JSON_BYTES  # a bigger reply fails the call, unretried

    def check(self) -> None:
        """BadInput naming the option (`--judge-retries`: the attempts after the first)."""
        check_range("--judge-timeout", self.timeout_s, 0, MAX_TIMEOUT, lo_open=True)
        check_range("--judge-retries", self.attempts - 1, 0, MAX_RETRIES)
        check_range("--judge-concurrency", self.concurrency, 1, MAX_CONCURRENCY)


def judge_options(cfg: JudgeConfig, check: bool = True) -> JudgeOptions:
    """A command's `JudgeConfig` as `JudgeOptions`, checked (BadInput naming the option) unless
    `check=False` (reward checks its own options first, in the order its errors always came)."""
    opts = JudgeOptions(timeout_s=cfg.judge_timeout, attempts=cfg.judge_retries + 1,
                        concurrency=cfg.judge_concurrency, cache_path=cfg.judge_cache)
    if check:
        opts.check()
    return opts


@dataclass
class JudgeStats:
    calls: int = 0  # verdicts asked of the judge (cache misses)
    requests: int = 0  # HTTP requests sent, retries included
    retries: int = 0
    cache_hits: int = 0


@dataclass
class JudgeTally:
    """One record's judge calls (`judge_tally`)."""

    asked: int = 0  # verdicts asked of the server (cache misses)
    retries: int = 0  # requests after the first, over those verdicts
    failures: int = 0  # verdicts that never came
    cache_hits: int = 0

    def fields(self) -> dict:
        """`{"judge_calls": {...}}` with the counts that are not 0; {} when all are."""
        counts = {k: v for k, v in asdict(self).items() if v}
        return {"judge_calls": counts} if counts else {}


_TALLY = threading.local()


@contextmanager
def judge_tally() -> Iterator[JudgeTally]:
    """Count this thread's judge calls until the block ends (nested blocks count apart)."""
    before = getattr(_TALLY, "t", None)
    _TALLY.t = tally = JudgeTally()
    try:
        yield tally
    finally:
        _TALLY.t = before


def _tally(field: str, n: int = 1) -> None:
    t = getattr(_TALLY, "t", None)
    if t is not None and n:
        setattr(t, field, getattr(t, field) + n)


class Judge:
    """One signature for every judge: `verdict(question, gold, response, image) -> bool`."""

    form = ""  # the spec form, for error messages
    name = ""  # what goes into `reward.judge`
    remote = False  # asks a model: needs the question and the image

    def __init__(self, arg: str, opts: JudgeOptions) -> None:
        self.counts = JudgeStats()  # calls and cache hits; HTTP judges add their requests

    @property
    def stats(self) -> JudgeStats:
        return self.counts

    def verdict(self, question: str, gold: str, response: str, image: str | None) -> bool:
        raise NotImplementedError

    def config(self) -> dict:
        return {"judge": self.name}

    @property
    def address(self) -> str:
        """What eval's summary names as the judge's server (redacted)."""
        return self.name

    def close(self) -> None:
        pass


JUDGES: Registry[type[Judge]] = Registry("judge")


@JUDGES.register("exact")
class ExactJudge(Judge):
    form = "exact"
    name = "exact"

    def __init__(self, arg: str, opts: JudgeOptions) -> None:
        super().__init__(arg, opts)
        if arg:
            raise BadInput(f"--judge exact:{arg}: the exact judge takes no argument — use exact")

    def verdict(self, question: str, gold: str, response: str, image: str | None) -> bool:
        return False  # exact matches were already scored; anything else is wrong


@JUDGES.register("openai")
class OpenAIJudge(Judge):
    form = "openai:MODEL@URL"
    remote = True

    def __init__(self, arg: str, opts: JudgeOptions) -> None:
        super().__init__(arg, opts)
        model, url = split_model_url(arg)
        url = url or os.environ.get("OPENAI_BASE_URL", "https://api.openai.com/v1")
        if not model:
            raise BadInput(f"--judge openai:{_hide(arg)}: no model name — use openai:MODEL@URL, "
                           "e.g. openai:Qwen2.5-VL-72B-Instruct@http://localhost:8000/v1")
        if not re.match(r"https?://", url):
            raise BadInput(f"--judge openai:{model}@{_hide(url)}: the URL must start with "
                           "http:// or https://")
        self.model, self.url, self.opts = model, url.rstrip("/") + "/chat/completions", opts
        self.endpoint = public(self.url)  # what the cache key and the sidecar name
        self.name = f"openai:{model}"
        # the semaphore inside bounds callers that bring their own threads too
        self.http = HttpClient(timeout=opts.timeout_s, attempts=opts.attempts,
                               backoff=opts.backoff_s, backoff_floor=1.0,
                               concurrency=opts.concurrency, headers=_headers(),
                               max_bytes=opts.max_reply_bytes)
        self._lock = threading.Lock()
        self.cache = VerdictCache(opts.cache_path or default_cache_path())

    def config(self) -> dict:
        o = self.opts
        return {"judge": self.name, "url": redact(self.url), "timeout_s": o.timeout_s,
                "attempts": o.attempts, "concurrency": o.concurrency, "cache": self.cache.path,
                "prompt_version": PROMPT_VERSION, "max_tokens": o.max_tokens,
                "max_reply_bytes": o.max_reply_bytes}

    @property
    def address(self) -> str:
        return f"{self.name}@{redact(self.url.removesuffix('/chat/completions'))}"

    @property
    def stats(self) -> JudgeStats:
        sent = self.http.attempts  # every call sends one request, then its retries
        return replace(self.counts, requests=sent, retries=sent - self.counts.calls)

    def verdict(self, question: str, gold: str, response: str, image: str | None) -> bool:
        key = cache_key(self.endpoint, self.model, question, gold, response)
        cached = self.cache.get(key)
        if cached is not None:
            self._count("cache_hits")
            _tally("cache_hits")
            return cached
        body = self._body(question, gold, response, image)
        self._count("calls")
        _tally("asked")
        try:
            yes = self._ask(body)
        except JudgeError:
            _tally("failures")
            raise
        finally:
            _tally("retries", max(0, self.http.last_attempts() - 1))
        self.cache.put(key, yes)
        return yes

    def _body(self, question: str, gold: str, response: str, image: str | None) -> dict:
        content: list[dict] = []
        if image:
            content.append({"type": "image_url", "image_url": {"url": image_data_url(image)}})
        text = PROMPT.format(question=question, gold=gold, response=response)
        content.append({"type": "text", "text": text})
        return {"model": self.model, "messages": [{"role": "user", "content": content}],
                "temperature": 0, "max_tokens": self.opts.max_tokens}

    def _ask(self, body: dict) -> bool:
        try:
            return self.http.post_json(self.url, body, validate=_parse_verdict)
        except HttpError as e:  # its reason is scrubbed of every key already
            if not e.transient:  # our request is wrong (auth, model name): asking again won't help
                raise JudgeError(f"judge refused: {e.reason}") from None
            raise JudgeError(f"judge gave no verdict after {e.attempts} attempts: "
                             f"{e.reason}") from None

    def _count(self, field: str) -> None:
        with self._lock:
            setattr(self.counts, field, getattr(self.counts, field) + 1)

    def close(self) -> None:
        self.cache.close()


def parse_spec(spec: str) -> tuple[str, str]:
    """`openai:MODEL@URL` -> ("openai", "MODEL@URL"); `exact` -> ("exact", "")."""
    name, _, arg = spec.partition(":")
    if name not in JUDGES:
        forms = ", ".join(JUDGES.get(n).form for n in JUDGES.names())
        raise BadInput(f"--judge {spec!r}: unknown judge — valid forms: {forms}")
    return name, arg


def split_model_url(arg: str) -> tuple[str, str]:
    """`MODEL@URL` -> (MODEL, URL), split at the first `@` that a scheme follows, so that a URL
    with userinfo (`m@http://user:pw@host`) keeps its own `@`; without one, at the first `@`
    (the URL is then refused for its missing scheme)."""
    m = _URL_AT.search(arg)
    if m:
        return arg[:m.start()], arg[m.end():]
    model, _, url = arg.partition("@")
    return model, url


def _hide(text: str) -> str:
    """`text` for an error message: redacted, and anything before a last `@` dropped (a
    userinfo without a scheme, which `redact` cannot recognise)."""
    text = redact(text)
    return f"{REDACTED}@{text.rpartition('@')[2]}" if "@" in text else text


def make_judge(spec: str, opts: JudgeOptions | None = None) -> Judge:
    opts = opts or JudgeOptions()
    opts.check()
    name, arg = parse_spec(spec)
    return JUDGES.get(name)(arg, opts)


def _headers() -> dict:
    key = os.environ.get("OPENAI_API_KEY") or os.environ.get("JUDGE_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def _parse_verdict(reply: dict) -> bool:
    """The validator: the last verdict tag of a chat completion; ValueError (retried) if none."""
    content = reply["choices"][0]["message"]["content"]
    found = _VERDICT.findall(content) if isinstance(content, str) else []
    if not found:
        raise ValueError("no <judge>Yes</judge> or <judge>No</judge> in it")
    return found[-1].lower() == "yes"


@lru_cache(maxsize=64)  # G samples of a prompt share one image: encode it once
def image_data_url(path: str) -> str:
    from marscli.qwen.images import open_image  # Pillow only; kept out of the exact path

    im = open_image(path, what="judge image")
    im.thumbnail((IMAGE_MAX_SIDE, IMAGE_MAX_SIDE))
    buf = io.BytesIO()
    im.save(buf, format="JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def cache_key(endpoint: str, model: str, question: str, gold: str, response: str) -> str:
    """What determines a verdict: the prompt, the server (without credentials), the model,
    the inputs."""
    blob = orjson.dumps([PROMPT_VERSION, endpoint, model, question, gold, response])
    return hashlib.sha256(blob).hexdigest()


def default_cache_path() -> str:
    base = os.environ.get("MARSCLI_CACHE_DIR") or Path.home() / ".cache" / "marscli"
    return str(Path(base) / "judge.sqlite")


class VerdictCache:
    """Judge verdicts in SQLite: WAL so readers never block the writer, a busy timeout so
    several processes can share one file, and one connection per thread (sqlite3's rule)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._local = threading.local()
        self._conns: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._conn()
        except (OSError, sqlite3.Error) as e:
            raise BadInput(f"--judge-cache {path}: cannot open the judge cache ({e}) — "
                           "pick another path or set MARSCLI_CACHE_DIR") from None

    def _conn(self) -> sqlite3.Connection:
        c = getattr(self._local, "c", None)
        if c is None:
            # check_same_thread=False only so close() can run from the main thread
            c = sqlite3.connect(self.path, timeout=30, isolation_level=None,
                                check_same_thread=False)
            c.execute("PRAGMA busy_timeout=30000")
            c.execute("PRAGMA journal_mode=WAL")
            c.execute("CREATE TABLE IF NOT EXISTS verdicts "
                      "(key TEXT PRIMARY KEY, yes INTEGER NOT NULL, created REAL NOT NULL)")
            self._local.c = c
            with self._lock:
                self._conns.append(c)
        return c

    def get(self, key: str) -> bool | None:
        row = self._conn().execute("SELECT yes FROM verdicts WHERE key = ?", (key,)).fetchone()
        return None if row is None else bool(row[0])

    def put(self, key: str, yes: bool) -> None:
        self._conn().execute("INSERT OR REPLACE INTO verdicts VALUES (?, ?, ?)",
                             (key, int(yes), time.time()))

    def close(self) -> None:
        with self._lock:
            for c in self._conns:
                c.close()
            self._conns.clear()
        self._local = threading.local()
