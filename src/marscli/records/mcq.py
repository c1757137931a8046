"""Multiple-choice questions whose options are written in the question: finding them.

Shared by the prompt loader (MARS training rows put the options in the question) and the
benchmark loaders (V* Bench, the release's evaluation rows). Options are lettered A-E and
come in order, one per line (`(A) red`, `A. red`, `A) red`, `A: red`) or inline after the
stem (`... (A) red (B) blue`); anything after the last option line (an instruction) is
dropped from the stem. Fewer than two options: not a multiple-choice question.
"""

from __future__ import annotations

import itertools
import re

LETTERS = "ABCDE"
_OPTION_LINE = re.compile(r"^\s*\(?([A-Ea-e])[.):]\s*(.+?)\s*$")
_INLINE = re.compile(r"\(([A-E])\)\s*")


def split_options(text: str) -> tuple[str, list[str]]:
    """A question with its options inline → (stem, options); no options → (text, [])."""
    stem, options = _by_lines(text)
    if len(options) >= 2:
        return stem, options
    stem, options = _inline(text)
    if len(options) >= 2:
        return stem, options
    return text, []


def _by_lines(text: str) -> tuple[str, list[str]]:
    stem, options = [], []
    for line in text.splitlines():
        m = _OPTION_LINE.match(line)
        expected = LETTERS[len(options)] if len(options) < len(LETTERS) else None
        if m and m[1].upper() == expected:
            options.append(m[2])
        elif options:
            break  # the instruction after the options
        elif line.strip().lower() not in ("options:", "choices:"):
            stem.append(line)
    return "\n".join(stem).strip(), options


def _inline(text: str) -> tuple[str, list[str]]:
    """`Stem? (A) x (B) y`: the markers must run A, B, C... in order."""
    run: list[re.Match] = []
    for m in _INLINE.finditer(text):
        if len(run) < len(LETTERS) and m[1] == LETTERS[len(run)]:
            run.append(m)
    if len(run) < 2:
        return text, []
    options = [text[a.end():b.start()].strip() for a, b in itertools.pairwise(run)]
    tail = text[run[-1].end():].splitlines()
    options.append(tail[0].strip() if tail else "")
    return text[:run[0].start()].strip(), options


def mcq_choices(question: str, gold: list[str]) -> list[str] | None:
    """The options of a question whose single gold answer is one of their letters (`B`,
    `(B)`); None for any other question."""
    if len(gold) != 1:
        return None
    letter = gold[0].strip().strip("()[]. ").upper()
    _, options = split_options(question)
    if len(letter) != 1 or letter not in LETTERS[:len(options)]:
        return None
    return options
