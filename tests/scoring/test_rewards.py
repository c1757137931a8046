"""The reward stage on the exact path: scoring table, format reward, records, CLI boundary."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from marscli.errors import BadInput
from marscli.scoring.answers import extract_choice, format_ok, normalize, score_answer
from marscli.scoring.judge import make_judge
from marscli.scoring.rewards import run
from marscli.stages.reward import main

PY = sys.executable
ABCD = ["dog", "cat", "fish", "bird"]
ABCDE = ["dog", "cat", "fish", "bird", "horse"]

# (response, gold answers, choices, expected accuracy)
SCORING = [
    # normalisation: case, punctuation, articles, whitespace
    ("<answer>Paris</answer>", ["paris"], None, 1.0),
    ("<answer>  the   Eiffel Tower. </answer>", ["Eiffel Tower"], None, 1.0),
    ("<answer>An apple</answer>", ["apple"], None, 1.0),
    ("<answer>a cat</answer>", ["The cat"], None, 1.0),
    ("<answer>New-York!</answer>", ["newyork"], None, 1.0),
    ("<answer>O'Neill</answer>", ["oneill"], None, 1.0),
    ("<answer>Theatre</answer>", ["atre"], None, 0.0),  # "the" inside a word stays
    ("<answer>Paris, France</answer>", ["Paris"], None, 0.0),  # more specific: judge's call
    # a lone "a" survives normalisation, so the letter A is not emptied
    ("<answer>A</answer>", ["a"], None, 1.0),
    ("<answer>A</answer>", ["the"], None, 0.0),
    ("<answer>a</answer>", ["b"], None, 0.0),
    # several gold aliases: any one matches
    ("<answer>NYC</answer>", ["New York City", "NYC"], None, 1.0),
    ("<answer>Big Apple</answer>", ["New York City", "NYC"], None, 0.0),
    # numbers
    ("<answer>1997</answer>", ["1997"], None, 1.0),
    ("<answer>1,000</answer>", ["1000"], None, 1.0),
    ("<answer>1998</answer>", ["1997"], None, 0.0),
    ("<answer>3.50</answer>", ["3.5"], None, 0.0),  # not equal as strings: judge's call
    # the last answer tag counts, and the whole text when there is none
    ("<answer>Rome</answer> then <answer>Paris</answer>", ["Paris"], None, 1.0),
    ("<answer>Paris</answer> then <answer>Rome</answer>", ["Paris"], None, 0.0),
    ("Paris", ["paris"], None, 1.0),
    ("<answer></answer>", ["the"], None, 0.0),  # empty never matches
    ("<answer>  </answer>", [""], None, 0.0),
    # multiple choice
    ("<answer>B</answer>", ["B"], ABCD, 1.0),
    ("<answer>b</answer>", ["B"], ABCD, 1.0),  # lower case letter
    ("<answer>(B)</answer>", ["b"], ABCD, 1.0),
    ("<answer>\\boxed{B}</answer>", ["B"], ABCD, 1.0),
    ("The answer is (C).", ["C"], ABCD, 1.0),
    ("answer: d", ["D"], ABCD, 1.0),
    ("<answer>cat</answer>", ["B"], ABCD, 1.0),  # option text instead of letter
    ("<answer>The cat.</answer>", ["B"], ABCD, 1.0),
    ("<answer>B</answer>", ["cat"], ABCD, 1.0),  # gold given as option text
    ("<answer>C</answer>", ["B"], ABCD, 0.0),
    ("<answer>Apple</answer>", ["A"], ["Apple pie", "cake", "tea", "milk"], 0.0),  # A in a word
    ("<answer>Definitely</answer>", ["D"], ABCD, 0.0),
    ("<answer>E</answer>", ["E"], ABCDE, 1.0),  # E for five options
    ("<answer>E</answer>", ["D"], ABCD, 0.0),  # E does not exist with four
    ("<answer>I am not sure</answer>", ["B"], ABCD, 0.0),  # no letter
    ("<answer>I would pick B over C here, final C</answer>", ["C"], ABCD, 1.0),  # last letter
    ("<answer>the answer is a dog</answer>", ["A"], ["a dog", "a cat"], 0.0),  # prose, not a
    # letter ("a" is an article here) and not the option text itself
    ("<answer>B. cat</answer>", ["B"], ABCD, 1.0),
    ("<answer>cow</answer>", ["B"], ["A. dog", "B. cow"], 1.0),  # option labels stripped
    ("<answer>?</answer>", ["A"], ["the", "cat"], 0.0),  # empty after normalising: no match
]


@pytest.mark.parametrize("response,gold,choices,expected", SCORING)
def test_score_answer(response, gold, choices, expected):
    assert score_answer(response, gold, choices) == expected


@pytest.mark.parametrize("text,expected", [
    ("\\boxed{B}", "B"), ("The answer is (C).", "C"), ("answer: d", "D"), ("b", "B"),
    ("Apple", None), ("The answer is a dog", None), ("Answer: B", "B"),
    ("The correct answer is option E", "E"), ("nothing here", None), ("(a)", "A"),
    ("\\boxed{B}, not C", "B"), ("The answer is (C). A is wrong", "C"),  # priority over
    ("I doubt B. <answer>D</answer>", "D"),  # the last standalone letter; the tag decides
])
def test_extract_choice(text, expected):
    assert extract_choice(text) == expected


def test_extract_choice_respects_the_number_of_options():
    assert extract_choice("E", "ABCD") is None
    assert extract_choice("\\boxed{E} or maybe B", "ABCD") is None  # strongest signal decides


@pytest.mark.parametrize("s,expected", [
    ("The Quick, brown fox!", "quick brown fox"), ("A", "a"), ("  a  ", "a"), ("an", ""),
    ("a b", "b"), ("Hello\n\tWorld", "hello world"),
])
def test_normalize(s, expected):
    assert normalize(s) == expected


def traj(answer="Paris", stop="answer", oks=(True,), final=True, **extra) -> dict:
    segs = [{"role": "prompt"}]
    for ok in oks:
        segs += [{"role": "model", "text": "<tool_call>{}</tool_call>"},
                 {"role": "tool", "tool": "text_search_tool", "ok": ok}]
    segs.append({"role": "model", "text": f"<answer>{answer}</answer>" if answer is not None
                 else "I give up"})
    row = {"v": 1, "id": "q#0", "question": "Capital of France?", "answer_gt": ["Paris"],
           "segments": segs, "stop": stop, **extra}
    if final:
        row["final_answer"] = answer
    return row


@pytest.mark.parametrize("row,expected", [
    (traj(), True),
    (traj(oks=()), True),
    (traj(final=False), True),  # answer parsed from the last model segment
    (traj(oks=(True, False)), False),  # one invalid tool call
    (traj(stop="format_error"), False),
    (traj(answer=None), False),  # no answer
    (traj(answer=None, final=False), False),
    (traj(answer=""), False),  # empty answer
    (traj(answer="   "), False),
    (traj(stop="max_turns"), False),
    (traj(stop="max_tokens"), False),
])
def test_format_ok(row, expected):
    assert format_ok(row) is expected


def rows_of(*rows):
    return list(enumerate(rows, start=1))


def test_run_reward_record_and_carry_through():
    rows = rows_of(traj(extra_field={"keep": 1}), traj(answer="Lyon"),
                   traj(oks=(False,)), traj(answer=None))
    out, stats = run(rows, "t.jsonl", make_judge("exact"), format_weight=0.5)
    assert [r["reward"] for r in out] == [
        {"total": 1.5, "accuracy": 1.0, "format": 0.5, "judge": "exact"},
        {"total": 0.5, "accuracy": 0.0, "format": 0.5, "judge": "exact"},
        {"total": 1.0, "accuracy": 1.0, "format": 0.0, "judge": "exact"},
        {"total": 0.0, "accuracy": 0.0, "format": 0.0, "judge": "exact"},
    ]
    assert out[0]["extra_field"] == {"keep": 1} and out[0]["segments"] == rows[0][1]["segments"]
    assert stats["accuracy_mean"] == 0.5 and stats["format_mean"] == 0.25
    assert stats["unscored"] == 0 and stats["judge_calls"] == 0


def test_format_weight_is_configurable():
    out, _ = run(rows_of(traj()), "t.jsonl", make_judge("exact"), format_weight=0.2)
    assert out[0]["reward"]["format"] == 0.2 and out[0]["reward"]["total"] == 1.2


def test_multiple_choice_row_never_asks_the_judge():
    row = traj(answer="\\boxed{B}", choices=ABCD)
    row["answer_gt"] = ["B"]
    out, _ = run(rows_of(row), "t.jsonl", make_judge("exact"))
    assert out[0]["reward"]["accuracy"] == 1.0


@pytest.mark.parametrize("patch,field", [
    ({"answer_gt": []}, "answer_gt"),
    ({"answer_gt": "Paris"}, "answer_gt"),
    ({"answer_gt": ["Paris", 3]}, "answer_gt"),
    ({"choices": ["x"] * 6}, "choices"),
    ({"choices": ["dog", "cat"], "answer_gt": ["horse"]}, "answer_gt"),
    ({"final_answer": 3}, "final_answer"),
    ({"segments": "nope"}, "segments"),
    ({"segments": [{"role": "tool", "ok": "yes"}]}, "segments[0].ok"),
    ({"id": 3}, "id"),
    ({"id": ""}, "id"),
])
def test_bad_fields_name_file_line_field(patch, field):
    rows = rows_of(traj(), {**traj(), **patch})
    with pytest.raises(BadInput, match=rf"^t\.jsonl:2: {re.escape(field)}: "):
        run(rows, "t.jsonl", make_judge("exact"))


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))


def test_main_writes_output_and_sidecar(tmp_path):
    src, dst = tmp_path / "t.jsonl", tmp_path / "s.jsonl"
    write_jsonl(src, [traj(), traj(answer="Lyon")])
    stats = main(str(src), str(dst))
    out = [orjson.loads(line) for line in dst.read_bytes().splitlines()]
    assert [r["reward"]["total"] for r in out] == [1.5, 0.5]
    meta = orjson.loads((tmp_path / "s.jsonl.meta.json").read_bytes())
    assert meta["stage"] == "reward" and meta["stats"]["accuracy_mean"] == 0.5
    assert meta["config"]["judge"] == "exact" and str(src) in meta["inputs"]
    assert stats["rows"] == 2


def cli(*args, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "marscli", "reward", *args], cwd=cwd, text=True,
                          capture_output=True, env={**os.environ, **(env or {})}, timeout=60,
                          check=False)


def test_cli_bad_field_exit_2_one_line_no_output(tmp_path):
    src, dst = tmp_path / "t.jsonl", tmp_path / "s.jsonl"
    write_jsonl(src, [traj(), {**traj(), "answer_gt": []}])
    dst.write_text("previous\n")
    p = cli(str(src), "-o", str(dst), cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {src}:2: answer_gt: "), p.stderr
    assert dst.read_text() == "previous\n"
    assert sorted(os.listdir(tmp_path)) == ["s.jsonl", "t.jsonl"]


def test_cli_row_without_id_exit_2_one_line(tmp_path):
    """The id keys a row's reward downstream (advantages, a re-run's partial file): a row
    without one is refused, not scored."""
    src = tmp_path / "t.jsonl"
    write_jsonl(src, [traj(), {k: v for k, v in traj().items() if k != "id"}])
    p = cli(str(src), "-o", str(tmp_path / "s.jsonl"), cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip() == f"error: {src}:2: id: missing required field", p.stderr
    assert sorted(os.listdir(tmp_path)) == ["t.jsonl"]


def test_cli_stdout_and_bad_options(tmp_path):
    src = tmp_path / "t.jsonl"
    write_jsonl(src, [traj()])
    p = cli(str(src), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert orjson.loads(p.stdout)["reward"]["total"] == 1.5
    for bad in (["--format-weight", "-1"], ["--max-unscored", "2"], ["--judge", "gpt4"],
                ["--judge-concurrency", "0"]):
        p = cli(str(src), *bad, cwd=tmp_path)
        assert p.returncode == 2 and p.stdout == "", (bad, p.stderr)
    assert "openai:MODEL@URL" in cli(str(src), "--judge", "gpt4", cwd=tmp_path).stderr


def test_exact_path_imports_no_torch(tmp_path):
    """`marscli reward --judge exact` must not load torch or transformers (data-only stage)."""
    src = tmp_path / "t.jsonl"
    write_jsonl(src, [traj()])
    code = (
        "import sys\n"
        f"sys.argv = ['marscli', 'reward', {str(src)!r}, '-o', {str(tmp_path / 'o.jsonl')!r}]\n"
        "from marscli.cli import main\n"
        "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "heavy = [m for m in ('torch', 'transformers', 'torchvision') if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    p = subprocess.run([PY, "-c", code], text=True, capture_output=True, timeout=60,
                       check=False)
    assert p.returncode == 0, p.stderr
    assert "HEAVY []" in p.stdout, p.stdout
    assert (tmp_path / "o.jsonl").exists()



WRITER = """
import sys, time
import orjson
from marscli.records.outputs import AppendJsonl
from marscli.records.sidecar import write_sidecar
out, n, sidecar = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
rows = [orjson.loads(x) for x in sys.stdin.buffer.read().splitlines()]
with AppendJsonl(out) as w:  # holds OUT.lock, as rollout does
    for i, row in enumerate(rows[:n]):
        w.write(row)
        time.sleep(0.15)
if sidecar:
    write_sidecar(out, stage="rollout", inputs=[])
"""


def start_writer(tmp_path: Path, rows: list[dict], n: int, sidecar: bool) -> subprocess.Popen:
    p = subprocess.Popen([PY, "-c", WRITER, str(tmp_path / "t.jsonl"), str(n),
                          "1" if sidecar else "0"], stdin=subprocess.PIPE)
    p.stdin.write(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    p.stdin.close()
    return p


def test_follow_scores_rows_as_they_come_and_equals_the_whole_file(tmp_path):
    """`reward --follow` started before the writer's first row: the same rows, rewards and
    order as scoring the finished file, and done once the writer's sidecar is there."""
    rows = [{**traj(answer=a), "id": f"q#{i}"} for i, a in enumerate(
        ["Paris", "Lyon", "paris", "Nice", "PARIS."])]
    writer = start_writer(tmp_path, rows, len(rows), sidecar=True)
    p = cli("t.jsonl", "-o", "followed.jsonl", "--follow", cwd=tmp_path)
    assert writer.wait(timeout=60) == 0 and p.returncode == 0, p.stderr
    assert (tmp_path / "t.jsonl.meta.json").exists()
    main(str(tmp_path / "t.jsonl"), str(tmp_path / "whole.jsonl"))
    followed = (tmp_path / "followed.jsonl").read_bytes()
    assert followed == (tmp_path / "whole.jsonl").read_bytes()
    assert [orjson.loads(x)["reward"]["accuracy"] for x in followed.splitlines()] == [1, 0, 1, 0, 1]
    meta = orjson.loads((tmp_path / "followed.jsonl.meta.json").read_bytes())
    assert meta["stats"]["rows"] == 5


def test_follow_fails_when_the_writer_dies_without_its_sidecar(tmp_path, monkeypatch):
    import functools

    import marscli.records.jsonl
    import marscli.stages.reward
    from marscli.errors import RuntimeFailure

    rows = [{**traj(), "id": f"q#{i}"} for i in range(4)]
    writer = start_writer(tmp_path, rows, 2, sidecar=False)  # ends after 2 rows, no sidecar
    while not (tmp_path / "t.jsonl").exists():  # a grace of 0.5 s covers no interpreter start
        assert writer.poll() is None
        time.sleep(0.01)
    monkeypatch.setattr(marscli.stages.reward, "follow_rows",
                        functools.partial(marscli.records.jsonl.follow_rows, grace_s=0.5))
    with pytest.raises(RuntimeFailure, match=r"stopped without writing t.jsonl.meta.json .*"
                                             r"2 lines were read"):
        main(str(tmp_path / "t.jsonl"), str(tmp_path / "s.jsonl"), follow=True)
    assert writer.wait(timeout=60) == 0
    assert not (tmp_path / "s.jsonl").exists() and not (tmp_path / "s.jsonl.meta.json").exists()


def test_follow_refuses_stdin_and_a_torn_last_line_is_bad_input(tmp_path):
    with pytest.raises(BadInput, match="--follow: needs a file"):
        main("-", str(tmp_path / "s.jsonl"), follow=True)
    src = tmp_path / "t.jsonl"
    src.write_bytes(orjson.dumps(traj()) + b"\n" + b'{"v": 1, "id": "q#1", "seg')
    (tmp_path / "t.jsonl.meta.json").write_text("{}")
    with pytest.raises(BadInput, match=r"t.jsonl:2: not valid JSON"):
        main(str(src), str(tmp_path / "s.jsonl"), follow=True)
    assert not (tmp_path / "s.jsonl").exists()


def test_follow_drops_a_torn_tail_that_the_resumed_writer_cuts(tmp_path):
    """A killed rollout left a torn last line; `--follow` has read it (unfinished) when the
    resumed rollout opens the file, cuts the tail and appends: the rows come out whole, as
    scoring the finished file gives them."""
    src = tmp_path / "t.jsonl"
    rows = [{**traj(answer=a), "id": f"q#{i}"} for i, a in enumerate(["Paris", "Lyon", "Nice"])]
    src.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows[:2]) + b'{"v": 1, "id": "q#2"')
    follow = subprocess.Popen([PY, "-m", "marscli", "reward", "t.jsonl", "-o", "followed.jsonl",
                               "--follow"], cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    time.sleep(1.0)  # it has read the two rows and the torn tail
    writer = start_writer(tmp_path, rows[2:], 1, sidecar=True)  # cuts the tail, appends
    assert writer.wait(timeout=60) == 0
    _, err = follow.communicate(timeout=60)
    assert follow.returncode == 0, err
    main(str(src), str(tmp_path / "whole.jsonl"))
    followed = (tmp_path / "followed.jsonl").read_bytes()
    assert followed == (tmp_path / "whole.jsonl").read_bytes() and followed.count(b"\n") == 3
