"""`marscli reward`: trajectory rows in, the same rows with `reward` out.

    reward.total = accuracy (0 or 1) + format (format_weight or 0)

Accuracy: as `--protocol` scores it, `mars` (the default) or `release`: the entry's `reward`
in `scoring/protocols.py`, which says how every protocol scores (`eval` takes the same entries).

Format: `format_weight` when the trajectory ended with a non-empty answer (stop "answer") and
made no invalid tool call (a tool segment with ok false, or stop "format_error"). The same under
every protocol: the release's format score (0.5, zeroed by a model-caused tool error) is this.

Rows are checked before they are scored (FILE:LINE: field): `answer_gt`, `choices` (1-5 option
strings that the gold answers name), `segments`; with a judge that asks a model, `question` and
the first image's file (relative to the input's folder), which the judge is shown.

A row that rollout refused (`stop: "prompt_too_long"`: its prompt did not fit, nothing was
generated) scores 0 (accuracy 0, format 0) without a judge call, counted as `prompt_too_long`
in the statistics; `advantages` then leaves it out (there is nothing to train on).

Failures: a judge that gives no verdict after its retries leaves the row
`{"status": "unscored", "error": ...}` with no `total`, never a silent 0.
- Up to `max_unscored` of the rows may be unscored: the output and sidecar are written, the
  unscored rows marked so, and `advantages` leaves them out (counting them).
- More than that, and the stage exits 1 leaving neither output nor sidecar (a pre-existing
  output is untouched), so `make` retries it. The rows that were scored go to `OUT.partial`
  (their rewards, keyed by id and a hash of the row and the scoring settings); a re-run takes
  them from there and asks the judge only about the rest, then removes it. With `-o -` there is
  no partial file (the judge's verdict cache still saves the calls).

Nothing here imports torch or transformers (a test checks `marscli reward` in a subprocess).
"""

from __future__ import annotations

import contextlib
import hashlib
import sys
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import orjson

from marscli.errors import BadInput, RuntimeFailure, check_range
from marscli.records.jsonl import follow_rows, get_field, iter_rows, read_rows
from marscli.records.outputs import AtomicJsonl, hold_lock
from marscli.records.provenance import stage_inputs, write_sidecar
from marscli.scoring.answers import LETTERS, format_ok, gold_letters
from marscli.scoring.judge import Judge, JudgeError, JudgeOptions, make_judge
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


# ----------------------------------------------------------------------------- partial results


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


@stage_inputs()
def main(input: str, output: str = "-", judge_spec: str = "exact", format_weight: float = 0.5,
         max_unscored: float = 0.05, judge_options: JudgeOptions | None = None,
         protocol: str = "mars",
         follow: bool = False) -> dict[str, Any]:
    """`marscli reward`: read, score, write all-or-nothing, write the sidecar. When too many
    rows are unscored: keep the scored ones in `OUT.partial`, write nothing else, and raise
    RuntimeFailure (exit 1). `follow`: score the input's rows as its writer appends them,
    until its sidecar appears (`jsonl.follow_rows`). OUT's lock is held from the start, so a
    second reward (or follower) on the same output fails at once instead of paying for every
    judge call again."""
    check_range("--format-weight", format_weight, 0)
    check_range("--max-unscored", max_unscored, 0, 1)
    opts = judge_options or JudgeOptions()
    opts.check()
    if follow and input == "-":
        raise BadInput("--follow: needs a file that a stage is writing, not stdin (a pipe "
                       "already streams rows as they come)")
    if follow and output != "-" and Path(output).resolve() == Path(input).resolve():
        raise BadInput(f"-o {output}: is the file being followed — pick another output")
    started = time.time()
    reward_protocol(protocol)  # a bad name fails before the judge or the input is touched
    judge = make_judge(judge_spec, opts)  # a bad spec fails before the input is read
    with contextlib.ExitStack() as stack:
        if output != "-":  # held from the start: a second reward on OUT fails before any call
            stack.callback(hold_lock(output).__exit__)
        try:
            rows = follow_rows(input) if follow else read_rows(input)
            out, stats = run(rows, input, judge, format_weight, max_unscored, opts.concurrency,
                             known=load_partial(output), protocol=protocol)
        finally:
            judge.close()
        return _finish(output, input, out, stats, judge, format_weight, max_unscored, protocol,
                       started)


def _finish(output: str, input: str, out: list[dict], stats: dict, judge: Judge,
            format_weight: float, max_unscored: float, protocol: str, started: float) -> dict:
    """Write the scored rows and the sidecar, or (too many unscored) keep the partial file
    and raise RuntimeFailure."""
    _summary(stats)
    if stats["over_unscored"]:
        kept = save_partial(output, out, judge.config(), format_weight, protocol)
        where = f"; the {kept} scored rows are kept in {partial_path(output)}" if kept else ""
        raise RuntimeFailure(
            f"{stats['unscored']} of {stats['rows']} rows unscored (over {max_unscored:.0%}), "
            f"first error: {stats['first_error']} — the judge is failing; nothing was written"
            f"{where}; fix the judge and re-run (scored rows and cached verdicts are reused)")
    with AtomicJsonl(output) as w:
        w.write_all(out)
    config = {**judge.config(), "protocol": protocol, "format_weight": format_weight,
              "max_unscored": max_unscored}
    write_sidecar(output, stage="reward", config=config, inputs=[input], stats=stats,
                  started=started)
    if output != "-":
        partial_path(output).unlink(missing_ok=True)
    return stats


def _summary(stats: dict) -> None:
    """One line on stderr; "no row scored" rather than an accuracy of None."""
    scores = (f"accuracy {stats['accuracy_mean']}, format {stats['format_mean']}"
              if stats["rows"] > stats["unscored"] else "no row scored")
    reused = f", {stats['reused']} from the partial file" if stats["reused"] else ""
    if stats["prompt_too_long"]:
        scores += f" ({stats['prompt_too_long']} prompt_too_long rows scored 0)"
    print(f"reward: {stats['rows']} rows ({stats['protocol']} protocol), {scores}, "
          f"judge calls {stats['judge_calls']} "
          f"(cache hits {stats['cache_hits']}{reused}), unscored {stats['unscored']}",
          file=sys.stderr)
