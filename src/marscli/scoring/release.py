"""Exact-match scoring as the released SenseNova-MARS code scores (`reward --protocol release`).

Re-implemented from the behaviour of the release's `verl/verl/utils/reward_score/tool.py`
(`compute_score_em`, `compute_score_em_for_mcq`, `extract_solution_for_mcq`), not copied:
- The text scored is the last assistant turn: what follows the last `<|im_start|>assistant`
  (the release decodes the whole multi-turn response without skipping special tokens), then what
  follows the last `</think>` or `</thinking>` in it. A bare last turn (no header) is used as is.
- Open answers (`compute_score_em`): the last `<answer>...</answer>` of that text, stripped; none
  scores 0. Normalisation: lower case, punctuation removed, then the articles a/an/the removed
  unless the whole text is "a", then whitespace collapsed; 1 when it equals any normalised gold.
- Multiple choice (`compute_score_em_for_mcq`, used when the row has `choices`): a letter A-D is
  extracted (`extract_solution_for_mcq`) and compared with the gold answers by the same
  normalised exact match, so the gold answers must be letters, as in the release's MCQ rows.
  The candidate text is the last `<answer>` content; else the first `\\boxed{...}` whose content
  holds any of a-d/A-D; else the whole turn. From a tag or box: the content being one letter;
  else the last `(X)`, `[X]`, `X.`, `X)` or `X]` (either case, not after a letter); else the last
  capital A-D standing alone; else none (no fall-back to the whole turn). From the whole turn,
  the last match of the first rule that matches: "Answer: (X)"; "answer is (X)" / "correct answer
  is (X)"; a `(X)` inside a `**bold**` span; any `(X)`; `X)` or `X]`; a standalone capital A-D.
- `score_release(response_text, ground_truth, choices)` returns 1.0 or 0.0; no judge is asked here.
  The release's LLM judge (`llm_score`: EM first, else the judge) sees `release_answer(text)` and
  scores 0 without asking when it is None; asking it is `protocols.release_accuracy`'s business.

Where marscli's own protocol (`protocols.py`'s `mars`) scores differently, and `--protocol release`
follows the release:
1. No `<answer>` tag in the last turn: marscli scores 0; the release, for multiple choice,
   extracts a letter from the whole turn after the last `</think>`/`</thinking>`.
2. An option's text ("dog" for option B): marscli accepts it; the release scores 0 (it only
   looks for letters, and a lower-case word holds no standalone capital).
3. Letters: marscli reads A-E, bounded by the number of choices; the release reads A-D only, so an
   answer E of a five-option question scores 0.
4. `\\boxed{}`: marscli reads `\\boxed{X}` holding one letter (the last one); the release takes
   the first box whose content holds any a-d/A-D character ("\\boxed{Paris}" qualifies and yields
   no letter) and does not look elsewhere once it has one.
5. Which letter wins: marscli takes the strongest signal (a bare letter, a box, "answer is X",
   the last lone capital); the release takes the last match of its first matching rule, and its
   bracket rule reads lower case. "<answer>The answer is C, not (D)</answer>" is C for marscli
   and D for the release; "<answer>(b) is my pick</answer>" is no pick for marscli and B for
   the release.
6. Gold answers given as option texts: marscli maps them to letters; the release compares the
   extracted letter with the gold strings as they are, so such a row never scores.
7. Open answers: the same normalisation. marscli scores an empty answer 0 whatever the gold; the
   release compares it like any other string. marscli reads the answer after the turn's first
   thinking block (`protocol.parse_turn`), the release after the last `</think>`/`</thinking>`.
Nothing here imports torch or transformers.
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Iterable

_ASSISTANT = "<|im_start|>assistant"
_THINK_END = re.compile(r"</think(?:ing)?>")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)
_BOXED = re.compile(r"\\boxed\{([^}]+)\}", re.I)
_ANY_LETTER = re.compile(r"[A-Da-d]")
_STANDALONE = re.compile(r"(?<![A-Za-z])([A-D])(?![A-Za-z])")  # capitals only, as released
_PUNCT = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")

# Inside an <answer> tag or a box: "(b)", "[C]", "A.", "d)", "B]" (either case, not after a
# letter), then a standalone capital.
_TAG_RULES: tuple[re.Pattern, ...] = (
    re.compile(r"\(([A-D])\)|\[([A-D])\]|(?<![A-Za-z])([A-D])[.)\]]", re.I),
    _STANDALONE,
)


def _bold_parens(text: str) -> list[str]:
    """The first `(X)` of each `**bold**` span, in order."""
    found = (re.search(r"\(([A-D])\)", seg, re.I) for seg in re.findall(r"\*\*[^*]+\*\*", text))
    return [m.group(1) for m in found if m]


# Over the whole turn, most explicit first ("X." is left out: it would match "data.").
_TURN_RULES: tuple[re.Pattern | Callable[[str], list[str]], ...] = (
    re.compile(r"Answer:\s*\(([A-D])\)", re.I),
    re.compile(r"(?:correct answer is|answer is)[:\s]*\(([A-D])\)", re.I),
    _bold_parens,
    re.compile(r"\(([A-D])\)", re.I),
    re.compile(r"(?<![A-Za-z])([A-D])[)\]]", re.I),
    _STANDALONE,
)


def last_turn(response_text: str) -> str:
    """What the release scores: the last assistant turn, after its last thinking close."""
    turn = response_text.rsplit(_ASSISTANT, 1)[-1]
    return _THINK_END.split(turn)[-1]


def release_answer(response_text: str) -> str | None:
    """The answer the release scores (and shows its judge): the last `<answer>` of the last turn
    after its thinking; None when there is none (the release's judge then scores 0 unasked)."""
    return extract_answer(last_turn(response_text))


def extract_answer(text: str) -> str | None:
    """The last `<answer>` content, stripped, or None."""
    found = _ANSWER_TAG.findall(text)
    return found[-1].strip() if found else None


def normalize_answer(s: str) -> str:
    """Lower case, no punctuation, no articles (unless the text is just "a"), single spaces."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCT)
    if s.strip() != "a":
        s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def em_check(prediction: str, gold: str | Iterable[str]) -> bool:
    golds = [gold] if isinstance(gold, str) else list(gold)
    pred = normalize_answer(prediction)
    return any(normalize_answer(g) == pred for g in golds)


def extract_solution_for_mcq(text: str) -> str | None:
    """The option letter (A-D, upper case) the release reads in `text`, or None."""
    tagged = extract_answer(text)
    if tagged is None:
        box = _BOXED.search(text)
        if box and _ANY_LETTER.search(box.group(1)):
            tagged = box.group(1).strip()
    if tagged is None:
        return _first_rule_last_match(_TURN_RULES, text)
    if len(tagged) == 1 and _ANY_LETTER.fullmatch(tagged):
        return tagged.upper()
    return _first_rule_last_match(_TAG_RULES, tagged)


def _first_rule_last_match(rules: Iterable, text: str) -> str | None:
    """The last match of the first rule that matches at all, upper case."""
    for rule in rules:
        hits = rule(text) if callable(rule) else [next(g for g in m.groups() if g)
                                                   for m in rule.finditer(text)]
        if hits:
            return hits[-1].upper()
    return None


def compute_score_em(response_text: str, ground_truth: str | list[str]) -> float:
    answer = release_answer(response_text)
    return float(answer is not None and em_check(answer, ground_truth))


def compute_score_em_for_mcq(response_text: str, ground_truth: str | list[str]) -> float:
    letter = extract_solution_for_mcq(last_turn(response_text))
    return float(letter is not None and em_check(letter, ground_truth))


def score_release(response_text: str, ground_truth: list[str],
                  choices: list[str] | None = None) -> float:
    """Accuracy as the release's exact scoring gives it: MCQ when the row has choices."""
    if choices:
        return compute_score_em_for_mcq(response_text, ground_truth)
    return compute_score_em(response_text, ground_truth)
