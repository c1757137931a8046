"""Scoring trajectory rows for `marscli reward` (stages/reward.py's docstring gives the
rules): each row checked (FILE:LINE: field), then scored under its protocol with the judge,
concurrently; a judge failure leaves the row unscored, never a silent 0."""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from marscli.errors import BadInput
from marscli.records.jsonl import get_field
from marscli.scoring.answers import LETTERS, format_ok, gold_letters
from marscli.scoring.judge import Judge, JudgeError
from marscli.scoring.partial import row_key
from marscli.scoring.protocols import Protocol, reward_protocol
from marscli.secrets import redact

PROMPT_TOO_LONG = "prompt_too_long"  # a row rollout refused: nothing generated, reward 0


def _validate(row: dict, src: str, line: int, judge: Judge) -> str | None:
    """Check the fields scoring needs; return the judge's image path (or None)."""
    # the row's id keys its reward downstream (advantages, the partial file of a re-run)
    if not get_field(row, "id", str, src, line):
        raise BadInput(f"{src}:{line}: id: empty — each trajectory needs its id")
    gold = get_field(row, "answer_gt", list, src, line)
    if not gold or not all(isinstance(g, str) for g in gold):
        raise BadInput(f"{src}:{line}: answer_gt: expected a non-empty list of strings, "
                       f"got {gold!r:.80}")
    choices = get_field(row, "choices", list, src, line, default=None)
    if choices is not None:
        if not 1 <= len(choices) <= len(LETTERS) or not all(isinstance(c, str) for c in choices):
            raise BadInput(f"{src}:{line}: choices: expected 1 to {len(LETTERS)} option strings "
                           f"(letters {LETTERS})")
        if not gold_letters(gold, choices):
            raise BadInput(f"{src}:{line}: answer_gt: {gold!r:.80} names none of the "
                           f"{len(choices)} choices — give a letter or an option's text")
    get_field(row, "final_answer", (str, type(None)), src, line, default=None)
    get_field(row, "stop", str, src, line, default="answer")
    for i, seg in enumerate(get_field(row, "segments", list, src, line)):
        if not isinstance(seg, dict):
            raise BadInput(f"{src}:{line}: segments[{i}]: expected an object")
        if seg.get("role") == "tool" and not isinstance(seg.get("ok"), bool):
            raise BadInput(f"{src}:{line}: segments[{i}].ok: expected true or false")
        if seg.get("role") == "model" and not isinstance(seg.get("text", ""), str):
            raise BadInput(f"{src}:{line}: segments[{i}].text: expected a string")
    if not judge.remote:  # the exact judge needs neither question nor image
        return None
    get_field(row, "question", str, src, line)
    images = get_field(row, "images", list, src, line, default=[])
    if not images:
        return None
    rel = images[0].get("path") if isinstance(images[0], dict) else None
    if not isinstance(rel, str):
        raise BadInput(f"{src}:{line}: images[0].path: expected a string")
    base = Path(src).parent if src != "-" else Path.cwd()
    path = base / rel
    if not path.is_file():
        raise BadInput(f"{src}:{line}: images[0].path: {path} not found")
    return str(path)


def _score(row: dict, image: str | None, judge: Judge, format_weight: float,
           protocol: Protocol) -> dict:
    if row.get("stop") == PROMPT_TOO_LONG:  # nothing was generated: 0, and no judge call
        return {"total": 0.0, "accuracy": 0.0, "format": 0.0, "judge": judge.name}
    fmt = format_weight if format_ok(row) else 0.0
    try:
        acc = protocol.reward(row, image, judge)
    except JudgeError as e:
        return {"status": "unscored", "error": redact(str(e)), "format": fmt,
                "judge": judge.name}
    return {"total": acc + fmt, "accuracy": acc, "format": fmt, "judge": judge.name}


def run(rows: Iterable[tuple[int, dict]], src: str, judge: Judge, format_weight: float = 0.5,
        max_unscored: float = 0.05, concurrency: int = 8,
        known: dict[str, dict] | None = None,
        protocol: str = "mars") -> tuple[list[dict], dict]:
    """Score rows. Returns the rows with `reward` and the stage statistics;
    `stats["over_unscored"]` is true when more than `max_unscored` of them are unscored (the
    caller decides what to write). `known`: rewards by `row_key`, from an earlier run's
    partial file, taken instead of scoring again. A list (a file read whole) is validated
    first, so bad input costs no judge call; an iterator (`--follow`) is scored as its rows
    come, each validated on arrival, so that judging overlaps the stage writing them."""
    proto = reward_protocol(protocol)  # an unknown name fails before any row is read
    known = known or {}
    checked = ((row, _validate(row, src, line, judge)) for line, row in rows)
    if isinstance(rows, list):
        checked = list(checked)

    def one(row: dict, image: str | None) -> tuple[str, dict]:
        key = row_key(row, judge.config(), format_weight, protocol)
        return key, known.get(key) or _score(row, image, judge, format_weight, proto)

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        jobs = [(row, pool.submit(one, row, image)) for row, image in checked]
        results = [(row, *job.result()) for row, job in jobs]
    out = [{**row, "reward": rw} for row, _, rw in results]
    rewards = [rw for _, _, rw in results]
    scored = [r for r in rewards if "total" in r]
    unscored = len(rewards) - len(scored)
    stats = {
        "protocol": protocol, "rows": len(out), "reused": sum(k in known for _, k, _ in results),
        "accuracy_mean": _mean(scored, "accuracy"),
        "format_mean": _mean(scored, "format"), "total_mean": _mean(scored, "total"),
        "judge_calls": judge.stats.calls,
        "judge_requests": judge.stats.requests, "judge_retries": judge.stats.retries,
        "cache_hits": judge.stats.cache_hits, "unscored": unscored,
        "prompt_too_long": sum(row.get("stop") == PROMPT_TOO_LONG for row in out),
        "over_unscored": unscored > max_unscored * len(out),
        "first_error": next((r["error"] for r in rewards if "error" in r), None),
    }
    return out, stats


def _mean(rewards: list[dict], key: str) -> float | None:
    return round(sum(r[key] for r in rewards) / len(rewards), 6) if rewards else None
