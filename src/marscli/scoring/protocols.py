"""Scoring protocols (`--protocol`): how `marscli eval` and `marscli reward` score an answer.

| protocol | eval | reward | an answer scores |
|---|---|---|---|
| `mars` | default | default | marscli's: the tagged answer; multiple choice by its option \
letter or an option's text, no judge; open by exact match, then the judge |
| `official` | yes | - | each benchmark's own: MMSearch token F1, InfoSeek numeric ranges \
or exact match (no judge), `mars` elsewhere; HR-Bench adds up by option rotation, InfoSeek by \
the harmonic mean of its splits |
| `release` | yes | yes | the released code's: the last turn; letters A-D from its tag, box \
or text; open by the tag after the thinking, exact match, then the judge |
| `release-inference` | yes | - | as `release`, but an untagged open answer is the whole \
last turn, shown to the judge |

One registry, `PROTOCOLS`, for both stages. An entry (`Protocol`) says, for one name:
- `score(rec, ctx) -> dict`: an eval record's `score` field: `accuracy` and `method`, or
  `{"status": "unscored", "error": ...}` when the judge gave no verdict or the engine failed;
- `aggregate(bench, items) -> dict`: a benchmark's number from its items (an item is one
  question; its accuracy is the mean over its scored samples, K with `--samples K`);
- `reward(row, image, judge) -> float`: a reward's accuracy, 0 or 1 (`JudgeError` when the
  judge gave no verdict: the stage marks the row unscored), or None where `marscli reward`
  does not offer the protocol. `reward.total` adds the format reward, the same under every
  protocol (`stages/reward.py`).
`eval --protocol NAME` looks NAME up with `make_protocol`, `reward --protocol NAME` with
`reward_protocol`, which refuses the eval-only names; a name both take is one entry. The
primitives the entries call: `answers.py` (marscli's normalisation, letters, exact match, the
judge asked per gold answer), `release.py` (the release's) and `judge.py`; what scoring knows
of each benchmark (multiple choice, letters, its own protocol) is what its loader module
declares (`benchmarks.benchmark_info`).

`mars` — marscli's own reading of the paper's scoring (`release` is the release's code):
1. The answer is the trajectory's final `<answer>` (`final_answer`, else the last model
   segment's tag). No answer (the trajectory hit a limit, or the model replied without the
   tag): 0, no judge asked. (The release falls back to the whole reply; marscli counts an
   untagged reply as no answer, which can only lower a score.)
2. Multiple choice (the row has `choices`; under eval also every V*, HR-Bench and
   MME-RealWorld record): the option letter, by `answers.extract_choice` (a bare letter,
   `\\boxed{X}`, "answer is (X)", the last standalone capital), or the exact text of an option
   (the release accepts letters only); right when it names a gold option (gold answers given
   as letters or option texts). Letters up to E and no further than the question's options;
   eval also bounds them by the benchmark: A-D as in the release's extractor, A-E for
   MME-RealWorld (the release has no MME-RealWorld config and stops at D). No judge.
3. Open questions: exact match with any gold answer after SQuAD normalisation (lower case, no
   punctuation, no articles, single spaces; a lone "a" stays, so the letter A survives);
   otherwise the judge (`--judge`; the release asks GPT-4o, `--judge exact` asks nobody and
   scores 0), once per gold answer until a Yes. A judge that gives no verdict leaves the
   record unscored: excluded from accuracy, counted, and the stage exits 1 over
   `--max-unscored`; never a silent 0.
4. Items add up as a plain mean.
Eval only: a record whose engine failed (`stop` "engine_error") is unscored (one whose prompt
was refused, `stop` "prompt_too_long", scores 0 without a judge call, as in `reward`); a
reward row is scored whatever its stop (its format reward is 0).

`official` (eval only) — each benchmark's own protocol where it has one, `mars` elsewhere:
- MMSearch: token-level F1 (SQuAD tokens, best over the gold answer and its alternatives)
  as the score itself, no threshold, no judge. (MMSearch's end2end script scores against
  `gt_answer` only; marscli also takes the alternatives.)
- HR-Bench: accuracy per option rotation (`cycle_category`), then the mean over rotations
  (VLMEvalKit / HR-Bench's own `evaluate`), per category likewise. With equal rotation sizes
  this equals the plain mean; it differs when rotations are incomplete (a shard, a subset).
- InfoSeek (the official infoseek_eval.py): numerical questions are right when the answer's
  number lies in the gold range (`answer_eval[0].range`, else the value ±10%), or its
  "a - b" range lies inside it or overlaps it with IoU >= 0.5; string and time questions need
  an exact match (SQuAD normalisation) with one of `answer_eval`; no judge. The benchmark
  score is the harmonic mean of the accuracies of the unseen_question and unseen_entity
  splits (`data_split`); without split labels, the plain mean, with a note.

`release` — the released code's scoring (`eval_single_node.sh`, verl's `reward_score/tool.py`:
`em_score_mcq` for V* and HR-Bench, `llm_score` for the search benchmarks), by
`release_accuracy` on the last model turn's text (a record without model segments, answers
imported from elsewhere, as `<answer>final_answer</answer>`); `release.py` lists where the
release's letters and exact match differ from `mars`:
1. Multiple choice (`choices`; under eval also V*, HR-Bench, MME-RealWorld): the release's
   letter extraction, A-D only (an E of MME-RealWorld scores 0), from the last turn's
   `<answer>`, its box, or the whole turn when it has neither; no option texts; no judge.
2. Open questions: the last `<answer>` after the last `</think>`/`</thinking>`; none scores 0
   and the judge is not asked. Else exact match (the release's normalisation), else the judge
   (`--judge`; the release asks gpt-4o-2024-11-20), once per gold answer until a Yes. A judge
   that gives no verdict leaves the record unscored, as under `mars` (the release stops).
3. Items add up as a plain mean, every benchmark (the release reports no F1, rotations or
   split means).
`release-inference` (eval only) — the same, as the release's later `inference/eval.py`
scores: an open answer without a tag is the whole last turn (up to `<|im_end|>`), shown to the
judge.

Under every protocol the judge's prompt is marscli's own wording of the paper's grading
principles (`judge.py`), not the release's 13 principles, and the judge sees the extracted
answer, not the whole trajectory.
"""

from __future__ import annotations

import re
import string
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from marscli.benchmarks import benchmark_info
from marscli.errors import unknown_name
from marscli.registry import Registry
from marscli.scoring.answers import (
    ask_judge,
    extract_choice,
    model_text,
    normalize,
    response_answer,
    score_answer,
)
from marscli.scoring.judge import Judge, JudgeError, judge_tally
from marscli.scoring.release import (
    compute_score_em_for_mcq,
    em_check,
    last_turn,
    release_answer,
)
from marscli.secrets import redact


@dataclass
class ScoreContext:
    judge: Judge
    base: Path  # the results file's folder: record image paths are relative to it


# --------------------------------------------------------------------------- text metrics

_ARTICLES = re.compile(r"\b(a|an|the)\b")


def squad_normalize(s: str) -> str:
    """SQuAD's answer normalisation, as MMSearch and InfoSeek use it (no exception for "a")."""
    s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
    return " ".join(_ARTICLES.sub(" ", s).split())


def token_f1(prediction: str, gold: str) -> float:
    pred, ref = squad_normalize(prediction).split(), squad_normalize(gold).split()
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    p, r = common / len(pred), common / len(ref)
    return 2 * p * r / (p + r)


def best_f1(prediction: str, golds: list[str]) -> float:
    return max((token_f1(prediction, g) for g in golds), default=0.0)


_NUMBER = re.compile(r"[-+]?[.]?[\d]+(?:,\d\d\d)*[\.]?\d*(?:[eE][-+]?\d+)?")


def parse_numeric(text: str) -> float | list[float]:
    """InfoSeek's reading of a numerical answer: one number, or [lo, hi] when it gives a range
    ("9-10", "between 3 and 4"); [0, 0] when there is no number."""
    text = re.sub(r"(?<=\d)-", " - ", text)
    nums = []
    for n in _NUMBER.findall(text)[:2]:
        n = n.replace(",", "").strip(".")
        nums.append(float(n.split(".")[0] if n.count(".") > 1 else n))
    if len(nums) == 2:
        return nums if nums[0] <= nums[1] else nums[0]
    return nums[0] if nums else [0.0, 0.0]


def in_numeric_range(pred: float | list[float], gold: float | list[float],
                     tolerance: float = 0.1) -> bool:
    """InfoSeek's numerical metric: a single gold value becomes value ±10%."""
    if not isinstance(gold, list):
        gold = sorted([gold * (1 - tolerance), gold * (1 + tolerance)])
    lo, hi = gold
    if not isinstance(pred, list):
        return lo <= pred <= hi
    if lo <= pred[0] <= hi and lo <= pred[1] <= hi:
        return True
    overlap = max(0.0, min(pred[1], hi) - max(pred[0], lo))
    union = (pred[1] - pred[0] + 1e-12) + (hi - lo + 1e-12) - overlap
    return overlap / union >= 0.5 - 1e-12 if union else False


def harmonic_mean(values: list[float]) -> float:
    """InfoSeek's: a zero counts as 1e-12 (so the mean is ~0, not an error)."""
    safe = [v if v != 0 else 1e-12 for v in values]
    return len(safe) / sum(1.0 / v for v in safe)


# --------------------------------------------------------------------------- eval: one record


def _no_answer(rec: dict) -> dict | None:
    if rec.get("stop") == "engine_error":
        return {"status": "unscored", "error": f"engine_error: {rec.get('error') or 'unknown'}"}
    if rec.get("stop") == "prompt_too_long":  # refused, nothing generated: wrong, no judge
        return {"accuracy": 0.0, "method": "prompt_too_long"}
    answer = response_answer(rec)
    if answer is None or not answer.strip():
        return {"accuracy": 0.0, "method": "no_answer"}
    return None


def _gold(rec: dict) -> list[str]:
    gold = rec.get("answer_gt") or []
    return [g for g in (gold if isinstance(gold, list) else [gold]) if isinstance(g, str)]


def _letters(rec: dict) -> str:
    letters = benchmark_info(rec.get("benchmark")).letters
    choices = rec.get("choices")
    return letters[: len(choices)] if choices else letters


def score_choice(answer: str, gold: list[str], choices: list[str] | None, letters: str) -> float:
    """A multiple-choice answer: its letter (or, with `choices`, an option's exact text)."""
    if choices:
        if len(choices) > len(letters):  # more options than the extractor knows
            choices = choices[: len(letters)]
        return score_answer(answer, gold, choices)
    picked = extract_choice(answer, letters)
    golds = {g.strip().strip("()[]. ").upper() for g in gold}
    return float(picked is not None and picked in golds)


def _judge_image(rec: dict, base: Path) -> str | None:
    images = rec.get("images") or []
    rel = images[0].get("path") if images and isinstance(images[0], dict) else None
    if not isinstance(rel, str):
        return None
    path = base / rel
    return str(path) if path.is_file() else None


def eval_mars(rec: dict, ctx: ScoreContext) -> dict:
    """A record under `mars` (the module docstring's points 1-3)."""
    early = _no_answer(rec)
    if early is not None:
        return early
    answer, gold = response_answer(rec), _gold(rec)
    bench = benchmark_info(rec.get("benchmark"))
    if rec.get("choices") or bench.multiple_choice:
        acc = score_choice(answer, gold, rec.get("choices"), _letters(rec))
        return {"accuracy": acc, "method": "letter"}
    if any(normalize(answer) == normalize(g) for g in gold):
        return {"accuracy": 1.0, "method": "exact"}
    if not ctx.judge.remote:
        return {"accuracy": 0.0, "method": "exact", "judge": ctx.judge.name}
    try:
        acc = ask_judge(ctx.judge, rec.get("question", ""), gold, answer,
                        _judge_image(rec, ctx.base))
    except JudgeError as e:
        return {"status": "unscored", "error": redact(str(e)), "judge": ctx.judge.name}
    return {"accuracy": acc, "method": "judge", "judge": ctx.judge.name}


def eval_release(rec: dict, ctx: ScoreContext, allow_no_tag: bool = False) -> dict:
    """A record as the release's evaluators score it (the `release` protocol's points 1-2)."""
    early = _no_answer(rec) if rec.get("stop") in ("engine_error", "prompt_too_long") else None
    if early is not None:
        return early
    mcq = bool(rec.get("choices")) or benchmark_info(rec.get("benchmark")).multiple_choice
    try:
        acc, method = release_accuracy(model_text(rec), _gold(rec), mcq,
                                       rec.get("question", ""), _judge_image(rec, ctx.base),
                                       ctx.judge, allow_no_tag=allow_no_tag)
    except JudgeError as e:
        return {"status": "unscored", "error": redact(str(e)), "judge": ctx.judge.name}
    asked = method == "judge" or (method == "exact" and acc == 0.0)
    return {"accuracy": acc, "method": method, **({"judge": ctx.judge.name} if asked else {})}


def _infoseek_range(rec: dict) -> float | list[float] | None:
    """The gold range of a numerical InfoSeek question, or None when it is not numerical."""
    qtype = str(rec.get("question_type") or "").lower()
    ev = rec.get("answer_eval")
    first = ev[0] if isinstance(ev, list) and ev else ev
    if isinstance(first, dict):
        if isinstance(first.get("range"), list) and len(first["range"]) >= 2:
            return sorted(float(x) for x in first["range"][:2])
        if first.get("wikidata") is not None:
            return float(first["wikidata"])
    if qtype == "numerical":  # a numerical question without a range: its value ±10%
        for g in ([str(x) for x in ev] if isinstance(ev, list) else []) + _gold(rec):
            v = parse_numeric(g)
            if not isinstance(v, list):
                return v
            if v != [0.0, 0.0]:
                return v
    return None


def score_infoseek(rec: dict) -> dict:
    """An InfoSeek record under `official`: numeric range, else exact match; no judge."""
    early = _no_answer(rec)
    if early is not None:
        return early
    answer = response_answer(rec)
    gold_range = _infoseek_range(rec)
    if gold_range is not None:
        ok = in_numeric_range(parse_numeric(answer), gold_range)
        return {"accuracy": float(ok), "method": "numeric_range"}
    ev = rec.get("answer_eval")
    golds = [str(x) for x in ev if isinstance(x, (str, int, float))] if isinstance(ev, list) \
        else []
    golds = golds or _gold(rec)
    ok = any(squad_normalize(answer) == squad_normalize(g) for g in golds)
    return {"accuracy": float(ok), "method": "exact"}


def score_token_f1(rec: dict) -> dict:
    """An MMSearch record under `official`: the best token F1 is the score; no judge."""
    early = _no_answer(rec)
    if early is not None:
        return early
    f1 = best_f1(response_answer(rec), _gold(rec))
    return {"accuracy": round(f1, 6), "method": "token_f1"}


def eval_official(rec: dict, ctx: ScoreContext) -> dict:
    """A record under `official`: its benchmark's own scoring, else `mars`."""
    kind = benchmark_info(rec.get("benchmark")).official
    if kind == "token_f1":
        return score_token_f1(rec)
    if kind == "infoseek":
        return score_infoseek(rec)
    return eval_mars(rec, ctx)


# --------------------------------------------------------------------------- reward: one row
# A reward row has passed the stage's checks (answer_gt, choices) and its judge image, if any,
# exists; eval records come as they were written, so the eval scorers above check for
# themselves.


def reward_mars(row: dict, image: str | None, judge: Judge) -> float:
    """A reward's accuracy under `mars` (the module docstring's points 1-3; `choices` alone
    makes a question multiple choice, letters up to E)."""
    gold, choices = row["answer_gt"], row.get("choices")
    answer = response_answer(row)
    acc = 0.0 if answer is None else score_answer(answer, gold, choices)
    if acc == 0.0 and answer and answer.strip() and not choices:
        acc = ask_judge(judge, row.get("question", ""), gold, answer, image)
    return acc


def reward_release(row: dict, image: str | None, judge: Judge) -> float:
    """A reward's accuracy under `release`: the release's scoring of the last model turn."""
    acc, _ = release_accuracy(model_text(row), row["answer_gt"], bool(row.get("choices")),
                              row.get("question", ""), image, judge)
    return acc


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
    return ask_judge(judge, question, gold, answer, image), "judge"


# --------------------------------------------------------------------------- aggregation


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _pct(x: float | None) -> float | None:
    return None if x is None else round(100 * x, 2)


def plain_mean(items: list[dict]) -> dict:
    scored = [it["accuracy"] for it in items if it["accuracy"] is not None]
    return {"accuracy": _pct(_mean(scored)), "metric": "accuracy"}


def rotation_mean(items: list[dict]) -> dict:
    groups: dict[str, list[float]] = defaultdict(list)
    for it in items:
        if it["accuracy"] is not None:
            groups[str(it.get("cycle_category") or "-")].append(it["accuracy"])
    per = {k: _mean(v) for k, v in sorted(groups.items())}
    acc = _mean(list(per.values()))
    return {"accuracy": _pct(acc), "metric": "mean over option rotations",
            "rotations": {k: {"accuracy": _pct(v), "items": len(groups[k])}
                          for k, v in per.items()}}


def split_harmonic_mean(items: list[dict]) -> dict:
    groups: dict[str, list[float]] = defaultdict(list)
    for it in items:
        if it["accuracy"] is None:
            continue
        split = str(it.get("data_split") or "")
        key = ("unseen_question" if split.endswith("unseen_question") else
               "unseen_entity" if split.endswith("unseen_entity") else "")
        groups[key].append(it["accuracy"])
    splits = {k: _mean(v) for k, v in groups.items() if k}
    if set(splits) == {"unseen_question", "unseen_entity"} and not groups.get(""):
        return {"accuracy": _pct(harmonic_mean(list(splits.values()))),
                "metric": "harmonic mean of the unseen_question and unseen_entity accuracies",
                "splits": {k: {"accuracy": _pct(v), "items": len(groups[k])}
                           for k, v in sorted(splits.items())}}
    out = plain_mean(items)
    out["note"] = ("split labels (data_split unseen_question / unseen_entity) missing or "
                   "incomplete: plain mean, not the harmonic mean of the splits")
    return out


def plain_mean_of(bench: str, items: list[dict]) -> dict:
    """Items add up as a plain mean, whatever the benchmark."""
    return plain_mean(items)


def official_mean(bench: str, items: list[dict]) -> dict:
    """Items add up as the benchmark's own protocol says (`official`)."""
    kind = benchmark_info(bench).official
    if kind == "rotations":
        return rotation_mean(items)
    if kind == "infoseek":
        return split_harmonic_mean(items)
    out = plain_mean(items)
    if kind == "token_f1":
        out["metric"] = "mean token F1"
    return out


# --------------------------------------------------------------------------- the registry


@dataclass(frozen=True)
class Protocol:
    """One scoring protocol, as both stages that score use it (the module docstring)."""

    name: str
    about: str  # one line, printed under the eval summary: which scoring produced the numbers
    scorer: Callable[[dict, ScoreContext], dict]  # eval: a record's score, less its protocol
    adder: Callable[[str, list[dict]], dict] = plain_mean_of  # eval: a benchmark's number
    # reward: accuracy(row, image, judge), 0 or 1; None: `marscli reward` does not offer it
    reward: Callable[[dict, str | None, Judge], float] | None = None

    def score(self, rec: dict, ctx: ScoreContext) -> dict:
        """The record's score, with what it took of the judge (`judge_calls`, when any)."""
        with judge_tally() as calls:
            out = self.scorer(rec, ctx)
        return {"protocol": self.name, **out, **calls.fields()}

    def aggregate(self, bench: str, items: list[dict]) -> dict:
        return self.adder(bench, items)


PROTOCOLS: Registry[Protocol] = Registry("--protocol")


def _register(protocol: Protocol) -> None:
    PROTOCOLS.register(protocol.name)(protocol)


_register(Protocol(
    "mars", scorer=eval_mars, reward=reward_mars,
    about=("marscli's scoring: the tagged answer; letters A-D (A-E for MME-RealWorld) or an "
           "option's text; exact match, then the judge")))
_register(Protocol(
    "official", scorer=eval_official, adder=official_mean,
    about=("each benchmark's own: MMSearch token F1, HR-Bench rotations, InfoSeek ranges and "
           "split harmonic mean; mars elsewhere")))
_register(Protocol(
    "release", scorer=eval_release, reward=reward_release,
    about=("the release's validation scoring (eval_single_node.sh, verl tool.py): letters A-D "
           "from the last turn; open answers need the tag, then exact match, then the judge")))
_register(Protocol(
    "release-inference", scorer=partial(eval_release, allow_no_tag=True),
    about=("the release's inference/eval.py scoring: as release, but an untagged open answer "
           "is the whole last turn, shown to the judge")))


def make_protocol(name: str) -> Protocol:
    """`eval --protocol NAME`: any protocol; an unknown name lists them all."""
    return PROTOCOLS.get(name)


def reward_protocol(name: str) -> Protocol:
    """`reward --protocol NAME`: a protocol with a `reward`; any other name is refused listing
    the ones `marscli reward` takes."""
    if name not in reward_protocol_names():
        raise unknown_name(PROTOCOLS.kind, name, reward_protocol_names())
    return PROTOCOLS.get(name)


def protocol_names() -> list[str]:
    return PROTOCOLS.names()


def reward_protocol_names() -> list[str]:
    return [n for n in PROTOCOLS.names() if PROTOCOLS.get(n).reward is not None]


__all__ = ["PROTOCOLS", "Protocol", "ScoreContext", "best_f1", "eval_mars", "eval_official",
           "eval_release", "harmonic_mean", "in_numeric_range", "make_protocol", "parse_numeric",
           "protocol_names",
           "release_accuracy", "reward_mars", "reward_protocol", "reward_protocol_names",
           "reward_release", "score_choice", "squad_normalize", "token_f1"]
