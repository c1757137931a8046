"""Scoring as the released SenseNova-MARS code scores: each extraction path, by hand-made cases.

The expected values were also checked against a transcription of the release's own functions on
300,000 random strings built from tags, letters and phrases (no difference).
"""

from __future__ import annotations

import pytest

from marscli.scoring.release import (
    extract_solution_for_mcq,
    last_turn,
    normalize_answer,
    release_answer,
    score_release,
)

TURN = "<|im_start|>assistant\n"
CHOICES = ["cat", "dog", "bird", "fish"]


@pytest.mark.parametrize("text,letter", [
    # from the last <answer> tag
    ("<answer>B</answer>", "B"),
    ("<answer> c </answer>", "C"),                    # one letter, either case
    ("<answer>A</answer> then <answer>(d)</answer>", "D"),  # the last tag
    ("<answer>The answer is (b).</answer>", "B"),      # bracketed, either case
    ("<answer>[C] bird</answer>", "C"),
    ("<answer>B. dog</answer>", "B"),                  # "X." counts inside a tag
    ("<answer>A) or B)</answer>", "B"),                # the last punctuated letter
    ("<answer>option D is right</answer>", "D"),       # a standalone capital
    ("<answer>The answer is C, not (D)</answer>", "D"),  # brackets beat a bare capital
    ("<answer>(b) is my pick</answer>", "B"),
    ("<answer>dog</answer>", None),                    # an option's text: no letter
    ("<answer>E</answer>", None),                      # A-D only
    ("<answer>a dog</answer>", None),                  # lower-case standalone is no pick
    # from the first \boxed{} holding any a-d/A-D
    ("so \\boxed{C}", "C"),
    ("\\boxed{(B)} and later \\boxed{D}", "B"),        # the first box, not the last
    ("\\boxed{Paris} but (C)", None),                  # qualifies (has an 'a'), yields nothing
    ("\\boxed{42} so the answer is (C)", "C"),         # no letter in the box: whole turn
    # from the whole turn, the first rule that matches, its last match
    ("Answer: (B) ... (A) ... Answer: (c)", "C"),
    ("The correct answer is (D), not (A).", "D"),      # the phrase beats a later (A)
    ("I pick **option (B)** over **(C) maybe**; (A)", "C"),  # last bold (X) beats plain (A)
    ("between (A) and (B)", "B"),
    ("A] or C)", "C"),
    ("so it is B. Done", "B"),                         # standalone capital
    ("the data. suggests", None),                      # "X." is not read over the turn
    ("E is right", None),
    ("", None),
])
def test_extract_solution_for_mcq(text, letter):
    assert extract_solution_for_mcq(text) == letter


@pytest.mark.parametrize("response,gold,choices,score", [
    # divergence 1: no <answer> in the last turn -> the letter comes from the whole turn
    ("<think>B looks wrong</think>The answer is (C).", ["C"], CHOICES, 1.0),
    # divergence 2: the option's text for B scores 0 under the release
    ("<think>it barks</think><answer>dog</answer>", ["B"], CHOICES, 0.0),
    ("<answer>B</answer>", ["B"], CHOICES, 1.0),
    ("<answer>b</answer>", ["B"], CHOICES, 1.0),
    ("<answer>B</answer>", ["dog"], CHOICES, 0.0),    # gold must be a letter
    # only the last assistant turn, after its last </think> or </thinking>
    (f"{TURN}<answer>C</answer><|im_end|>\n{TURN}<thinking>x</thinking><answer>A</answer>",
     ["A"], CHOICES, 1.0),
    (f"{TURN}<answer>A</answer><|im_end|>\n{TURN}no tag here, D)", ["A"], CHOICES, 0.0),
    ("<answer>A</answer><think>second thoughts</think>so (B)", ["A"], CHOICES, 0.0),
    ("<thinking><answer>A</answer></thinking>", ["A"], CHOICES, 0.0),  # hidden in thinking
    # open answers: EM after normalisation, <answer> required
    ("<thinking>ok</thinking><answer>The Eiffel Tower!</answer>", ["eiffel tower"], None, 1.0),
    ("<answer>1,997</answer>", ["1997"], None, 1.0),   # punctuation goes
    ("<answer>A</answer>", ["a"], None, 1.0),          # a lone "a" is kept
    ("<answer>an apple</answer>", ["apple"], None, 1.0),
    ("The Eiffel Tower", ["eiffel tower"], None, 0.0),  # no tag: 0 for open answers
    ("<answer>Paris, France</answer>", ["Paris"], None, 0.0),
    ("<answer>x</answer> <answer>Paris</answer>", ["paris"], None, 1.0),  # the last tag
    (f"{TURN}<answer>Paris</answer><|im_end|>\n{TURN}<answer>Rome</answer>", ["Paris"], None,
     0.0),
    ("<answer>Lyon</answer>", ["Paris", "lyon"], None, 1.0),  # any gold answer
])
def test_score_release(response, gold, choices, score):
    assert score_release(response, gold, choices) == score


def test_last_turn_and_normalisation():
    assert last_turn(f"{TURN}a<|im_end|>{TURN}<think>t</think>\nB") == "\nB"
    assert last_turn("plain") == "plain"
    assert normalize_answer("  The  Quick, brown FOX. ") == "quick brown fox"
    assert normalize_answer("A.") == "a"
    assert normalize_answer("a cat") == "cat"


def test_release_answer_is_what_its_judge_sees():
    assert release_answer(f"{TURN}<answer>x</answer><|im_end|>{TURN}<think>a</think>"
                          "<answer> Paris </answer><|im_end|>") == "Paris"
    assert release_answer("<answer>hidden</answer></thinking> no tag") is None
