"""Answer primitives, shared by the protocols (`protocols.py`) and the reward stage
(`stages/reward.py`): SQuAD-style normalisation (keeping a lone "a", the letter A), the option
letter a response picks, exact match against gold answers, a trajectory's final answer and
whether its format is clean, and asking a judge about each gold answer in turn.

Nothing here imports torch or transformers.
"""

from __future__ import annotations

import re
import string

from marscli.agent.protocol import last_answer
from marscli.scoring.judge import Judge, JudgeError

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


def model_text(traj: dict) -> str:
    """The last assistant turn's text, what the release scores; a record with no model
    segment (answers imported from elsewhere) as its final answer in the tag."""
    models = [s for s in traj.get("segments") or [] if s.get("role") == "model"]
    if models:
        return models[-1].get("text") or ""
    answer = traj.get("final_answer")
    return f"<answer>{answer}</answer>" if isinstance(answer, str) else ""


def ask_judge(judge: Judge, question: str, gold: list[str], answer: str,
              image: str | None) -> float:
    """The judge asked about each gold answer in turn: any Yes scores 1 (no more asked), all
    No 0. A failure (`JudgeError`) is raised only if no gold answer got a Yes, since one Yes
    settles the score whatever the others would have said."""
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

