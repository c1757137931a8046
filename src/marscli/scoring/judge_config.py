"""The judge's options as reward and eval take them (`--judge`, `--judge-*`), declared once.

Light (the CLI imports it for `--help`): `judge.judge_options(cfg)` builds the judge's own
`JudgeOptions`, which loads an HTTP client, when a command runs. `--judge-retries` counts the
attempts after the first.
"""

from __future__ import annotations

from dataclasses import dataclass

from marscli.options import option

JUDGE_TIMEOUT, JUDGE_ATTEMPTS, JUDGE_CONCURRENCY = 60.0, 3, 8  # judge.JudgeOptions' defaults


@dataclass
class JudgeConfig:
    judge: str = option(
        "exact", "exact (no judge: non-exact answers score 0) or openai:MODEL@URL (an "
                 "OpenAI-compatible chat API; key from OPENAI_API_KEY or JUDGE_API_KEY); the "
                 "release judges with GPT-4o.")
    max_unscored: float = option(
        0.05, "Exit 1 when more than this fraction of rows is unscored (judge or engine "
              "failures).")
    judge_timeout: float = option(JUDGE_TIMEOUT, "Seconds per judge request.")
    judge_retries: int = option(
        JUDGE_ATTEMPTS - 1, "Retries after a failed judge request (0: one attempt).")
    judge_concurrency: int = option(JUDGE_CONCURRENCY, "Judge requests in flight.")
    judge_cache: str | None = option(
        None, "SQLite verdict cache (default: $MARSCLI_CACHE_DIR/judge.sqlite or "
              "~/.cache/marscli/judge.sqlite).", metavar="PATH")
