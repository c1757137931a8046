"""The reward stage: trajectory rows in, the same rows with `reward` out.

    reward.total = accuracy (0 or 1) + format (format_weight or 0)

Accuracy, as the paper scores it:
1. Take the response's last `<answer>` (the record's `final_answer`, else parsed from the last
   model segment). No answer: accuracy 0, and no judge is asked.
2. Multiple choice (the row has `choices`): extract a letter A-E (a bare letter, `\\boxed{X}`,
   "answer is (X)", the last standalone capital letter) or accept the text of an option; it is
   right when it names a gold option. No judge.
3. Otherwise normalise SQuAD-style (lower case, no punctuation, no articles, single spaces),
   keeping a lone "a" so the letter A survives; an exact match with any gold answer scores 1.
4. Else, when a judge is configured, ask it once per gold answer (question, gold, answer,
   image); any Yes scores 1. With `--judge exact` the answer scores 0.

Format: `format_weight` when the trajectory ended with a non-empty answer (stop "answer") and
made no invalid tool call (a tool segment with ok false, or stop "format_error"). The same under
both protocols: the release's format score (0.5, zeroed by a model-caused tool error) is this.

`--protocol release` (`release_accuracy`) scores accuracy as the released code does
(`release_scoring.py` lists where it differs from the above):
1. The text scored is the last model segment's (the last assistant turn); a record without
   model segments is scored as `<answer>final_answer</answer>`.
2. Multiple choice (the row has `choices`): the release's letter extraction (A-D, from the
   `<answer>` tag, a box, or the whole turn when there is no tag), compared with the gold
   letters; no judge.
3. Open answers: the last `<answer>` after the turn's last `</think>`/`</thinking>`; none
   scores 0 without asking the judge. Else exact match (the release's normalisation), else the
   judge (not with `--judge exact`), asked about that answer.

Failures: a judge that gives no verdict after its retries leaves the row
`{"status": "unscored", "error": ...}` with no `total`, never a silent 0.
- Up to `max_unscored` of the rows may be unscored: the output and sidecar are written, the
  unscored rows marked so, and `advantages` leaves them out (counting them).
- More than that, and the stage exits 1 leaving neither output nor sidecar (a pre-existing
  output is untouched), so `make` retries it. The rows that were scored go to `OUT.partial`
  (their rewards, keyed by id and a hash of the row and the scoring settings); a re-run takes
  them from there and asks the judge only about the rest, then removes it. With `-o -` there is
  no partial file (the judge's verdict cache still saves the calls).

Departures from the paper / released code:
1. The judge prompt is marscli's own wording of the paper's grading principles.
2. The judge sees the extracted answer, not the whole trajectory, and is asked about gold
   answers one at a time, stopping at the first Yes.

Nothing here imports torch or transformers (a test checks `marscli reward` in a subprocess).
"""

from __future__ import annotations

import hashlib
import re
import string
import sys
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import orjson

from marscli.agent.protocol import last_answer
from marscli.errors import BadInput, RuntimeFailure
from marscli.records.jsonl import follow_rows, get_field, iter_rows, read_rows
from marscli.records.outputs import AtomicJsonl
from marscli.records.provenance import stage_inputs, write_sidecar
from marscli.registry import Registry
from marscli.scoring.judge import Judge, JudgeError, JudgeOptions, make_judge
from marscli.scoring.release import (
    compute_score_em_for_mcq,
    em_check,
    last_turn,
    release_answer,
)
from marscli.secrets import redact

LETTERS = "ABCDE"
_PUNCT = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_BOXED = re.compile(r"\\boxed\{\s*\(?\s*([A-Ea-e])\s*\)?\s*\}")
# "answer is (c)", "answer: D", "correct answer is option B"; a lower-case letter only when
# bracketed or last ("the answer is a dog" is not option A)
_ANSWER_IS = re.compile(r"(?i:answer)\s*(?:(?i:is)\s*:?|:)\s*(?:(?i:option)\s*)?"
                        r"(?:\(([A-Ea-e])\)|([A-E])(?![\w])|([a-e])(?=\s*[.!]?\s*$))")
_LONE_LETTER = re.compile(r"(?<![\w])([A-E])(?![\w])")
_OPTION_LABEL = re.compile(r"^\s*\(?[A-Ea-e][.):]\s+")  # "A. cat", "(B) dog"


def normalize(s: str) -> str:
    """SQuAD normalisation, except that a lone "a" stays (it is the option letter A)."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCT)
    if s.strip() == "a":
        return "a"
    return " ".join(_ARTICLES.sub(" ", s).split())


def extract_choice(text: str, letters: str = LETTERS) -> str | None:
    """The option letter a response picks, upper case, or None. `letters` bounds the range
    (ABCD for four options)."""
    text = last_answer(text) or text
    candidates = [c for c in [_bare_letter(text, LETTERS)] if c]
    candidates += [m.upper() for m in _BOXED.findall(text)[-1:]]
    candidates += ["".join(m).upper() for m in _ANSWER_IS.findall(text)[-1:]]
    candidates += _LONE_LETTER.findall(text)[-1:]
    # the strongest signal decides; an out-of-range letter (E of four options) is wrong
    return candidates[0] if candidates and candidates[0] in letters else None


def _bare_letter(s: str, letters: str) -> str | None:
    """A bare letter, in range ("b", "(B)", "B.") -> "B"; else None."""
    bare = s.strip(string.punctuation + string.whitespace)
    return bare.upper() if len(bare) == 1 and bare.upper() in letters else None


def _letter_or_option(s: str, choices: list[str]) -> str | None:
    """A bare letter, or exactly an option's text (its "A." label optional) -> the letter."""
    letters = LETTERS[: len(choices)]
    texts = [normalize(_OPTION_LABEL.sub("", c)) for c in choices]
    norm = normalize(s)
    return _bare_letter(s, letters) or (letters[texts.index(norm)] if norm and norm in texts
                                        else None)


def gold_letters(gold_answers: list[str], choices: list[str]) -> set[str]:
    """Gold answers given as letters or as option texts, as letters."""
    return {c for c in (_letter_or_option(g, choices) for g in gold_answers) if c}


def score_answer(response_text: str, gold_answers: list[str],
                 choices: list[str] | None = None) -> float:
    """Exact-path accuracy (no judge): 1.0 or 0.0. Uses the last `<answer>` if there is one,
    else the whole text."""
    answer = last_answer(response_text)
    answer = response_text if answer is None else answer
    if choices:
        picked = _letter_or_option(answer, choices) or extract_choice(
            answer, LETTERS[: len(choices)])
        return float(picked is not None and picked in gold_letters(gold_answers, choices))
    pred = normalize(answer)
    return float(bool(pred) and any(pred == normalize(g) for g in gold_answers))


def response_answer(traj: dict) -> str | None:
    """The trajectory's final answer: `final_answer`, else the last model segment's tag."""
    if isinstance(traj.get("final_answer"), str):
        return traj["final_answer"]
    models = [s for s in traj.get("segments") or [] if s.get("role") == "model"]
    return last_answer(models[-1].get("text") or "") if models else None


def format_ok(traj: dict) -> bool:
    """Ended with a non-empty answer and made no invalid tool call. A backend failure
    (`failed: true`, e.g. a search server down) is not the model's mistake and costs nothing."""
    answer = response_answer(traj)
    if not answer or not answer.strip() or traj.get("stop", "answer") != "answer":
        return False
    return all(s.get("ok", True) is not False or s.get("failed") is True
               for s in traj.get("segments") or [] if s.get("role") == "tool")


# ----------------------------------------------------------------------------- the stage


def _validate(row: dict, src: str, line: int, judge: Judge) -> str | None:
    """Check the fields scoring needs; return the judge's image path (or None)."""
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


# One signature: accuracy(row, image, judge) -> 0.0 or 1.0; raises JudgeError when the judge
# gives no verdict.
ACCURACY: Registry = Registry("--protocol")


@ACCURACY.register("mars")
def accuracy_mars(row: dict, image: str | None, judge: Judge) -> float:
    """marscli's own scoring (the module docstring's points 1-4)."""
    gold, choices = row["answer_gt"], row.get("choices")
    answer = response_answer(row)
    acc = 0.0 if answer is None else score_answer(answer, gold, choices)
    if acc == 0.0 and answer and answer.strip() and not choices:
        acc = _ask_judge(judge, row.get("question", ""), gold, answer, image)
    return acc


@ACCURACY.register("release")
def accuracy_release(row: dict, image: str | None, judge: Judge) -> float:
    """The released code's scoring, on the last model turn."""
    acc, _ = release_accuracy(model_text(row), row["answer_gt"], bool(row.get("choices")),
                              row.get("question", ""), image, judge)
    return acc


def model_text(traj: dict) -> str:
    """The last assistant turn's text, what the release scores; a record with no model
    segment (answers imported from elsewhere) as its final answer in the tag."""
    models = [s for s in traj.get("segments") or [] if s.get("role") == "model"]
    if models:
        return models[-1].get("text") or ""
    answer = traj.get("final_answer")
    return f"<answer>{answer}</answer>" if isinstance(answer, str) else ""


def release_accuracy(text: str, gold: list[str], multiple_choice: bool, question: str,
                     image: str | None, judge: Judge,
                     allow_no_tag: bool = False) -> tuple[float, str]:
    """(accuracy, method) as the release scores `text`: `compute_score_em_for_mcq` for
    multiple choice; else `llm_score` (EM, then the judge about the tagged answer, 0 unasked
    when there is none). `allow_no_tag`: the release's inference evaluator, which shows the
    judge the whole last turn (up to `<|im_end|>`) when it has no tag."""
    if multiple_choice:
        return compute_score_em_for_mcq(text, gold), "letter"
    answer = release_answer(text)
    if answer is None and allow_no_tag:
        answer = last_turn(text).split("<|im_end|>")[0].strip()
    if answer is None:
        return 0.0, "no_answer"
    if em_check(answer, gold):
        return 1.0, "exact"
    if not judge.remote:
        return 0.0, "exact"
    return _ask_judge(judge, question, gold, answer, image), "judge"


def _score(row: dict, image: str | None, judge: Judge, format_weight: float,
           protocol: str = "mars") -> dict:
    fmt = format_weight if format_ok(row) else 0.0
    try:
        acc = ACCURACY.get(protocol)(row, image, judge)
    except JudgeError as e:
        return {"status": "unscored", "error": redact(str(e)), "format": fmt,
                "judge": judge.name}
    return {"total": acc + fmt, "accuracy": acc, "format": fmt, "judge": judge.name}


def _ask_judge(judge: Judge, question: str, gold: list[str], answer: str,
               image: str | None) -> float:
    """Any Yes scores 1; a failure only matters if no other gold answer got a Yes."""
    failure: JudgeError | None = None
    for g in gold:
        try:
            if judge.verdict(question, g, answer, image):
                return 1.0
        except JudgeError as e:
            failure = e
    if failure:
        raise failure
    return 0.0


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
    ACCURACY.get(protocol)  # an unknown name fails before any row is read
    known = known or {}
    checked = ((row, _validate(row, src, line, judge)) for line, row in rows)
    if isinstance(rows, list):
        checked = list(checked)

    def one(row: dict, image: str | None) -> tuple[str, dict]:
        key = row_key(row, judge.config(), format_weight, protocol)
        return key, known.get(key) or _score(row, image, judge, format_weight, protocol)

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
    with AtomicJsonl(str(partial_path(output))) as w:
        w.write_all(kept)
    return len(kept)


@stage_inputs()
def main(input: str, output: str = "-", judge_spec: str = "exact", format_weight: float = 0.5,
         max_unscored: float = 0.05, judge_timeout: float = 60.0, judge_retries: int = 2,
         judge_concurrency: int = 8, judge_cache: str | None = None,
         judge_backoff: float = 1.0, protocol: str = "mars",
         follow: bool = False) -> dict[str, Any]:
    """`marscli reward`: read, score, write all-or-nothing, write the sidecar. When too many
    rows are unscored: keep the scored ones in `OUT.partial`, write nothing else, and raise
    RuntimeFailure (exit 1). `follow`: score the input's rows as its writer appends them,
    until its sidecar appears (`jsonl.follow_rows`)."""
    if follow and input == "-":
        raise BadInput("--follow: needs a file that a stage is writing, not stdin (a pipe "
                       "already streams rows as they come)")
    started = time.time()
    opts = JudgeOptions(timeout_s=judge_timeout, attempts=judge_retries + 1,
                        concurrency=judge_concurrency, cache_path=judge_cache,
                        backoff_s=judge_backoff)
    ACCURACY.get(protocol)  # a bad name fails before the judge or the input is touched
    judge = make_judge(judge_spec, opts)  # a bad spec fails before the input is read
    try:
        rows = follow_rows(input) if follow else read_rows(input)
        out, stats = run(rows, input, judge, format_weight, max_unscored, judge_concurrency,
                         known=load_partial(output), protocol=protocol)
    finally:
        judge.close()
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
    print(f"reward: {stats['rows']} rows ({stats['protocol']} protocol), {scores}, "
          f"judge calls {stats['judge_calls']} "
          f"(cache hits {stats['cache_hits']}{reused}), unscored {stats['unscored']}",
          file=sys.stderr)
