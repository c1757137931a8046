"""Scoring protocols (`--protocol`): how one trajectory is scored, and how items add up.

One signature per protocol: `score(rec, ctx) -> dict` (the record's `score` field) and
`aggregate(bench, items) -> dict` (the summary's number for a set of items). An item is one
question; its accuracy is the mean over its scored samples (K with `--samples K`).

`mars` — marscli's own reading of the release's evaluation (`release` below is the release's
exact scoring):
1. The answer is the record's final `<answer>`. No answer (the trajectory hit a limit, or the
   model replied without the tag): 0, no judge asked. (The release falls back to the whole
   reply; marscli counts an untagged reply as no answer, which can only lower a score.)
2. Multiple choice (the row has `choices`, or the benchmark is V*, HR-Bench, MME-RealWorld):
   the option letter, by `rewards.extract_choice`, within A-D as in the release's extractor,
   A-E for MME-RealWorld (the release has no MME-RealWorld config and stops at D), and no
   further than the question's options. marscli also accepts the exact text of an option
   (the release does not). No judge.
3. Open questions: exact match after SQuAD normalisation against any gold answer; otherwise
   the judge (`--judge`; the release asks GPT-4o, `--judge exact` asks nobody and scores 0),
   once per gold answer until a Yes. A judge that gives no verdict leaves the record
   `{"status": "unscored"}`: excluded from accuracy, counted, and the stage exits 1 over
   `--max-unscored`.
4. Items add up as a plain mean.

`official` — each benchmark's own protocol where it has one, `mars` elsewhere:
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

`release` — the released code's validation scoring (`eval_single_node.sh`, verl's
`reward_score/tool.py`: `em_score_mcq` for V* and HR-Bench, `llm_score` for the search
benchmarks), by `rewards.release_accuracy` on the last model turn's text:
1. Multiple choice (`choices`, or V*, HR-Bench, MME-RealWorld): the release's letter
   extraction, A-D only (an E of MME-RealWorld scores 0), from the last turn's `<answer>`, its
   box, or the whole turn when it has neither; no option texts; no judge.
2. Open questions: the last `<answer>` after the last `</think>`/`</thinking>`; none scores 0
   and the judge is not asked. Else exact match (the release's normalisation), else the judge
   (`--judge`; the release asks gpt-4o-2024-11-20), once per gold answer until a Yes. A judge
   that gives no verdict leaves the record unscored, as under `mars` (the release stops).
3. Items add up as a plain mean, every benchmark (the release reports no F1, rotations or
   split means).
`release-inference` — the same, as the release's later `inference/eval.py` scores: an open
answer without a tag is the whole last turn (up to `<|im_end|>`), shown to the judge.
Under both, the judge's prompt is marscli's own (`judge.py`), not the release's 13 principles.
"""

from __future__ import annotations

import re
import string
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

from marscli.registry import Registry
from marscli.scoring.answers import (
    extract_choice,
    model_text,
    normalize,
    release_accuracy,
    response_answer,
    score_answer,
)
from marscli.scoring.judge import Judge, JudgeError
from marscli.secrets import redact


# What scoring needs to know of each benchmark.
@dataclass(frozen=True)
class Benchmark:
    name: str
    title: str
    multiple_choice: bool = False
    letters: str = "ABCD"  # the option letters the release's extractor knows
    official: str = "mars"  # the benchmark's own protocol: mars | token_f1 | rotations | infoseek


BENCHMARKS = {b.name: b for b in [
    Benchmark("mmsearch", "MMSearch", official="token_f1"),
    Benchmark("hr-mmsearch", "HR-MMSearch"),
    Benchmark("fvqa", "FVQA-test"),
    Benchmark("infoseek", "InfoSeek", official="infoseek"),
    Benchmark("simplevqa", "SimpleVQA-en"),
    Benchmark("livevqa", "LiveVQA"),
    Benchmark("mat-search", "MAT-Search"),
    Benchmark("vstar", "V* Bench", multiple_choice=True),
    Benchmark("hrbench-4k", "HR-Bench 4K", multiple_choice=True, official="rotations"),
    Benchmark("hrbench-8k", "HR-Bench 8K", multiple_choice=True, official="rotations"),
    Benchmark("hrbench", "HR-Bench", multiple_choice=True, official="rotations"),
    # The release has no MME-RealWorld config and its extractor stops at D; E is added here.
    Benchmark("mme-realworld", "MME-RealWorld", multiple_choice=True, letters="ABCDE"),
]}


def benchmark_info(name: str | None) -> Benchmark:
    """What is known of a benchmark; an unknown name is an open-question benchmark (multiple
    choice where its rows have `choices`, with letters up to E)."""
    return BENCHMARKS.get(name or "") or Benchmark(name or "unknown", name or "unknown",
                                                   letters="ABCDE")


@dataclass
class ScoreContext:
    judge: Judge
    base: Path  # the results file's folder: record image paths are relative to it


class Protocol:
    name = ""
    about = ""  # one line, printed under the summary: which scoring produced the numbers

    def score(self, rec: dict, ctx: ScoreContext) -> dict:
        raise NotImplementedError

    def aggregate(self, bench: str, items: list[dict]) -> dict:
        """How items add up: a plain mean unless the protocol says otherwise."""
        return plain_mean(items)


PROTOCOLS: Registry[type[Protocol]] = Registry("--protocol")


def make_protocol(name: str) -> Protocol:
    return PROTOCOLS.get(name)()


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


# --------------------------------------------------------------------------- item scoring


def _no_answer(rec: dict) -> dict | None:
    if rec.get("stop") == "engine_error":
        return {"status": "unscored", "error": f"engine_error: {rec.get('error') or 'unknown'}"}
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


def score_mars(rec: dict, ctx: ScoreContext) -> dict:
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
    failure = None
    image = _judge_image(rec, ctx.base)
    for g in gold:
        try:
            if ctx.judge.verdict(rec.get("question", ""), g, answer, image):
                return {"accuracy": 1.0, "method": "judge", "judge": ctx.judge.name}
        except JudgeError as e:
            failure = e
    if failure is not None:
        return {"status": "unscored", "error": redact(str(failure)), "judge": ctx.judge.name}
    return {"accuracy": 0.0, "method": "judge", "judge": ctx.judge.name}


def score_release(rec: dict, ctx: ScoreContext, allow_no_tag: bool = False) -> dict:
    """A record as the release's evaluators score it (the `release` protocol's points 1-2)."""
    if rec.get("stop") == "engine_error":
        return {"status": "unscored", "error": f"engine_error: {rec.get('error') or 'unknown'}"}
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
    early = _no_answer(rec)
    if early is not None:
        return early
    f1 = best_f1(response_answer(rec), _gold(rec))
    return {"accuracy": round(f1, 6), "method": "token_f1"}


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


@PROTOCOLS.register("mars")
class MarsProtocol(Protocol):
    name = "mars"
    about = ("marscli's scoring: the tagged answer; letters A-D (A-E for MME-RealWorld) or an "
             "option's text; exact match, then the judge")

    def score(self, rec: dict, ctx: ScoreContext) -> dict:
        return {"protocol": self.name, **score_mars(rec, ctx)}


@PROTOCOLS.register("official")
class OfficialProtocol(Protocol):
    name = "official"
    about = ("each benchmark's own: MMSearch token F1, HR-Bench rotations, InfoSeek ranges and "
             "split harmonic mean; mars elsewhere")

    def score(self, rec: dict, ctx: ScoreContext) -> dict:
        kind = benchmark_info(rec.get("benchmark")).official
        out = (score_token_f1(rec) if kind == "token_f1" else score_infoseek(rec)
               if kind == "infoseek" else score_mars(rec, ctx))
        return {"protocol": self.name, **out}

    def aggregate(self, bench: str, items: list[dict]) -> dict:
        kind = benchmark_info(bench).official
        if kind == "rotations":
            return rotation_mean(items)
        if kind == "infoseek":
            return split_harmonic_mean(items)
        out = plain_mean(items)
        if kind == "token_f1":
            out["metric"] = "mean token F1"
        return out


@PROTOCOLS.register("release")
class ReleaseProtocol(Protocol):
    name = "release"
    about = ("the release's validation scoring (eval_single_node.sh, verl tool.py): letters A-D "
             "from the last turn; open answers need the tag, then exact match, then the judge")

    def score(self, rec: dict, ctx: ScoreContext) -> dict:
        return {"protocol": self.name, **score_release(rec, ctx)}


@PROTOCOLS.register("release-inference")
class ReleaseInferenceProtocol(Protocol):
    name = "release-inference"
    about = ("the release's inference/eval.py scoring: as release, but an untagged open answer "
             "is the whole last turn, shown to the judge")

    def score(self, rec: dict, ctx: ScoreContext) -> dict:
        return {"protocol": self.name, **score_release(rec, ctx, allow_no_tag=True)}


def protocol_names() -> list[str]:
    return PROTOCOLS.names()


__all__ = ["PROTOCOLS", "Protocol", "ScoreContext", "best_f1", "harmonic_mean",
           "in_numeric_range", "make_protocol", "parse_numeric", "protocol_names",
           "score_choice", "score_release", "squad_normalize", "token_f1"]
