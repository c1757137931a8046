"""Scoring as the released SenseNova-MARS code scores (`reward --protocol release`, `eval
--protocol release | release-inference`): a table of replies on which marscli's own protocol
and the release's disagree, scored by both stages; the judge asked only where the release asks
it; the protocol recorded in the reward sidecar and the eval summary."""

from __future__ import annotations

import itertools
import os
import re
import shlex
import subprocess
from pathlib import Path

import orjson
import pytest

from marscli.agent.protocol import last_answer
from marscli.errors import BadInput
from marscli.scoring.judge import Judge, JudgeError, JudgeOptions, make_judge
from marscli.scoring.protocols import ScoreContext, make_protocol
from marscli.scoring.rewards import run as reward_run
from marscli.stages.reward import main as reward_main

from helpers import ROOT, invoke, read_jsonl, write_jsonl

ABCD = ["cat", "dog", "fish", "bird"]
FIVE = ["cat", "dog", "fish", "bird", "horse"]
T = "<think>Looking at the picture.</think>"

# (last model turn, gold, choices, accuracy under mars, accuracy under release)
DIFFER = [
    # no <answer> tag in a multiple-choice last turn: the release reads the letter from it
    (T + "The answer is (B).", ["B"], ABCD, 0.0, 1.0),
    (T + "So the answer is \\boxed{C}", ["C"], ABCD, 0.0, 1.0),
    (T + "I would say **(D) bird**", ["D"], ABCD, 0.0, 1.0),
    # an option's text: marscli accepts it, the release reads letters only
    (T + "<answer>dog</answer>", ["B"], ABCD, 1.0, 0.0),
    # E of five options: the release stops at D
    (T + "<answer>E</answer>", ["E"], FIVE, 1.0, 0.0),
    # a lower-case boxed letter in the tag: marscli's box rule reads it, the release's does not
    (T + "<answer>\\boxed{b}</answer>", ["B"], ABCD, 1.0, 0.0),
    # which letter wins: marscli "answer is C", the release the last bracketed one
    (T + "<answer>The answer is C, not (D)</answer>", ["D"], ABCD, 0.0, 1.0),
    # the tag inside the thinking: the release scores what follows the last </think>
    ("<think>maybe <answer>A</answer></think>I pick B", ["B"], ABCD, 0.0, 1.0),
    ("<think>I guess <answer>Paris</answer></think>Not sure.", ["Paris"], None, 1.0, 0.0),
]
SAME = [
    (T + "<answer>B</answer>", ["B"], ABCD, 1.0, 1.0),
    (T + "<answer>(c)</answer>", ["C"], ABCD, 1.0, 1.0),
    (T + "<answer>The Eiffel Tower.</answer>", ["eiffel tower"], None, 1.0, 1.0),
    (T + "Paris", ["Paris"], None, 0.0, 0.0),  # no tag: no open answer under either
]
CASES = DIFFER + SAME


def traj(i: int, text: str, gold: list[str], choices: list[str] | None) -> dict:
    """A trajectory row as rollout writes it: the final answer parsed from the last turn."""
    row = {"v": 1, "id": f"q{i}#0", "prompt_id": f"q{i}", "question": "Which one?",
           "answer_gt": gold, "images": [],
           "segments": [{"role": "prompt", "tokens": [1, 2]},
                        {"role": "model", "tokens": [3], "text": text}],
           "final_answer": last_answer(text), "stop": "answer" if last_answer(text) else
           "format_error"}
    return {**row, "choices": choices} if choices else row


class FakeJudge(Judge):
    """Says Yes to the answers it is given, records what it was asked."""
    name = "fake"
    remote = True

    def __init__(self, yes: set[str] = frozenset(), fail: set[str] = frozenset()) -> None:
        super().__init__("", JudgeOptions())
        self.yes, self.fail, self.asked = set(yes), set(fail), []

    def verdict(self, question, gold, response, image):
        self.asked.append(response)
        if response in self.fail:
            raise JudgeError("HTTP 503")
        return response in self.yes


def reward_accuracies(protocol: str, judge: Judge | None = None) -> list[float]:
    rows = [(i + 1, traj(i, *c[:3])) for i, c in enumerate(CASES)]
    out, _ = reward_run(rows, "t.jsonl", judge or make_judge("exact"), protocol=protocol)
    return [r["reward"]["accuracy"] for r in out]


def eval_accuracies(protocol: str, ctx: ScoreContext) -> list[float]:
    proto = make_protocol(protocol)
    return [proto.score({**traj(i, *c[:3]), "benchmark": "some-bench"}, ctx)["accuracy"]
            for i, c in enumerate(CASES)]


# ----------------------------------------------------------------------- the table, both stages


@pytest.mark.parametrize("protocol, column", [("mars", 3), ("release", 4)])
def test_reward_scores_the_table_as_each_protocol_says(protocol, column):
    assert reward_accuracies(protocol) == [c[column] for c in CASES]


@pytest.mark.parametrize("protocol, column", [("mars", 3), ("release", 4),
                                              ("release-inference", 4)])
def test_eval_scores_the_table_as_each_protocol_says(protocol, column):
    ctx = ScoreContext(judge=make_judge("exact"), base=Path("."))
    want = [c[column] for c in CASES]
    if protocol == "release-inference":  # an untagged open turn is the answer itself
        want[CASES.index(SAME[-1])] = 1.0
    assert eval_accuracies(protocol, ctx) == want


def test_the_format_reward_is_the_same_under_both():
    rows = [(i + 1, traj(i, *c[:3])) for i, c in enumerate(CASES)]
    judge = make_judge("exact")
    mars, _ = reward_run(rows, "t.jsonl", judge, protocol="mars")
    release, _ = reward_run(rows, "t.jsonl", judge, protocol="release")
    assert [r["reward"]["format"] for r in mars] == [r["reward"]["format"] for r in release]
    # an untagged last turn is a format failure under both, even where release scores it right
    assert release[0]["reward"] == {"total": 1.0, "accuracy": 1.0, "format": 0.0,
                                    "judge": "exact"}


def test_release_reads_letters_from_benchmarks_without_choices():
    # V*/HR-Bench rows carry the gold letter only; the release's extractor still applies
    ctx = ScoreContext(judge=make_judge("exact"), base=Path("."))
    r = {**traj(0, T + "The answer is (B).", ["B"], None), "benchmark": "vstar"}
    assert make_protocol("release").score(r, ctx) == {
        "protocol": "release", "accuracy": 1.0, "method": "letter"}
    r = {**traj(0, T + "<answer>E</answer>", ["E"], None), "benchmark": "mme-realworld"}
    assert make_protocol("release").score(r, ctx)["accuracy"] == 0.0
    assert make_protocol("mars").score(r, ctx)["accuracy"] == 1.0


# ----------------------------------------------------------------------- the judge


def test_release_reward_asks_the_judge_only_about_a_tagged_open_answer():
    judge = FakeJudge(yes={"Paris, France", "Paris"})
    accs = reward_accuracies("release", judge)
    # the tag inside the thinking: the release finds no answer after it, asks nobody, scores 0
    assert accs == [c[4] for c in CASES]
    # open answers that EM matched ask nothing; the untagged "Paris" is not asked about
    assert judge.asked == []
    rows = [(1, traj(0, T + "<answer>Paris, France</answer>", ["Paris"], None)),
            (2, traj(1, T + "Paris, France", ["Paris"], None)),
            (3, traj(2, T + "<answer>dog</answer>", ["B"], ABCD))]
    out, _ = reward_run(rows, "t.jsonl", judge, protocol="release")
    assert [r["reward"]["accuracy"] for r in out] == [1.0, 0.0, 0.0]
    assert judge.asked == ["Paris, France"]  # neither the untagged turn nor the MCQ row
    # marscli's own protocol asks about the tag inside the thinking (it reads the first one)
    judge.asked.clear()
    rows = [(1, traj(0, "<think>x <answer>Rome</answer></think>Paris", ["Paris"], None))]
    reward_run(rows, "t.jsonl", judge, protocol="mars")
    assert judge.asked == ["Rome"]


def test_release_inference_shows_the_judge_the_whole_untagged_turn(tmp_path):
    judge = FakeJudge(yes={"It is Paris, France."})
    ctx = ScoreContext(judge=judge, base=tmp_path)
    r = traj(0, T + "It is Paris, France.<|im_end|>", ["Paris"], None)
    assert make_protocol("release").score(r, ctx) == {
        "protocol": "release", "accuracy": 0.0, "method": "no_answer"}
    assert judge.asked == []
    assert make_protocol("release-inference").score(r, ctx) == {
        "protocol": "release-inference", "accuracy": 1.0, "method": "judge", "judge": "fake"}
    assert judge.asked == ["It is Paris, France."]


def test_a_failing_judge_leaves_release_rows_unscored(tmp_path):
    judge = FakeJudge(fail={"broken"})
    rows = [(1, traj(0, T + "<answer>broken</answer>", ["Paris"], None))]
    out, stats = reward_run(rows, "t.jsonl", judge, protocol="release")
    assert out[0]["reward"]["status"] == "unscored" and stats["unscored"] == 1
    s = make_protocol("release").score(rows[0][1], ScoreContext(judge=judge, base=tmp_path))
    assert s["status"] == "unscored" and "HTTP 503" in s["error"] and "accuracy" not in s
    s = make_protocol("release").score({**rows[0][1], "stop": "engine_error", "error": "boom"},
                                       ScoreContext(judge=judge, base=tmp_path))
    assert s["status"] == "unscored" and "boom" in s["error"]


# ----------------------------------------------------------------------- records and the CLI


def test_reward_sidecar_records_the_protocol_and_partials_do_not_cross(tmp_path, capsys):
    src = write_jsonl(tmp_path / "t.jsonl", [traj(i, *c[:3]) for i, c in enumerate(CASES)])
    out = tmp_path / "scored.jsonl"
    stats = reward_main(str(src), str(out), protocol="release")
    meta = orjson.loads((tmp_path / "scored.jsonl.meta.json").read_bytes())
    assert meta["config"]["protocol"] == "release" and stats["protocol"] == "release"
    assert [r["reward"]["accuracy"] for r in read_jsonl(out)] == [c[4] for c in CASES]
    assert "(release protocol)" in capsys.readouterr().err
    from marscli.scoring.partial import row_key
    row = traj(0, *CASES[0][:3])
    assert row_key(row, {}, 0.5, "mars") != row_key(row, {}, 0.5, "release")


def test_reward_cli_protocol_option(tmp_path):
    src = write_jsonl(tmp_path / "t.jsonl", [traj(0, *DIFFER[0][:3])])
    code, out, err = invoke(["reward", str(src), "--protocol", "release"])
    assert code == 0 and orjson.loads(out)["reward"]["accuracy"] == 1.0
    code, out, err = invoke(["reward", str(src)])
    assert code == 0 and orjson.loads(out)["reward"]["accuracy"] == 0.0
    code, out, err = invoke(["reward", str(src), "--protocol", "verl", "-o",
                             str(tmp_path / "o.jsonl")])
    assert code == 2 and "--protocol 'verl'" in err and "mars, release" in err
    assert not (tmp_path / "o.jsonl").exists()
    with pytest.raises(BadInput):
        reward_run([], "t.jsonl", make_judge("exact"), protocol="nope")


def test_eval_summary_names_the_release_protocol(tmp_path, capsys):
    from marscli.stages.eval_summarize import run_summarize

    recs = [{**traj(i, *c[:3]), "benchmark": "vstar", "mode": "agent",
             "score": {"protocol": "mars", "accuracy": c[3]}}
            for i, c in enumerate(CASES) if c[2]]
    results = write_jsonl(tmp_path / "res.jsonl", recs)
    summary = run_summarize(str(results), rescore=True, protocol="release")
    want = sum(c[4] for c in CASES if c[2]) / len(recs)
    assert summary["protocol"] == "release"
    assert summary["benchmarks"]["vstar"]["protocol"] == "release"
    assert summary["benchmarks"]["vstar"]["accuracy"] == round(100 * want, 2)
    on_disk = orjson.loads((tmp_path / "res.summary.json").read_bytes())
    assert on_disk["protocol"] == "release"
    err = capsys.readouterr().err
    assert "release protocol" in err and "scored under the release protocol —" in err


def test_reward_and_eval_resolve_the_same_protocol_entry(tmp_path, monkeypatch):
    """One `--protocol` registry: a name both stages take is one entry (its `reward` for the
    reward stage, its `score` and `aggregate` for eval); eval-only names are refused by reward
    with reward's own list."""
    import marscli.evaluation.summary
    import marscli.scoring.rewards
    import marscli.stages.eval_summarize
    from marscli.scoring import protocols

    resolved: dict[str, list] = {"reward": [], "eval": []}

    def spy(stage, lookup):
        def resolve(name):
            resolved[stage].append(lookup(name))
            return resolved[stage][-1]
        return resolve

    monkeypatch.setattr(marscli.scoring.rewards, "reward_protocol",
                        spy("reward", protocols.reward_protocol))
    monkeypatch.setattr(marscli.evaluation.summary, "make_protocol",
                        spy("eval", protocols.make_protocol))
    row = traj(0, *DIFFER[0][:3])
    out, _ = reward_run([(1, row)], "t.jsonl", make_judge("exact"), protocol="release")
    results = write_jsonl(tmp_path / "res.jsonl", [{**row, "benchmark": "vstar", "score": {
        "protocol": "mars", "accuracy": 0.0}}])
    summary = marscli.stages.eval_summarize.run_summarize(str(results), rescore=True,
                                                          protocol="release")
    assert out[0]["reward"]["accuracy"] == 1.0 and summary["benchmarks"]["vstar"]["accuracy"] == 100
    entry = protocols.PROTOCOLS.get("release")
    assert resolved["reward"] and resolved["eval"]
    assert all(p is entry for p in resolved["reward"] + resolved["eval"])
    names = protocols.reward_protocol_names()
    assert names == ["mars", "release"] and set(names) < set(protocols.protocol_names())
    assert all(protocols.reward_protocol(n) is make_protocol(n) for n in names)
    with pytest.raises(BadInput, match=r"unknown --protocol 'official' — choose one of: mars, "
                                       r"release$"):
        protocols.reward_protocol("official")


# ----------------------------------------------------------------------- the recipe


def _eval_line(tmp_path: Path, *args: str) -> list[str]:
    """The eval command `make -n` would run for ckpt-0 under recipes/eval-release.mk."""
    (tmp_path / "test.jsonl").touch()
    env = {k: v for k, v in os.environ.items()
           if k not in ("TP", "RUN", "NAME", "BASE", "MAKEFLAGS", "EVALUATOR", "TOOLS_CONFIG")}
    r = subprocess.run(["make", "--no-print-directory", "-n", "RECIPE=recipes/eval-release.mk",
                        f"RUN={tmp_path}/run", f"TEST={tmp_path}/test.jsonl", *args,
                        f"{tmp_path}/run/eval/ckpt-0.summary.json"], cwd=ROOT, text=True,
                       capture_output=True, env=env, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.replace("\\\n", " ").splitlines() if "stages/eval.sh" in x)
    return shlex.split(line.split("stages/eval.sh", 1)[1])


def test_eval_release_recipe_follows_each_official_evaluator(tmp_path):
    verl = dict(itertools.pairwise(_eval_line(tmp_path)))
    assert verl["--protocol"] == "release" and verl["--max-turns"] == "10"
    assert (verl["--temperature"], verl["--top-p"], verl["--top-k"]) == ("1.0", "1.0", "20")
    assert verl["--judge"].startswith("openai:gpt-4o-2024-11-20@")
    assert verl["--seed"] == "3407" and verl["--image-search"] == "data"
    assert verl["--text-search"].startswith("retriever:")
    inf = dict(itertools.pairwise(_eval_line(tmp_path, "EVALUATOR=inference")))
    assert inf["--protocol"] == "release-inference" and inf["--max-turns"] == "50"
    assert (inf["--temperature"], inf["--top-p"], inf["--top-k"]) == ("0.7", "0.8", "20")
    assert inf["--max-turn-tokens"] == "4096" and inf["--text-search"] == "serper"
    args = _eval_line(tmp_path, "SYSTEM_PROMPT=sys.txt")
    assert args[args.index("--system-prompt") + 1] == "sys.txt"
    # every option the recipe passes exists (--tools-config only when TOOLS_CONFIG is set)
    _, help_text, _ = invoke(["eval", "--help"])
    known = set(re.findall(r"--[a-z][a-z0-9-]*", help_text))
    for a in _eval_line(tmp_path) + list(inf):
        assert not a.startswith("--") or a in known, a
