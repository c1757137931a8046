"""`marscli preflight`: does every search and judge endpoint the stages will use answer from
here? `make rl` runs it before the first iteration, where the stages run (a one-task job under
SLURM=1, a step under SLURM=steps), because from a compute node `127.0.0.1` is that node and an
internet API may be out of reach: a search backend that fails turns into observations the policy
trains on, and a judge that cannot be reached fails the first reward after a whole rollout.

- Remote endpoints get one real request through the client the stages use: a query for a text
  search (`retriever:URL`, `serper`), a one-token chat completion for an `openai:MODEL@URL`
  judge (no verdict asked, nothing cached). One attempt each, `--search-timeout` and
  `--search-retries` as the stages take them.
- Local backends (`local:INDEX`, `data`, the exact judge) are opened, which checks the index
  exists and reads from this node; `local:` text indexes also answer one query.
- `serper-lens` is opened only (its API key is set): Lens searches a row's public image URL,
  which a preflight has none of; a `serper` text search checks the same key and host.
- One line per endpoint on stdout, `ok` or `failed: why`, every spec and reason redacted
  (`secrets.redact`); exit 1 when any failed.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from dataclasses import dataclass

from marscli.errors import MarsError, RuntimeFailure
from marscli.search import NoInput, SearchOptions, make_image_backend, make_text_backend
from marscli.secrets import redact

QUERY = "preflight"  # the text query each search endpoint answers


@dataclass
class Check:
    """One endpoint's outcome: `error` None when it answered."""

    what: str  # "text search", "image search", "judge"
    spec: str
    error: str | None = None

    def line(self) -> str:
        return redact(f"{self.what} {self.spec}: " + ("ok" if self.error is None else
                                                        f"failed: {self.error}"))


def check_text(spec: str, opts: SearchOptions) -> None:
    make_text_backend(spec, opts).search(QUERY, 1)


def check_image(spec: str, opts: SearchOptions) -> None:
    make_image_backend(spec, opts)  # remote image search needs a row's image: opened only


def check_judge(spec: str, timeout: float) -> None:
    from marscli.scoring.judge import JudgeOptions, make_judge

    judge = make_judge(spec, JudgeOptions(timeout_s=timeout, attempts=1))
    try:
        if judge.remote:  # one token: proves the URL, the model name and the key
            body = {"model": judge.model, "max_tokens": 1, "temperature": 0,
                    "messages": [{"role": "user", "content": "Reply with OK."}]}
            judge.http.post_json(judge.url, body)
    finally:
        judge.close()


def _check(what: str, spec: str, fn: Callable[[], None]) -> Check:
    try:
        fn()
    except (MarsError, NoInput, OSError, sqlite3.Error) as e:
        return Check(what, spec, str(e) or type(e).__name__)
    return Check(what, spec)


def run_checks(text_search: str | None = None, image_search: str | None = None,
               judge: str | None = None, timeout: float = 30.0, retries: int = 0,
               judge_timeout: float = 60.0) -> list[Check]:
    """Check each endpoint given, in order: text search, image search, judge."""
    opts = SearchOptions.from_opts(cache=None, timeout=timeout, attempts=retries + 1)
    checks = []
    if text_search:
        checks.append(_check("text search", text_search, lambda: check_text(text_search, opts)))
    if image_search:
        checks.append(_check("image search", image_search,
                             lambda: check_image(image_search, opts)))
    if judge:
        checks.append(_check("judge", judge, lambda: check_judge(judge, judge_timeout)))
    return checks


def run_preflight(text_search: str | None = None, image_search: str | None = None,
                  judge: str | None = None, timeout: float = 30.0, retries: int = 0,
                  judge_timeout: float = 60.0) -> None:
    """Print one line per endpoint; RuntimeFailure naming those that failed."""
    checks = run_checks(text_search, image_search, judge, timeout, retries, judge_timeout)
    for c in checks:
        print(f"preflight: {c.line()}", flush=True)
    if not checks:
        print("preflight: no search or judge endpoint given: nothing to check", flush=True)
    failed = [c for c in checks if c.error is not None]
    if failed:
        names = ", ".join(redact(f"{c.what} {c.spec}") for c in failed)
        raise RuntimeFailure(f"{len(failed)} of {len(checks)} endpoints failed "
                             f"({names}) — start them or fix their specs, check they are "
                             "reachable from the nodes the stages run on, or skip with "
                             "PREFLIGHT=0")
