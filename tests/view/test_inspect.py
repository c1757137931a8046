"""`marscli inspect` and its `--where` filter, on trajectories made by the real agent loop with
a scripted engine (the run folder of helpers.make_run, conftest's `run_dir`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import marscli


def cli(*args: str):
    return marscli(*args, timeout=300)


def ids(path: Path, *where: str, **kw) -> list[str]:
    from marscli.records.jsonl import iter_rows
    from marscli.view.inspect import parse_where, select

    rows = (r for _, r in iter_rows(str(path)))
    return [r["id"] for r in select(rows, where=[parse_where(w) for w in where], **kw)]


def test_run_is_what_the_tests_assume(run_dir):
    rows = [json.loads(x) for x in (run_dir / "iter-0/advantages.jsonl").read_text().splitlines()]
    by = {r["id"]: r for r in rows}
    assert by["q1#0"]["tool_calls"] == {"image_zoom_in_tool": 2}
    assert by["q1#0"]["images"][2]["from"] == 1  # a crop of a crop
    assert by["q1#1"]["tool_calls"] == {"image_search_tool": 1} and by["q1#1"]["turns"] == 2
    assert by["q1#1"]["images"][1]["title"] == "Old town sign, 1997"
    assert by["q2#0"]["stop"] == "max_turns" and by["q2#0"]["final_answer"] is None
    assert [by[i]["reward"]["accuracy"] for i in ("q1#0", "q1#1", "q2#0", "q2#1")] == [1, 0, 0, 0]


def test_where_selects_the_right_ids(run_dir):
    f = run_dir / "iter-0/advantages.jsonl"
    assert ids(f, "reward.accuracy==0") == ["q1#1", "q2#0", "q2#1"]
    assert ids(f, "reward.accuracy>0.5") == ["q1#0"]
    assert ids(f, "turns>2") == ["q1#0", "q2#0", "q2#1"]
    assert ids(f, "turns<=2") == ["q1#1"]
    assert ids(f, "stop!=answer") == ["q2#0"]
    assert ids(f, "stop==max_turns") == ["q2#0"]
    assert ids(f, "tool_calls.image_zoom_in_tool>=1") == ["q1#0", "q2#1"]
    assert ids(f, "category==knowledge") == ["q2#0", "q2#1"]
    assert ids(f, "category==knowledge", "reward.accuracy==0", "turns>=3") == ["q2#0", "q2#1"]
    assert ids(f, "category==visual", "stop==answer", "tool_calls.image_search_tool==1") == ["q1#1"]
    # a numeric-looking value against a string field compares as a string; quotes force a string
    assert ids(f, "final_answer==1997") == ["q1#0", "q2#1"]
    assert ids(f, 'final_answer=="1997"') == ["q1#0", "q2#1"]
    assert ids(f, "final_answer==null") == ["q2#0"]
    # lists: == is membership
    assert ids(f, "answer_gt==Eiffel") == ["q2#0", "q2#1"]
    assert ids(f, "answer_gt!=Eiffel") == ["q1#0", "q1#1"]
    # dotted path through a list index, and a nested advantage field
    assert ids(f, "segments.0.role==prompt") == ["q1#0", "q1#1", "q2#0", "q2#1"]
    assert ids(f, "advantage>0") == ["q1#0", "q2#1"]
    assert ids(f, "group.size==2", "advantage<0") == ["q1#1", "q2#0"]
    # missing fields never match, whatever the operator
    assert ids(run_dir / "iter-0/rollouts.jsonl", "reward.accuracy==0") == []
    assert ids(run_dir / "iter-0/rollouts.jsonl", "reward.accuracy!=0") == []
    assert ids(f, "tool_calls.image_search_tool!=1") == []  # only q1#1 has the key at all
    assert ids(f, "reward.status!=unscored") == []
    # --id and --limit
    assert ids(f, ids=["q2#0", "q1#0"]) == ["q1#0", "q2#0"]
    assert ids(f, "reward.accuracy==0", limit=2) == ["q1#1", "q2#0"]
    assert ids(f, "reward.accuracy==0", ids=["q1#0"]) == []


def test_where_equality_on_a_zero_and_the_unscored_row(run_dir):
    f = run_dir / "iter-1/scored.jsonl"
    assert ids(f, "reward.status==unscored") == ["q2#1"]
    assert ids(f, "reward.accuracy==1") == ["q1#0", "q1#1"]
    assert ids(f, "reward.total==1.5") == ["q1#0", "q1#1"]


@pytest.mark.parametrize("expr", ["turns", "turns=3", "==3", "turns>", "turns>abc",
                                  "turns>>3", "reward..accuracy==0", "stop>=answer"])
def test_bad_where_expressions_are_bad_input(expr):
    from marscli.errors import BadInput
    from marscli.view.inspect import parse_where

    with pytest.raises(BadInput, match="--where"):
        parse_where(expr)


def test_cli_bad_where_exits_2_with_one_line(run_dir):
    res = cli("inspect", str(run_dir / "iter-0/scored.jsonl"), "--where", "turns>>3")
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --where 'turns>>3'"), res.stderr
    assert res.stdout == ""


def test_cli_bad_file_names_file_and_line(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"v": 1, "id": "a", "segments": []}\n{not json\n')
    res = cli("inspect", str(f), "--ids")
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1].startswith(f"error: {f}:2: not valid JSON")


def test_cli_ids_and_json(run_dir):
    f = str(run_dir / "iter-0/advantages.jsonl")
    res = cli("inspect", f, "--where", "reward.accuracy==0", "--where", "turns>2", "--ids")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["q2#0", "q2#1"]
    assert "2 trajectories matched" in res.stderr
    res = cli("inspect", f, "--id", "q1#1", "--json")
    rows = [json.loads(x) for x in res.stdout.splitlines()]
    assert [r["id"] for r in rows] == ["q1#1"] and rows[0]["advantage"] < 0
    res = cli("inspect", f, "--limit", "0")
    assert res.returncode == 2 and "--limit" in res.stderr


def test_options_are_checked_by_the_stage(tmp_path):
    from marscli.errors import BadInput
    from marscli.stages.inspect import main

    with pytest.raises(BadInput, match=r"^--limit: 0 is out of range — must be >= 1$"):
        main(str(tmp_path / "missing.jsonl"), limit=0)
    with pytest.raises(BadInput, match=r"^--json and --ids: pick one$"):
        main(str(tmp_path / "missing.jsonl"), as_json=True, as_ids=True)


def test_rendered_text_shows_the_trajectory(run_dir):
    """Plain text (stdout is not a terminal): thinking, tool call, observation, answer, gold,
    reward, advantage, and the token counts with the mask share checked by hand."""
    f = run_dir / "iter-0/advantages.jsonl"
    res = cli("inspect", str(f), "--id", "q1#0")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "\x1b[" not in out  # no colour codes when piped
    rec = next(json.loads(x) for x in f.read_text().splitlines() if '"q1#0"' in x)
    for s in ("The sign is small.", "Closer.", "I can read it now.",
              ('--- turn 1 · tool call ---\nimage_zoom_in_tool {"bbox_2d":[500,500,1000,1000],'
               '"label":"corner"}'),
              "--- turn 3 · answer ---\n1997", "gold: 1997", "answer: 1997",
              "reward: total 1.5 · accuracy 1 · format 0.5 · judge exact",
              "stop: answer after 3 turn(s)", "Zoomed in on image 0 (corner)",
              "crop of image 1, bbox [0, 0, 500, 250]", "question: What year is on the sign?"):
        assert s in out, s
    assert rec["advantage"] == 0.5
    assert "advantage: +0.5 (group mean 1, std 0.5, size 2)" in out
    # by hand: image placeholders -n count n tokens; only model tokens are under the mask
    n = {"prompt": 0, "model": 0, "tool": 0}
    for seg in rec["segments"]:
        for t in seg["tokens"]:
            n[seg["role"]] += -t if t < 0 else 1
    total = n["prompt"] + n["model"] + n["tool"]
    assert any(t < -1 for t in rec["segments"][0]["tokens"])  # the input image is compact
    assert n["model"] == sum(len(s["tokens"]) for s in rec["segments"] if s["role"] == "model")
    share = f"loss mask {n['model']:,}/{total:,} = {100 * n['model'] / total:.1f}%"
    counts = f"prompt {n['prompt']:,} · model {n['model']:,} · tool {n['tool']:,}"
    assert f"tokens: {counts} · {share}" in out
    assert 0 < n["model"] / total < 0.5


def test_rendered_text_of_failures(run_dir):
    from marscli.view.inspect import render_plain

    rows = {json.loads(x)["id"]: json.loads(x)
            for x in (run_dir / "iter-1/scored.jsonl").read_text().splitlines()}
    out = render_plain(rows["q2#1"])  # never a valid turn, and the judge failed
    assert "--- turn 1 · format error: no <tool_call> or <answer> in the reply ---" in out
    assert "no tags at all" in out and "answer: (none)" in out
    assert "reward: unscored (judge timed out)" in out and "advantage: —" in out
    out = render_plain(rows["q2#0"])  # image search: the thumbnail and its title
    assert "search result 'Tower by Gustave Eiffel'" in out
    assert "observation · image_search_tool · ok" in out


def test_rich_rendering_on_a_terminal(run_dir):
    import io

    from rich.console import Console

    from marscli.view.inspect import render_rich

    rec = json.loads((run_dir / "iter-0/scored.jsonl").read_text().splitlines()[0])
    buf = io.StringIO()
    render_rich(rec, Console(file=buf, force_terminal=True, width=120, color_system=None))
    out = buf.getvalue()
    assert "The sign is small." in out and "turn 3 · answer" in out and "loss mask" in out
