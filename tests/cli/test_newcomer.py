"""What a new user hits (issues 20 and 22): the README's pipe `rollout -o - | reward - |
advantages -`, reruns that never mix runs (settings recorded before the first record, refused
old → new, `--force`), a failed reward that leaves nothing make takes for done (its scored rows
kept in OUT.partial), unscored rows skipped by advantages, make targets that are the files
written last, merge skipping sidecars, flat groups at exactly 0, help without `<bool>`, a quiet
`marscli env`, and counts with upper bounds."""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import time

import orjson
import pytest

from marscli.agent.runner import media_dir, settings_path
from marscli.errors import BadInput, RuntimeFailure
from marscli.records.provenance import weights_fingerprint
from marscli.stages.eval import run_eval
from marscli.stages.rollout import run_rollout

from fakes import always, chat_reply
from helpers import (
    ENV,
    MARSCLI,
    MIXED,
    ROOT,
    ZOOM_THEN_ANSWER,
    invoke,
    judge_options,
    marscli,
    read_jsonl,
    write_bench,
    write_jsonl,
    write_prompts,
)


def replay(tiny_model, **kw) -> dict:
    return {"policy": str(tiny_model), "engine": "replay", "progress": False, **kw}


# ----------------------------------------------------------------------------- the pipe


def test_readme_pipe_runs_end_to_end(tiny_model, tmp_path):
    """`rollout -o - | reward - -o - | advantages - -o OUT` on real processes: trajectories
    stream as they finish, crops land in ./rollout.media with absolute paths (found from
    wherever OUT is), and each sidecar names stdin as input "-" with a hash."""
    (tmp_path / "data").mkdir()
    write_prompts(tmp_path / "data" / "p.jsonl", ["a", "b"])
    m = " ".join(MARSCLI)
    cmd = (f"{m} rollout data/p.jsonl --policy {tiny_model} --engine replay -n 2 -o - "
           f"| {m} reward - -o - | {m} advantages - -o out/adv.jsonl")
    res = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], cwd=tmp_path, env=ENV,
                         capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stderr
    assert "rollout: 4 to stdout" in res.stderr
    rows = read_jsonl(tmp_path / "out" / "adv.jsonl")
    assert sorted(r["id"] for r in rows) == ["a#0", "a#1", "b#0", "b#1"]
    assert all("advantage" in r and r["reward"]["total"] == 1.5 for r in rows)
    crops = [im for r in rows for im in r["images"] if "bbox_2d" in im]
    assert len(crops) == 4
    for im in (im for r in rows for im in r["images"]):
        assert os.path.isabs(im["path"]) and os.path.isfile(im["path"]), im
    assert all(os.path.dirname(c["path"]) == str(tmp_path / "rollout.media") for c in crops)
    meta = orjson.loads((tmp_path / "out" / "adv.jsonl.meta.json").read_bytes())
    assert list(meta["inputs"]) == ["-"] and len(meta["inputs"]["-"]) == 64
    assert not list(tmp_path.glob("*.settings.json")) and not list(tmp_path.glob("-*"))


def test_rollout_to_stdout_streams_every_job_without_resume(tiny_model, tmp_path, capfd,
                                                            monkeypatch):
    prompts = write_prompts(tmp_path / "p.jsonl", ["a"], replies=[ZOOM_THEN_ANSWER[1]])
    monkeypatch.chdir(tmp_path)
    for _ in range(2):  # no resume: the second run streams the same records again
        stats = run_rollout(str(prompts), "-", n=2, **replay(tiny_model))
        assert stats["new"] == 2 and stats["skipped"] == 0 and stats["trajectories"] == 2
    out = capfd.readouterr().out.splitlines()
    assert [orjson.loads(x)["id"] for x in out] == ["a#0", "a#1", "a#0", "a#1"]


# ----------------------------------------------------------------------------- reruns


def _copy_model(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_rerun_with_other_settings_is_refused_naming_the_setting(tiny_model, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", ["a", "b"], replies=[ZOOM_THEN_ANSWER[1]])
    out = tmp_path / "t.jsonl"
    run_rollout(str(prompts), str(out), n=2, **replay(tiny_model))
    before = out.read_bytes()
    settings = orjson.loads(settings_path(out).read_bytes())["settings"]
    assert settings["weights"] == weights_fingerprint(str(tiny_model)) and settings["n"] == 2
    other = _copy_model(tiny_model, tmp_path / "iter-1")  # the same weights elsewhere: fine
    assert run_rollout(str(prompts), str(out), n=2, batch_size=3,  # batch size: not compared
                       **replay(other))["skipped"] == 4
    cases = [({"n": 3}, r"-n differs .* \(2 → 3\)"),
             ({"temperature": 0.5}, r"--temperature differs .*4 records \(1\.0 → 0\.5\)"),
             ({"seed": 7}, r"--seed differs .* \(0 → 7\)"),
             ({"max_turns": 3}, r"--max-turns differs .* \(10 → 3\)"),
             ({"policy": str(tmp_path / "nope")}, r"--policy differs")]
    for change, match in cases:
        kw = {**replay(tiny_model), "n": 2, **change}
        with pytest.raises(BadInput, match=match + r".*--force to start over"):
            run_rollout(str(prompts), str(out), **kw)
    # the same folder with other weights (an update rewrote it)
    weights = next(other.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(BadInput, match=r"--policy \(its weights\) differs .*sha256"):
        run_rollout(str(prompts), str(out), n=2, **replay(other))
    assert out.read_bytes() == before  # nothing was added
    # the CLI: one line, exit 2; --force starts over with the new settings
    args = ["rollout", str(prompts), "-o", str(out), "--policy", str(tiny_model), "--engine",
            "replay", "-n", "2", "--temperature", "0.5"]
    code, _, err = invoke(args)
    assert code == 2 and err.count("\n") == 1 and "(1.0 → 0.5)" in err, err
    media_dir(out).mkdir(exist_ok=True)
    (media_dir(out) / "stale.png").write_bytes(b"x")
    code, _, err = invoke([*args, "--force"])
    assert code == 0, err
    assert not (media_dir(out) / "stale.png").exists()
    new = orjson.loads(settings_path(out).read_bytes())["settings"]
    assert new["temperature"] == 0.5 and len(read_jsonl(out)) == 4
    assert orjson.loads(out.with_name("t.jsonl.meta.json").read_bytes())["config"][
        "temperature"] == 0.5


def test_a_killed_run_has_its_settings_already(tiny_model, tmp_path):
    """The sidecar comes at the end; the settings are written before the first record, so a
    run killed half-way (here: its sidecar removed, a record dropped) is still checked."""
    prompts = write_prompts(tmp_path / "p.jsonl", ["a"], replies=[ZOOM_THEN_ANSWER[1]])
    out = tmp_path / "t.jsonl"
    run_rollout(str(prompts), str(out), n=3, **replay(tiny_model))
    out.with_name("t.jsonl.meta.json").unlink()
    out.write_bytes(b"".join(out.read_bytes().splitlines(keepends=True)[:2]))
    with pytest.raises(BadInput, match=r"--top-p differs .*2 records \(1\.0 → 0\.9\)"):
        run_rollout(str(prompts), str(out), n=3, top_p=0.9, **replay(tiny_model))
    assert run_rollout(str(prompts), str(out), n=3, **replay(tiny_model))["new"] == 1
    # records without any settings (an older marscli, a merged file): refused, never mixed
    settings_path(out).unlink()
    with pytest.raises(BadInput, match=r"holds 3 records but no t\.jsonl\.settings\.json"):
        run_rollout(str(prompts), str(out), n=3, **replay(tiny_model))


def test_eval_rerun_with_other_settings_is_refused(tiny_model, tmp_path):
    bench = write_bench(tmp_path / "b.jsonl", MIXED[:2])
    out = tmp_path / "r.jsonl"
    run_eval(str(bench), str(out), max_turns=4, **replay(tiny_model))
    with pytest.raises(BadInput, match=r"--temperature differs .*\(0\.0 → 0\.7\)"):
        run_eval(str(bench), str(out), max_turns=4, temperature=0.7, **replay(tiny_model))
    with pytest.raises(BadInput, match=r"--judge differs .*\(exact → openai:m@http"):
        run_eval(str(bench), str(out), max_turns=4, judge_spec="openai:m@http://127.0.0.1:9/v1",
                 **replay(tiny_model))
    s = run_eval(str(bench), str(out), max_turns=4, temperature=0.7, force=True,
                 **replay(tiny_model))
    assert s["trajectories"] == 2 and s["benchmarks"]["fvqa"]["accuracy"] == 50.0


# ----------------------------------------------------------------------------- reward failures


@pytest.fixture
def judged(tmp_path, monkeypatch):
    """Trajectory rows none of which match exactly (the judge decides), but "Paris" ones."""
    monkeypatch.setenv("MARSCLI_CACHE_DIR", str(tmp_path / "cache"))
    answers = ["Paris", "Marseille", "Lyon", "Nice", "Paris", "Lille"]
    rows = [{"v": 1, "id": f"q#{i}", "prompt_id": "q", "question": "Which city?",
             "answer_gt": ["Paris"], "final_answer": a, "stop": "answer",
             "segments": [{"role": "model", "text": f"<answer>{a}</answer>"}]}
            for i, a in enumerate(answers)]
    return write_jsonl(tmp_path / "traj.jsonl", rows)


def test_reward_with_the_judge_down_leaves_no_output_and_keeps_scored_rows(
        judged, fake_server, tmp_path):
    from marscli.stages.reward import main

    yes, no = chat_reply("<judge>Yes</judge>"), chat_reply("<judge>No</judge>")
    up = {"now": False}  # the judge: down but for Marseille, then up (answering No)
    srv = fake_server(lambda path, body, n: (200, no, 0) if up["now"] else
                      (200, yes, 0) if "Marseille" in str(body) else (500, "down", 0))
    spec = f"openai:j@{srv.url}/v1"
    out = tmp_path / "scored.jsonl"
    with pytest.raises(RuntimeFailure, match=r"3 of 6 rows unscored .*nothing was written; "
                                             r"the 3 scored rows are kept in .*scored\.jsonl"):
        main(str(judged), str(out), spec, judge_options=judge_options(retries=0))
    assert not out.exists() and not out.with_name("scored.jsonl.meta.json").exists()
    partial = read_jsonl(out.with_name("scored.jsonl.partial"))
    assert sorted(r["id"] for r in partial) == ["q#0", "q#1", "q#4"]  # 2 exact, 1 Yes
    up["now"], before = True, srv.requests()
    stats = main(str(judged), str(out), spec, judge_options=judge_options(timeout=30))
    assert stats["reused"] == 3 and stats["unscored"] == 0 and stats["cache_hits"] == 0
    assert srv.requests() - before == 3  # Lyon, Nice, Lille; q#1 came from the partial file
    rows = {r["id"]: r["reward"] for r in read_jsonl(out)}
    assert rows["q#1"]["accuracy"] == 1.0 and rows["q#2"]["accuracy"] == 0.0
    assert not out.with_name("scored.jsonl.partial").exists()
    assert out.with_name("scored.jsonl.meta.json").exists()


def test_reward_prints_no_row_scored_rather_than_accuracy_none(judged, fake_server, tmp_path,
                                                               capsys):
    from marscli.stages.reward import main

    down = fake_server(always(500, "down"))
    rows = [r for r in read_jsonl(judged) if r["final_answer"] != "Paris"]
    src = write_jsonl(tmp_path / "t2.jsonl", rows)
    stats = main(str(src), str(tmp_path / "s.jsonl"), f"openai:j@{down.url}/v1",
                 judge_options=judge_options(retries=0), max_unscored=1.0)
    err = capsys.readouterr().err
    assert stats["unscored"] == 4 and "no row scored" in err and "None" not in err


# ----------------------------------------------------------------------------- advantages


def _scored(*specs) -> list[tuple[int, dict]]:
    """Rows (prompt, reward total or None for unscored)."""
    return [(i + 1, {"v": 1, "id": f"{p}#{i}", "prompt_id": p,
                     "reward": {"total": r} if r is not None else
                     {"status": "unscored", "error": "judge down", "format": 0.0}})
            for i, (p, r) in enumerate(specs)]


def test_advantages_skip_unscored_rows_and_count_them():
    from marscli.rl.advantages import run

    rows = _scored(("a", 1.0), ("a", None), ("a", 0.0), ("b", 1.0), ("b", 0.5), ("b", None))
    out, stats = run(rows, "s.jsonl", "grpo")
    assert [r["id"] for r in out] == ["a#0", "a#2", "b#3", "b#4"]
    # groups of the scored rows only: a = [1, 0], b = [1, 0.5]; unbiased std
    sa, sb = math.sqrt(0.5), math.sqrt(0.125)
    want = [0.5 / (sa + 1e-6), -0.5 / (sa + 1e-6), 0.25 / (sb + 1e-6), -0.25 / (sb + 1e-6)]
    assert [r["advantage"] for r in out] == pytest.approx(want, rel=1e-12)
    assert out[0]["group"] == {"mean": 0.5, "std": pytest.approx(sa), "size": 2}
    assert stats["unscored_rows"] == 2 and stats["rows"] == 4
    with pytest.raises(BadInput, match=r"all 2 rows are unscored"):
        run(_scored(("a", None), ("a", None)), "s.jsonl")


def test_advantages_cli_reports_skipped_rows(tmp_path):
    rows = [r for _, r in _scored(("a", 1.0), ("a", None), ("a", 0.0))]
    src = write_jsonl(tmp_path / "s.jsonl", rows)
    out = tmp_path / "a.jsonl"
    code, _, err = invoke(["advantages", str(src), "-o", str(out)])
    assert code == 0, err
    assert "skipped 1 unscored rows" in err
    meta = orjson.loads(out.with_name("a.jsonl.meta.json").read_bytes())
    assert meta["stats"]["unscored_rows"] == 1 and len(read_jsonl(out)) == 2


@pytest.mark.parametrize("est", ["bn-gspo", "grpo", "dr-grpo", "rloo"])
def test_flat_groups_get_exactly_zero(est):
    from marscli.rl.advantages import compute

    # a flat group beside groups with signal: the batch step's mean is ~1e-17, not 0
    r = [0.1, 0.1, 0.1, 1, 1, 1, 1, 0.2, 1.2, 0.2, 1.2, 0, 1, 1, 1.2]
    g = list("aaabbbbccccdddd")
    a = compute(r, g, est)
    assert a[:7].tolist() == [0.0] * 7
    assert (a[7:] != 0).all()


# ----------------------------------------------------------------------------- make


def _touch(run, names):
    """Files that exist, each newer than the one before (as make would have left them)."""
    t = time.time() - 1000
    for i, name in enumerate(names):
        p = run / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("{}")
        os.utime(p, (t + i, t + i))


DONE_UP_TO_ROLLOUTS = ["world/train.jsonl", "world/test.jsonl", "world/sft.jsonl",
                       "world.meta.json", "world/text.sqlite", "world/text.sqlite.meta.json",
                       "base/config.json", "base.meta.json", "sft/trajectories.jsonl",
                       "sft/trajectories.jsonl.meta.json", "ckpt-0/config.json",
                       "iter-0/prompts.jsonl", "iter-0/rollouts.jsonl",
                       "iter-0/rollouts.jsonl.meta.json"]


def _plan(run) -> list[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SBATCH_", "MAKEFLAGS"))}
    r = subprocess.run(["make", "--no-print-directory", "-n", "rl-iter",
                        "RECIPE=recipes/tiny.mk", f"RUN={run}"], cwd=ROOT, env=env, text=True,
                       capture_output=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    return [m for x in r.stdout.splitlines() for m in re.findall(r"stages/(\w+\.sh)", x)]


@pytest.mark.parametrize("written, redo", [
    ([], ["reward.sh", "advantages.sh", "update.sh"]),
    (["iter-0/scored.jsonl"], ["reward.sh", "advantages.sh", "update.sh"]),  # no sidecar
    (["iter-0/scored.jsonl", "iter-0/scored.jsonl.meta.json", "iter-0/advantages.jsonl"],
     ["advantages.sh", "update.sh"]),
    (["iter-0/scored.jsonl", "iter-0/scored.jsonl.meta.json", "iter-0/advantages.jsonl",
      "iter-0/advantages.jsonl.meta.json"], ["update.sh"]),
])
def test_make_redoes_a_data_file_without_its_sidecar(tmp_path, written, redo):
    run = tmp_path / "run"
    _touch(run, DONE_UP_TO_ROLLOUTS + written)
    assert _plan(run) == redo


def test_make_redoes_a_world_or_model_without_its_sidecar(tmp_path):
    run = tmp_path / "run"
    _touch(run, [n for n in DONE_UP_TO_ROLLOUTS if n != "base.meta.json"])
    lines = subprocess.run(["make", "--no-print-directory", "-n", "rl-iter",
                            "RECIPE=recipes/tiny.mk", f"RUN={run}"], cwd=ROOT, text=True,
                           capture_output=True, timeout=120, check=True).stdout
    assert "marscli tiny-model" in lines and "marscli toy-world" not in lines


def test_make_temporary_names_are_per_process(tmp_path):
    lines = subprocess.run(["make", "--no-print-directory", "-n", "rl-iter",
                            "RECIPE=recipes/tiny.mk", f"RUN={tmp_path}/run"], cwd=ROOT,
                           text=True, capture_output=True, timeout=120, check=True).stdout
    assert "prompts.jsonl.tmp-$$" in lines and "prompts.jsonl.tmp " not in lines
    assert ".tmp " not in lines and ".tmp\n" not in lines


# ----------------------------------------------------------------------------- merge


def test_merge_glob_skips_sidecars_settings_and_media(tmp_path):
    out = tmp_path / "o.jsonl"
    write_jsonl(tmp_path / "o.jsonl.shard-0", [{"v": 1, "id": "a#0"}])
    write_jsonl(tmp_path / "o.jsonl.shard-1", [{"v": 1, "id": "b#0"}])
    for side in ("meta.json", "settings.json", "summary.json", "lock"):
        (tmp_path / f"o.jsonl.shard-0.{side}").write_text("{}")
    (tmp_path / "o.jsonl.shard-1.meta.json").write_text("{}")
    (tmp_path / "o.jsonl.shard-1.media").mkdir()
    (tmp_path / "o.jsonl.shard-1.tmp-123").write_text("torn")
    shards = sorted(str(p) for p in tmp_path.glob("o.jsonl.shard-*"))  # what the shell expands
    code, _, err = invoke(["merge", str(out), *shards])
    assert code == 0, err
    assert "from 2 shard(s)" in err and "skipped 7" in err
    assert [r["id"] for r in read_jsonl(out)] == ["a#0", "b#0"]
    meta = orjson.loads(out.with_name("o.jsonl.meta.json").read_bytes())
    assert len(meta["stats"]["skipped"]) == 7 and len(meta["inputs"]) == 2


# ----------------------------------------------------------------------------- help, env, bounds


def test_help_shows_flags_without_a_value():
    from typer.testing import CliRunner

    from marscli.cli import app

    for cmd in (["ask"], ["inspect"], ["search"], ["advantages"], ["rollout"], ["eval"],
                ["update"], ["sft"], ["tiny-model"]):
        res = CliRunner().invoke(app, [*cmd, "--help"], env={"COLUMNS": "200"})
        assert res.exit_code == 0, res.output
        assert "<bool>" not in res.output, (cmd, res.output)
    res = CliRunner().invoke(app, ["ask", "--help"], env={"COLUMNS": "200"})
    line = next(x for x in res.output.splitlines() if x.strip().startswith("--json"))
    assert line.split()[1] == "Print"  # the help text follows the flag, no value between


def test_env_prints_versions_only():
    res = marscli("env")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith("marscli: ") and all(": " in x for x in lines)
    assert "WARNING" not in res.stdout + res.stderr and "accelerator" not in res.stdout


@pytest.mark.parametrize("args, option", [
    (["rollout", "missing.jsonl", "-o", "t.jsonl", "-n", "1000000000000"], "-n"),
    (["rollout", "missing.jsonl", "-o", "t.jsonl", "--max-turn-tokens", "10000000"],
     "--max-turn-tokens"),
    (["eval", "missing.jsonl", "-o", "r.jsonl", "--samples", "100000"], "--samples"),
    (["reward", "missing.jsonl", "--judge-concurrency", "100000"], "--judge-concurrency"),
    (["advantages", "missing.jsonl", "--minibatches", "10000000"], "--minibatches"),
])
def test_counts_have_upper_bounds_checked_before_reading(tmp_path, args, option):
    code, _, err = invoke(args, cwd=tmp_path)
    assert code == 2 and err.startswith(f"error: {option}: ") and "out of range" in err, err
    assert not list(tmp_path.iterdir())
