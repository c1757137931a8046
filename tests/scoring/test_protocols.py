"""Scoring protocols on hand-made cases: the same responses scored under `mars` and
`official` give the numbers each protocol should (token F1 vs exact match, option rotations,
InfoSeek numeric ranges and the harmonic mean of its splits), letters bounded per benchmark,
and a failing judge leaving records unscored, never 0."""

from __future__ import annotations

from pathlib import Path

import pytest

from marscli.errors import BadInput
from marscli.scoring.judge import Judge, JudgeError, JudgeOptions, make_judge
from marscli.scoring.protocols import (
    ScoreContext,
    best_f1,
    harmonic_mean,
    in_numeric_range,
    make_protocol,
    parse_numeric,
    token_f1,
)

EXACT = ScoreContext(judge=make_judge("exact"), base=Path("."))


def rec(answer, gold, bench, **kw) -> dict:
    return {"id": f"{kw.pop('pid', 'q')}#0", "benchmark": bench, "answer_gt": gold,
            "final_answer": answer, "stop": "answer", "question": "?", **kw}


def score(protocol: str, r: dict, ctx: ScoreContext = EXACT) -> dict:
    return make_protocol(protocol).score(r, ctx)


def items(recs: list[dict], protocol: str) -> list[dict]:
    """Per-item dicts as the summary builds them (one sample each)."""
    out = []
    for r in recs:
        s = score(protocol, r)
        out.append({"id": r["id"], "accuracy": s.get("accuracy"),
                    "cycle_category": r.get("cycle_category"),
                    "data_split": r.get("data_split"), "category": "all"})
    return out


# ----------------------------------------------------------------------- MMSearch: token F1


def test_token_f1_by_hand():
    assert token_f1("the Eiffel Tower", "Eiffel Tower") == 1.0  # articles dropped
    # pred {eiffel, tower, paris} vs gold {eiffel, tower}: P 2/3, R 1 -> F1 0.8
    assert token_f1("Eiffel Tower, Paris", "Eiffel Tower") == pytest.approx(0.8)
    assert token_f1("Louvre", "Eiffel Tower") == 0.0
    assert best_f1("Acme Corp", ["ACME", "Acme Corp"]) == 1.0


def test_mmsearch_f1_differs_from_exact_match():
    recs = [rec("Eiffel Tower, Paris", ["Eiffel Tower"], "mmsearch", pid="a"),
            rec("Gustave Eiffel", ["Eiffel"], "mmsearch", pid="b"),
            rec("Louvre", ["Eiffel Tower"], "mmsearch", pid="c")]
    mars = [score("mars", r) for r in recs]
    official = [score("official", r) for r in recs]
    assert [s["accuracy"] for s in mars] == [0.0, 0.0, 0.0]  # no exact match, no judge
    assert [s["accuracy"] for s in official] == pytest.approx([0.8, 2 / 3, 0.0], abs=1e-6)
    assert {s["method"] for s in official} == {"token_f1"}
    agg_m = make_protocol("mars").aggregate("mmsearch", items(recs, "mars"))
    agg_o = make_protocol("official").aggregate("mmsearch", items(recs, "official"))
    assert agg_m["accuracy"] == 0.0
    assert agg_o["accuracy"] == pytest.approx(100 * (0.8 + 2 / 3) / 3, abs=0.01)
    assert agg_o["metric"] == "mean token F1"


# ----------------------------------------------------------------------- HR-Bench rotations


def test_hrbench_rotations_average_per_rotation():
    # rotation 1 has one item (right), rotation 2 three items (one right):
    # plain mean 2/4 = 50; mean over rotations (1 + 1/3) / 2 = 66.67
    recs = [rec("A", ["A"], "hrbench-4k", pid="0", cycle_category="cycle1", choices=list("wxyz")),
            rec("B", ["B"], "hrbench-4k", pid="1", cycle_category="cycle2", choices=list("wxyz")),
            rec("C", ["A"], "hrbench-4k", pid="2", cycle_category="cycle2", choices=list("wxyz")),
            rec("D", ["C"], "hrbench-4k", pid="3", cycle_category="cycle2", choices=list("wxyz"))]
    m = make_protocol("mars").aggregate("hrbench-4k", items(recs, "mars"))
    o = make_protocol("official").aggregate("hrbench-4k", items(recs, "official"))
    assert m["accuracy"] == 50.0
    assert o["accuracy"] == pytest.approx(66.67)
    assert o["rotations"] == {"cycle1": {"accuracy": 100.0, "items": 1},
                              "cycle2": {"accuracy": 33.33, "items": 3}}


# ----------------------------------------------------------------------- InfoSeek


def test_numeric_parsing_and_ranges():
    assert parse_numeric("about 1,200 m") == 1200.0
    assert parse_numeric("between 9-10 metres") == [9.0, 10.0]
    assert parse_numeric("no number") == [0.0, 0.0]
    assert in_numeric_range(105.0, 100.0) and not in_numeric_range(111.0, 100.0)  # ±10%
    assert in_numeric_range(95.0, [90.0, 110.0]) and not in_numeric_range(89.0, [90.0, 110.0])
    assert in_numeric_range([95.0, 105.0], [90.0, 110.0])  # inside
    assert in_numeric_range([95.0, 115.0], [90.0, 110.0])  # IoU 15/25 >= 0.5
    assert not in_numeric_range([100.0, 140.0], [90.0, 110.0])  # IoU 10/50 < 0.5


def test_harmonic_mean():
    assert harmonic_mean([0.5, 0.25]) == pytest.approx(1 / 3)
    assert harmonic_mean([0.5, 0.0]) < 1e-9  # InfoSeek's 1e-12 for a zero


def test_infoseek_official_vs_mars():
    rng = [{"wikidata": 300.0, "range": [270.0, 330.0]}]
    recs = [
        # numeric, within the range but not an exact match: official 1, mars (exact judge) 0
        rec("about 310 metres", ["300"], "infoseek", pid="n1", answer_eval=rng,
            question_type="Numerical", data_split="val_unseen_question"),
        # numeric, out of range: 0 under both
        rec("500", ["300"], "infoseek", pid="n2", answer_eval=rng, question_type="Numerical",
            data_split="val_unseen_question"),
        # numeric without a range: the gold value ±10%
        rec("52", ["50"], "infoseek", pid="n3", answer_eval=["50"], question_type="Numerical",
            data_split="val_unseen_entity"),
        # string: exact match against answer_eval (an alias), both protocols agree
        rec("Gustave Eiffel", ["Eiffel"], "infoseek", pid="s1",
            answer_eval=["Eiffel", "Gustave Eiffel"], question_type="String",
            data_split="val_unseen_entity"),
        rec("Picasso", ["Eiffel"], "infoseek", pid="s2", answer_eval=["Eiffel"],
            question_type="String", data_split="val_unseen_entity"),
        rec("1889", ["1889"], "infoseek", pid="t1", answer_eval=["1889"],
            question_type="Time", data_split="val_unseen_entity"),
    ]
    off = [score("official", r)["accuracy"] for r in recs]
    mars = [score("mars", r)["accuracy"] for r in recs]
    assert off == [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    assert mars == [0.0, 0.0, 0.0, 0.0, 0.0, 1.0]  # exact match against answer_gt only
    o = make_protocol("official").aggregate("infoseek", items(recs, "official"))
    # unseen_question: 1/2, unseen_entity: 3/4 -> harmonic mean 0.6
    assert o["splits"] == {"unseen_entity": {"accuracy": 75.0, "items": 4},
                           "unseen_question": {"accuracy": 50.0, "items": 2}}
    assert o["accuracy"] == 60.0 and "harmonic" in o["metric"]
    m = make_protocol("mars").aggregate("infoseek", items(recs, "mars"))
    assert m["accuracy"] == pytest.approx(16.67)


def test_infoseek_without_splits_falls_back_with_a_note():
    recs = [rec("x", ["x"], "infoseek", pid="a"), rec("y", ["x"], "infoseek", pid="b")]
    o = make_protocol("official").aggregate("infoseek", items(recs, "official"))
    assert o["accuracy"] == 50.0 and "plain mean" in o["note"]


# ----------------------------------------------------------------------- multiple choice


def test_letters_are_bounded_per_benchmark():
    # without `choices`: the release's extractor knows A-D; MME-RealWorld needs E too
    assert score("mars", rec("E", ["E"], "vstar"))["accuracy"] == 0.0
    assert score("mars", rec("E", ["E"], "mme-realworld"))["accuracy"] == 1.0
    five = ["1", "2", "3", "4", "none"]
    assert score("mars", rec("(E)", ["E"], "mme-realworld", choices=five))["accuracy"] == 1.0
    assert score("mars", rec("The answer is (B).", ["B"], "vstar"))["accuracy"] == 1.0
    assert score("mars", rec("blue", ["B"], "vstar", choices=["red", "blue"]))["accuracy"] == 1.0
    assert score("mars", rec("C", ["B"], "vstar", choices=["red", "blue"]))["accuracy"] == 0.0


def test_no_answer_and_engine_error():
    assert score("mars", rec(None, ["x"], "fvqa", stop="max_turns")) == {
        "protocol": "mars", "accuracy": 0.0, "method": "no_answer"}
    s = score("official", rec(None, ["x"], "mmsearch", stop="engine_error", error="boom"))
    assert s["status"] == "unscored" and "boom" in s["error"] and "accuracy" not in s


# ----------------------------------------------------------------------- judge


class FakeJudge(Judge):
    name = "fake"
    remote = True

    def __init__(self, verdicts: dict[str, bool | Exception]) -> None:
        super().__init__("", JudgeOptions())
        self.verdicts, self.asked = verdicts, []

    def verdict(self, question, gold, response, image):
        self.asked.append((gold, response))
        v = self.verdicts.get(response, False)
        if isinstance(v, Exception):
            raise v
        return v


def test_judge_is_asked_only_after_exact_match_fails(tmp_path):
    judge = FakeJudge({"Paris, France": True, "broken": JudgeError("HTTP 503")})
    ctx = ScoreContext(judge=judge, base=tmp_path)
    assert score("mars", rec("paris", ["Paris"], "fvqa"), ctx)["method"] == "exact"
    assert judge.asked == []
    s = score("mars", rec("Paris, France", ["Paris"], "fvqa"), ctx)
    assert s == {"protocol": "mars", "accuracy": 1.0, "method": "judge", "judge": "fake"}
    s = score("mars", rec("broken", ["Paris"], "fvqa"), ctx)
    assert s["status"] == "unscored" and "HTTP 503" in s["error"] and "accuracy" not in s
    # MMSearch under `official` never asks the judge
    judge.asked.clear()
    score("official", rec("Paris, France", ["Paris"], "mmsearch"), ctx)
    assert judge.asked == []


def test_unknown_protocol_lists_names():
    with pytest.raises(BadInput, match=r"unknown --protocol 'nope' — choose one of: mars, "
                                       r"official, release, release-inference"):
        make_protocol("nope")
