"""`OUT.partial`: the rewards a failed `marscli reward` kept (too many rows unscored), keyed by
a hash of the row and the scoring settings, so that a re-run asks the judge only about the
rest."""

from __future__ import annotations

import hashlib
from pathlib import Path

import orjson

from marscli.records.jsonl import iter_rows
from marscli.records.outputs import AtomicJsonl

_VERDICT_CONFIG = ("judge", "url", "prompt_version", "max_tokens")  # not timeouts or retries


def row_key(row: dict, judge_config: dict, format_weight: float, protocol: str = "mars") -> str:
    """What a reward depends on: the row (less any old reward), the judge (not how patiently
    it is asked: a re-run with a longer --judge-timeout reuses the rewards), the format
    weight and the scoring protocol."""
    body = {k: v for k, v in row.items() if k != "reward"}
    judge = {k: judge_config.get(k) for k in _VERDICT_CONFIG}
    blob = orjson.dumps([judge, format_weight, protocol, body],
                        option=orjson.OPT_SORT_KEYS | orjson.OPT_SERIALIZE_NUMPY)
    return hashlib.sha256(blob).hexdigest()


def partial_path(output: str) -> Path:
    return Path(f"{output}.partial")


def load_partial(output: str) -> dict[str, dict]:
    """The rewards an earlier failed run kept, by `row_key` (none for stdout or no file)."""
    path = partial_path(output)
    if output == "-" or not path.is_file():
        return {}
    return {str(r["key"]): r["reward"] for _, r in iter_rows(str(path))
            if isinstance(r.get("reward"), dict) and "total" in r["reward"]}


def save_partial(output: str, rows: list[dict], judge_config: dict,
                 format_weight: float, protocol: str = "mars") -> int:
    """Keep the scored rows' rewards for the re-run; return how many."""
    if output == "-":
        return 0
    kept = [{"v": 1, "id": r.get("id"),
             "key": row_key(r, judge_config, format_weight, protocol),
             "reward": r["reward"]} for r in rows if "total" in r["reward"]]
    if not kept:
        partial_path(output).unlink(missing_ok=True)
        return 0
    # a re-run read this file (load_partial): it replaces it, as an input it owns
    with AtomicJsonl(str(partial_path(output)), replaces_input=True) as w:
        w.write_all(kept)
    return len(kept)
