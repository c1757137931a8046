"""The judge's options as reward and eval take them (`--judge`, `--judge-*`), declared once.

Light (the CLI imports it for `--help`): `options()` builds `judge.JudgeOptions`, which loads
an HTTP client, when a command runs. `--judge-retries` counts the attempts after the first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from marscli.options import option

if TYPE_CHECKING:
    from marscli.scoring.judge import JudgeOptions


@dataclass
class JudgeConfig:
    judge: str = option(
        "exact", "exact (no judge: non-exact answers score 0) or openai:MODEL@URL (an "
                 "OpenAI-compatible chat API; key from OPENAI_API_KEY or JUDGE_API_KEY); the "
                 "release judges with GPT-4o.")
    max_unscored: float = option(
        0.05, "Exit 1 when more than this fraction of rows is unscored (judge or engine "
              "failures).")
    judge_timeout: float = option(60.0, "Seconds per judge request.")
    judge_retries: int = option(2, "Retries after a failed judge request (0: one attempt).")
    judge_concurrency: int = option(8, "Judge requests in flight.")
    judge_cache: str | None = option(
        None, "SQLite verdict cache (default: $MARSCLI_CACHE_DIR/judge.sqlite or "
              "~/.cache/marscli/judge.sqlite).", metavar="PATH")

    def options(self, check: bool = True) -> JudgeOptions:
        """As `judge.JudgeOptions`, checked (BadInput naming the option) unless `check=False`
        (reward checks its own options first, in the order its errors have always come)."""
        from marscli.scoring.judge import JudgeOptions

        opts = JudgeOptions(timeout_s=self.judge_timeout, attempts=self.judge_retries + 1,
                            concurrency=self.judge_concurrency, cache_path=self.judge_cache)
        if check:
            opts.check()
        return opts
