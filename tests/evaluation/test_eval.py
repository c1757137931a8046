"""`marscli eval` end to end: agent and direct evals over a mixed fixture (open and
multiple-choice items) with scripted replies whose accuracy is computable by hand, the tiny
model's own eval, resumption after kill -9, shards that add up to one run, `eval summarize` /
`eval rescore` (and their older flags), judge failures that fail loudly, and bad input refused
before anything runs."""

from __future__ import annotations

import shutil
from pathlib import Path

import orjson
import pytest
from PIL import Image

from marscli.errors import BadInput, RuntimeFailure
from marscli.evaluation.paths import summary_path
from marscli.evaluation.summary import summarize
from marscli.stages.eval import run_eval
from marscli.stages.eval_summarize import run_summarize

from helpers import (
    HR_HEADER,
    MIXED,
    answer,
    hr_rows,
    invoke,
    kill_9_after_first_record,
    marscli,
    png,
    read_jsonl,
    strip_ms,
    write_bench,
    write_jsonl,
    write_parquet,
    write_tsv,
)


def replay(tiny_model, **kw) -> dict:
    return {"policy": str(tiny_model), "engine": "replay", "max_turns": kw.pop("max_turns", 4),
            "progress": False, **kw}


# ----------------------------------------------------------------------- mixed fixture


@pytest.fixture(scope="module")
def mixed_runs(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mixed")
    bench = write_bench(tmp / "bench" / "mixed.jsonl", MIXED)
    agent = run_eval(str(bench), str(tmp / "agent" / "r.jsonl"), **replay(tiny_model))
    direct = run_eval(str(bench), str(tmp / "direct" / "r.jsonl"), mode="direct",
                      **replay(tiny_model, max_turns=None))
    return tmp, agent, direct


def test_agent_eval_summary_is_hand_computable(mixed_runs):
    tmp, s, _ = mixed_runs
    assert s == orjson.loads((tmp / "agent" / "r.summary.json").read_bytes())
    assert s["trajectories"] == 6 and s["unscored"] == 0 and not s["over_unscored"]
    fv, vs = s["benchmarks"]["fvqa"], s["benchmarks"]["vstar"]
    assert (fv["protocol"], fv["mode"], fv["metric"]) == ("mars", "agent", "accuracy")
    assert fv["items"] == 3 and fv["accuracy"] == 33.33  # o1 only
    assert vs["items"] == 3 and vs["accuracy"] == 66.67  # m1 and m3
    assert vs["categories"]["direct_attributes"]["accuracy"] == 50.0
    assert vs["categories"]["relative_position"]["accuracy"] == 100.0
    assert vs["tool_use"]["image_zoom_in_tool"] == {"histogram": {"0": 2, "1": 1},
                                                    "mean": 0.333}
    assert vs["mean_turns"] == pytest.approx(4 / 3, abs=1e-3)
    assert fv["stops"] == {"answer": 2, "max_turns": 1}  # o3 never tagged an answer
    assert vs["samples_per_item"] == {"min": 1, "max": 1}
    # the paper's numbers beside ours
    assert vs["paper"]["SenseNova-MARS-8B"] == 92.2 and vs["paper"]["SenseNova-MARS-32B"] == 94.2
    assert fv["paper"]["SenseNova-MARS-8B"] == 67.11 and fv["paper"]["items"] == 1800


def test_agent_eval_records(mixed_runs):
    tmp, _, _ = mixed_runs
    recs = {r["id"]: r for r in read_jsonl(tmp / "agent" / "r.jsonl")}
    assert sorted(recs) == ["m1#0", "m2#0", "m3#0", "o1#0", "o2#0", "o3#0"]
    for r in recs.values():
        assert r["v"] == 1 and r["mode"] == "agent" and r["segments"]
        assert r["benchmark"] in ("fvqa", "vstar") and r["category"]
    assert recs["o1#0"]["score"] == {"protocol": "mars", "accuracy": 1.0, "method": "exact"}
    assert recs["o2#0"]["score"] == {"protocol": "mars", "accuracy": 0.0, "method": "exact",
                                     "judge": "exact"}
    assert recs["o3#0"]["score"]["method"] == "no_answer"
    assert recs["m2#0"]["score"] == {"protocol": "mars", "accuracy": 0.0, "method": "letter"}
    assert recs["m2#0"]["tool_calls"] == {"image_zoom_in_tool": 1}
    assert (tmp / "agent" / recs["m2#0"]["images"][1]["path"]).is_file()  # the crop
    meta = orjson.loads((tmp / "agent" / "r.jsonl.meta.json").read_bytes())
    assert meta["stage"] == "eval" and meta["stats"]["new"] == 6
    assert meta["config"]["mode"] == "agent" and meta["config"]["protocol"] == "mars"
    assert not list(tmp.rglob("*.tmp-*"))


def test_direct_eval_has_no_tools_and_one_turn(mixed_runs):
    tmp, _, s = mixed_runs
    recs = {r["id"]: r for r in read_jsonl(tmp / "direct" / "r.jsonl")}
    assert all(r["turns"] == 1 and r["mode"] == "direct" for r in recs.values())
    # m2's first reply calls a tool that direct mode does not offer: no answer in its turn
    assert recs["m2#0"]["stop"] == "max_turns" and recs["m2#0"]["tool_errors"] == {
        "image_zoom_in_tool": 1}
    vs = s["benchmarks"]["vstar"]
    assert vs["mode"] == "direct" and vs["accuracy"] == 66.67 and vs["mean_turns"] == 1.0
    assert vs["paper"]["SenseNova-MARS-8B"] is None and "no direct-answer" in vs["paper"]["note"]
    assert vs["paper"]["baselines"]["Qwen3-VL-8B-Instruct"] == 86.4
    assert s["benchmarks"]["fvqa"]["accuracy"] == 33.33


def test_prompts_differ_between_modes(mixed_runs, tiny_model):
    from marscli.qwen.policy import load_processor

    tmp, _, _ = mixed_runs
    tok = load_processor(str(tiny_model)).tokenizer
    a = read_jsonl(tmp / "agent" / "r.jsonl")[0]["segments"][0]["tokens"]
    d = read_jsonl(tmp / "direct" / "r.jsonl")[0]["segments"][0]["tokens"]
    text_a = tok.decode([t for t in a if t >= 0])
    text_d = tok.decode([t for t in d if t >= 0])
    assert "image_zoom_in_tool" in text_a and "# Tools" in text_a
    assert "# Tools" not in text_d and "You have no tools" in text_d


# ----------------------------------------------------------------------- the tiny model


@pytest.mark.slow
def test_tiny_model_direct_and_agent_eval(tiny_model, tmp_path):
    bench = write_bench(tmp_path / "b" / "mixed.jsonl",
                        [{k: v for k, v in r.items() if k != "replies"} for r in MIXED[::2]])
    common = ["--policy", str(tiny_model), "--max-turn-tokens", "6", "--samples", "2",
              "--temperature", "1", "--seed", "1"]
    for mode in ("direct", "agent"):
        out = tmp_path / mode / "r.jsonl"
        res = marscli("eval", str(bench), "-o", str(out), "--mode", mode, "--max-turns",
                      "1" if mode == "direct" else "2", *common)
        assert res.returncode == 0, res.stderr
        assert res.stdout == "" and "accuracy" in res.stderr  # the table goes to stderr
        s = orjson.loads(summary_path(out).read_bytes())
        assert s["trajectories"] == 6 and s["unscored"] == 0
        assert set(s["benchmarks"]) == {"fvqa", "vstar"}
        for b in s["benchmarks"].values():
            assert b["mode"] == mode and 0 <= b["accuracy"] <= 100
            assert b["samples_per_item"] == {"min": 2, "max": 2}
            assert 1 <= b["mean_turns"] <= (1 if mode == "direct" else 2)
        recs = read_jsonl(out)
        assert sorted(r["id"] for r in recs) == ["m2#0", "m2#1", "o1#0", "o1#1", "o3#0", "o3#1"]
        assert all("accuracy" in r["score"] for r in recs)
        assert all(lp <= 0 for r in recs for sg in r["segments"] if sg["role"] == "model"
                   for lp in sg["logprobs"])


# ----------------------------------------------------------------------- resumption


@pytest.mark.slow
def test_kill_9_then_resume(tiny_model, tmp_path):
    rows = [{**MIXED[i % len(MIXED)], "id": f"q{i:02d}"} for i in range(24)]
    bench = write_bench(tmp_path / "b" / "bench.jsonl", rows)
    out = tmp_path / "killed" / "r.jsonl"
    args = ["eval", str(bench), "-o", str(out), "--policy", str(tiny_model), "--engine",
            "replay", "--samples", "4", "--batch-size", "2", "--max-turns", "4"]
    partial = kill_9_after_first_record(args, out)
    assert 0 < partial < 96, "the kill must land mid-run"
    assert not summary_path(out).exists()
    with out.open("ab") as fh:  # a torn last record is cut on resume
        fh.write(b'{"v": 1, "id": "q99#0", "segm')
    res = marscli(*args, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "cut a torn last record" in res.stderr
    resumed = read_jsonl(out)
    ids = [r["id"] for r in resumed]
    assert len(ids) == len(set(ids)) == 96
    s = orjson.loads(summary_path(out).read_bytes())
    meta = orjson.loads(Path(f"{out}.meta.json").read_bytes())["stats"]
    assert meta["new"] + meta["skipped"] == 96 and meta["skipped"] >= partial
    # the same records and summary as a run never interrupted
    clean = tmp_path / "clean" / "r.jsonl"
    s_clean = run_eval(str(bench), str(clean), samples=4, batch_size=2,
                       **replay(tiny_model))
    want = {r["id"]: strip_ms(r) for r in read_jsonl(clean)}
    assert {r["id"]: strip_ms(r) for r in resumed} == want
    assert s["benchmarks"] == s_clean["benchmarks"]
    assert s["benchmarks"]["vstar"]["accuracy"] == 66.67  # 4 samples each, all alike


def test_a_finished_eval_that_grows_loses_its_summary_first(tiny_model, tmp_path, monkeypatch):
    """More items in a finished eval's benchmark: the summary (make's target) and the sidecar
    go before the first new record, so a kill mid-way leaves neither claiming completion."""
    bench = write_bench(tmp_path / "b.jsonl", MIXED[:2])
    out = tmp_path / "r.jsonl"
    run_eval(str(bench), str(out), **replay(tiny_model))
    assert summary_path(out).is_file() and Path(f"{out}.meta.json").is_file()

    def killed(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr("marscli.agent.runner._append", killed)
    write_bench(bench, MIXED[:4])
    with pytest.raises(KeyboardInterrupt):
        run_eval(str(bench), str(out), **replay(tiny_model))
    assert not summary_path(out).exists() and not Path(f"{out}.meta.json").exists()


def test_finished_eval_loads_no_model(tiny_model, tmp_path, monkeypatch):
    bench = write_bench(tmp_path / "b.jsonl", MIXED[:2])
    out = tmp_path / "r.jsonl"
    run_eval(str(bench), str(out), **replay(tiny_model))
    before = out.read_bytes()

    def no_engine(*a, **kw):
        raise AssertionError("the engine was loaded")

    monkeypatch.setattr("marscli.agent.runner.make_engine", no_engine)
    again = run_eval(str(bench), str(out), **replay(tiny_model))
    assert out.read_bytes() == before and again["trajectories"] == 2


@pytest.mark.parametrize("change, part", [
    ({"question": "What shape?"}, "question"),
    ({"answer": ["blue"]}, "answer"),
    ({"image": "blue.png"}, "image"),
])
def test_an_item_changed_under_its_id_is_refused_on_resume(tiny_model, tmp_path, change, part):
    """A benchmark item that kept its id but changed its question, image or gold: before, its
    old scored records were kept as done; now exit 2 naming the item, and --force redoes."""
    from PIL import Image

    bench = write_bench(tmp_path / "b.jsonl", MIXED[:2])
    Image.new("RGB", (64, 48), (30, 30, 200)).save(tmp_path / "blue.png")
    out = tmp_path / "r.jsonl"
    args = ["eval", str(bench), "-o", str(out), "--policy", str(tiny_model), "--engine",
            "replay", "--max-turns", "4"]
    assert invoke(args)[0] == 0
    before = out.read_bytes()
    write_bench(bench, [MIXED[0], {**MIXED[1], **change}, MIXED[2]])  # o3 appended
    code, _, err = invoke(args)
    err = err.splitlines()[-1]  # after the line saying what was loaded
    assert code == 2 and err.startswith(f"error: {out}:2: "), err
    assert f"{part}: prompt 'o2' changed since its records" in err and "--force" in err, err
    assert out.read_bytes() == before
    code, _, err = invoke([*args, "--force"])
    assert code == 0, err
    assert [r["id"] for r in read_jsonl(out)] == ["o1#0", "o2#0", "o3#0"]


def test_an_appended_item_resumes(tiny_model, tmp_path):
    bench = write_bench(tmp_path / "b.jsonl", MIXED[:2])
    out = tmp_path / "r.jsonl"
    run_eval(str(bench), str(out), **replay(tiny_model))
    write_bench(bench, MIXED[:3])
    s = run_eval(str(bench), str(out), **replay(tiny_model))
    assert s["trajectories"] == 3
    assert [r["id"] for r in read_jsonl(out)] == ["o1#0", "o2#0", "o3#0"]


# ----------------------------------------------------------------------- shards


def test_shards_add_up_to_one_run(tiny_model, tmp_path):
    rows = [{**MIXED[i % len(MIXED)], "id": f"item-{i}"} for i in range(12)]
    bench = write_bench(tmp_path / "b" / "bench.jsonl", rows)
    whole = run_eval(str(bench), str(tmp_path / "all" / "r.jsonl"), **replay(tiny_model))
    parts = []
    for i in range(3):
        out = tmp_path / "parts" / f"s{i}.jsonl"
        run_eval(str(bench), str(out), shard=(i, 3), **replay(tiny_model))
        parts.append({r["id"] for r in read_jsonl(out)})
    assert all(parts) and sum(map(len, parts)) == 12
    assert set().union(*parts) == {r["id"] for r in read_jsonl(tmp_path / "all" / "r.jsonl")}
    # a shard that gets no item still succeeds, with an empty summary
    from marscli.records.shards import shard_of

    empty = next(i for i in range(50) if all(shard_of(f"item-{k}", 50) != i for k in range(12)))
    s = run_eval(str(bench), str(tmp_path / "empty" / "r.jsonl"), shard=(empty, 50),
                 **replay(tiny_model))
    assert s["benchmarks"] == {} and s["trajectories"] == 0
    merged = tmp_path / "parts" / "merged.jsonl"
    merged.write_bytes(b"".join((tmp_path / "parts" / f"s{i}.jsonl").read_bytes()
                                for i in range(3)))
    s = run_summarize(str(merged))
    assert s["benchmarks"] == whole["benchmarks"]
    # merging a shard twice is refused, naming the line
    merged.write_bytes(merged.read_bytes() + (tmp_path / "parts" / "s0.jsonl").read_bytes())
    with pytest.raises(BadInput, match=r"merged\.jsonl:\d+: id: duplicate .* merged twice"):
        run_summarize(str(merged))


# ----------------------------------------------------------------------- summarize / rescore


def test_samples_average_per_item(tmp_path):
    def row(rid: str, acc: float | None) -> dict:
        score = {"protocol": "mars", "accuracy": acc} if acc is not None else {
            "protocol": "mars", "status": "unscored", "error": "judge down"}
        return {"v": 1, "id": rid, "prompt_id": rid.split("#")[0], "benchmark": "fvqa",
                "category": "c", "turns": 1, "stop": "answer", "tool_calls": {},
                "mode": "agent", "score": score}

    res = tmp_path / "r.jsonl"
    rows = [row("a#0", 1.0), row("a#1", 0.0), row("b#0", 1.0), row("b#1", None),
            row("c#0", None)]
    res.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    s = summarize(str(res))
    fv = s["benchmarks"]["fvqa"]
    # a: mean(1, 0) = .5; b: 1 (its unscored sample excluded); c: no scored sample, excluded
    assert fv["accuracy"] == 75.0 and fv["items"] == 3 and fv["scored_items"] == 2
    assert fv["unscored"] == 2 and s["over_unscored"]
    with pytest.raises(RuntimeFailure, match=r"2 of 5 trajectories unscored.*marscli eval rescore"):
        run_summarize(str(res))
    assert not summary_path(res).exists()  # nothing make would take for done


def test_rescore_switches_protocol(tiny_model, tmp_path):
    bench = write_bench(tmp_path / "b" / "mm.jsonl", [
        {"id": "a", "benchmark": "mmsearch", "question": "Where?", "answer": ["Eiffel Tower"],
         "replies": [answer("Eiffel Tower, Paris")]},
        {"id": "b", "benchmark": "mmsearch", "question": "Where?", "answer": ["Louvre"],
         "replies": [answer("the Louvre")]}])
    out = tmp_path / "r.jsonl"
    s = run_eval(str(bench), str(out), **replay(tiny_model))
    assert s["benchmarks"]["mmsearch"]["accuracy"] == 50.0  # exact match: b only
    res = marscli("eval", "--summarize", str(out), "--rescore", "--protocol", "official")
    assert res.returncode == 0, res.stderr
    mm = orjson.loads(summary_path(out).read_bytes())["benchmarks"]["mmsearch"]
    assert mm["protocol"] == "official" and mm["metric"] == "mean token F1"
    assert mm["accuracy"] == 90.0  # F1 0.8 and 1.0
    assert {r["score"]["method"] for r in read_jsonl(out)} == {"token_f1"}
    res = marscli("eval", "--summarize", str(out))  # recompute only: same numbers
    assert res.returncode == 0, res.stderr
    assert orjson.loads(summary_path(out).read_bytes())["benchmarks"]["mmsearch"] == mm


def _eval_in(folder: Path, args: list[str]) -> tuple:
    """`marscli eval ARGS` run in `folder`: exit code, stdout, stderr, the folder's files and
    its sidecar (less the command line and the time taken)."""
    code, out, err = invoke(["eval", *args], cwd=folder)
    files = {p.name: p.read_bytes() for p in sorted(folder.iterdir())
             if p.is_file() and p.name != "r.jsonl.meta.json"}
    meta = orjson.loads((folder / "r.jsonl.meta.json").read_bytes()) \
        if (folder / "r.jsonl.meta.json").exists() else {}
    return code, out, err, files, {k: v for k, v in meta.items() if k not in ("command", "wall_s")}


@pytest.mark.parametrize("old, new", [
    (["--summarize", "r.jsonl"], ["summarize", "r.jsonl"]),
    (["--summary-only", "r.jsonl", "--max-unscored", "0.5"],
     ["summarize", "r.jsonl", "--max-unscored", "0.5"]),
    (["--summarize", "r.jsonl", "--rescore"], ["rescore", "r.jsonl"]),
    (["--rescore", "--protocol", "official", "--summarize", "r.jsonl", "--judge-retries", "0"],
     ["rescore", "r.jsonl", "--protocol", "official", "--judge-retries", "0"]),
])
def test_summarize_and_rescore_subcommands_equal_the_old_flags(mixed_runs, tmp_path, old, new):
    """`eval summarize|rescore RESULTS` write what `eval --summarize RESULTS [--rescore]` did,
    byte for byte: records, settings, summary, sidecar, stdout and stderr."""
    tmp, _, _ = mixed_runs
    for name in ("old", "new"):
        shutil.copytree(tmp / "agent", tmp_path / name)
    was = _eval_in(tmp_path / "old", old)
    assert was[0] == 0, was[2]
    assert _eval_in(tmp_path / "new", new) == was
    if "--protocol" in new:
        assert {r["score"]["protocol"] for r in read_jsonl(tmp_path / "new" / "r.jsonl")} == \
            {"official"}


def test_summarize_subcommand_fails_as_the_old_flag(tmp_path):
    """Too many unscored records: exit 1, the same message, no summary, either way."""
    rows = [{"v": 1, "id": f"a{i}#0", "benchmark": "fvqa", "turns": 1, "stop": "answer",
             "score": {"protocol": "mars", "status": "unscored", "error": "judge down"}
             if i < 2 else {"protocol": "mars", "accuracy": 1.0}} for i in range(4)]
    runs = []
    for name, args in (("old", ["--summarize", "r.jsonl"]), ("new", ["summarize", "r.jsonl"])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "r.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
        runs.append(_eval_in(tmp_path / name, args))
    assert runs[0] == runs[1]
    code, _, err, files, _ = runs[0]
    assert code == 1 and "2 of 4 trajectories unscored" in err and list(files) == ["r.jsonl"]


@pytest.mark.parametrize("args, message", [
    (["summarize", "-"], "eval summarize -: name the results file"),
    (["summarize", "missing.jsonl"], "eval summarize missing.jsonl: no such file"),
    (["rescore", "missing.jsonl", "--judge-timeout", "0"], "--judge-timeout: 0.0 is out of"),
    (["rescore", "missing.jsonl", "--max-unscored", "2"], "--max-unscored: 2.0 is out of"),
    (["-o", "r.jsonl", "--samples", "0", "b.jsonl"], "--samples: 0 is out of range"),
    (["summarize", "r.jsonl", "--by", "vstar"],
     "--by: compares checkpoints, and r.jsonl is one results file"),
    (["summarize", "r.jsonl", "--json"], "--json: compares checkpoints"),
    (["b.jsonl", "extra"], None),  # a usage error, as for any command
])
def test_eval_command_line_forms(tmp_path, args, message):
    code, out, err = invoke(["eval", *args], cwd=tmp_path)
    assert code == 2 and out == "" and not list(tmp_path.iterdir())
    if message is not None:
        assert err.startswith(f"error: {message}") and err.count("\n") == 1, err
    else:
        assert "Got unexpected extra argument(s) (extra)" in err


def test_judge_failure_is_unscored_and_exits_1(tiny_model, tmp_path):
    bench = write_bench(tmp_path / "b.jsonl", MIXED[:2])  # o2 is not an exact match
    out = tmp_path / "r.jsonl"
    res = marscli("eval", str(bench), "-o", str(out), "--policy", str(tiny_model),
                  "--engine", "replay", "--judge", "openai:judge@http://127.0.0.1:9/v1",
                  "--judge-retries", "0", "--judge-timeout", "5",
                  "--judge-cache", str(tmp_path / "j.sqlite"))
    assert res.returncode == 1, res.stderr
    assert "1 of 2 trajectories unscored" in res.stderr.splitlines()[-1]
    recs = {r["id"]: r["score"] for r in read_jsonl(out)}
    assert recs["o1#0"]["accuracy"] == 1.0  # exact: the judge was not needed
    assert recs["o2#0"]["status"] == "unscored" and "connection failed" in recs["o2#0"]["error"]
    # the results are kept (resumable), but nothing make would take for a finished eval
    assert not summary_path(out).exists() and not Path(f"{out}.meta.json").exists()
    s = summarize(str(out), max_unscored=1.0)
    assert s["benchmarks"]["fvqa"]["accuracy"] == 100.0 and s["unscored"] == 1


# ----------------------------------------------------------------------- bad input


def test_unknown_format_exits_2_listing_names(tmp_path):
    bench = write_bench(tmp_path / "b.jsonl", MIXED[:1])
    out = tmp_path / "out" / "r.jsonl"
    res = marscli("eval", str(bench), "-o", str(out), "--format", "nope")
    assert res.returncode == 2
    assert res.stderr.startswith("error: unknown --format 'nope' — choose one of: auto, fvqa, "
                                 "hr-mmsearch, hrbench, infoseek, livevqa, mars, "
                                 "mat-search, mme-realworld, mmsearch, simplevqa, vstar")
    assert res.stderr.count("\n") == 1 and not (tmp_path / "out").exists()


def test_tsv_missing_column_exits_2(tmp_path):
    tsv = tmp_path / "hr_bench_4k.tsv"
    tsv.write_text("index\tquestion\tA\tB\tC\tD\tcategory\timage\n0\tq\ta\tb\tc\td\tx\ty\n")
    out = tmp_path / "out" / "r.jsonl"
    res = marscli("eval", str(tsv), "-o", str(out), "--policy", "x")
    assert res.returncode == 2
    assert res.stderr.startswith(f"error: {tsv}:1: header: missing column 'answer'")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, message", [
    (["--mode", "direct", "--text-search", "serper"], "--text-search: not used with --mode"),
    (["--samples", "0"], "--samples"),
    (["--samples", "5000"], "--samples"),
    (["--protocol", "nope"], "unknown --protocol 'nope'"),
    (["--shard", "2/2"], "--shard"),
    (["--judge", "nope"], "--judge 'nope'"),
    (["--rescore"], "--rescore: only with --summarize"),
    (["-o", "-"], "-o -"),
])
def test_bad_options_exit_2(tiny_model, tmp_path, args, message):
    bench = write_bench(tmp_path / "b.jsonl", MIXED[:1])
    args = args if "-o" in args else ["-o", str(tmp_path / "out" / "r.jsonl"), *args]
    res = marscli("eval", str(bench), "--policy", str(tiny_model), "--engine", "replay", *args)
    assert res.returncode == 2, res.stderr
    assert res.stderr.startswith(f"error: {message}") and res.stderr.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_missing_image_fails_before_generation(tiny_model, tmp_path):
    bench = write_bench(tmp_path / "b.jsonl", MIXED[:1] + [
        {"id": "bad", "question": "q", "answer": ["x"], "image": "missing.png"}])
    out = tmp_path / "out" / "r.jsonl"
    with pytest.raises(BadInput, match=r"b\.jsonl:2: image: .*missing\.png"):
        run_eval(str(bench), str(out), **replay(tiny_model))
    assert not out.exists()


@pytest.mark.parametrize("args", [["--check"], ["-o", "out/r.jsonl", "--engine", "replay"]])
def test_an_item_without_gold_is_refused_by_check_and_eval(tiny_model, tmp_path, args):
    """Never scored 0 and counted: the row is named, nothing is written."""
    bench = write_bench(tmp_path / "b.jsonl", MIXED[:1] + [
        {"id": "nogold", "benchmark": "fvqa", "question": "q", "answer": []}])
    code, out, err = invoke(["eval", bench.name, "--policy", str(tiny_model), *args],
                            cwd=tmp_path)
    assert code == 2 and out == "", err
    assert err.startswith("error: b.jsonl:2: answer: missing gold answer"), err
    assert err.count("\n") == 1 and not (tmp_path / "out").exists()


def test_check_names_a_file_in_the_working_folder(tiny_model, tmp_path):
    """A file given by its bare name is named by its folder, as any other path is (not "")."""
    bench = write_bench(tmp_path / "b.jsonl", MIXED[:1])
    code, _, err = invoke(["eval", bench.name, "--check"], cwd=tmp_path)
    assert code == 0, err
    assert f"check: {tmp_path.name} (mars format" in err, err


@pytest.mark.parametrize("args", [["--check"], ["-o", "out/r.jsonl", "--engine", "replay"]])
def test_an_image_the_processor_refuses_is_named_before_generation(tiny_model, tmp_path, args):
    """50000 x 10 is over the 200:1 aspect ratio Qwen-VL's processor takes: one line naming
    the row, exit 2, before any model loads (not a traceback mid-run that writes nothing)."""
    write_bench(tmp_path / "b.jsonl", [])
    Image.new("RGB", (50_000, 10), (200, 30, 30)).save(tmp_path / "wide.png")
    bench = write_jsonl(tmp_path / "b.jsonl", [{"v": 1, "image": "red.png", **MIXED[0]},
                                               {"v": 1, **MIXED[1], "image": "wide.png"}])
    code, out, err = invoke(["eval", bench.name, "--policy", str(tiny_model), *args],
                            cwd=tmp_path)
    assert code == 2 and out == "", err
    assert err.startswith("error: b.jsonl:2: image: ") and "aspect ratio of 5000:1" in err
    assert err.count("\n") == 1 and not (tmp_path / "out").exists()


@pytest.mark.parametrize("args", [["--check"], ["-o", "out/r.jsonl", "--engine", "replay"]])
def test_split_on_a_single_file_exits_2(tiny_model, tmp_path, args):
    bench = write_bench(tmp_path / "b.jsonl", MIXED[:1])
    code, _, err = invoke(["eval", str(bench), "--split", "test", "--policy", str(tiny_model),
                           *args], cwd=tmp_path)
    assert code == 2 and err.startswith(f"error: --split test: {bench} is one file"), err
    assert err.count("\n") == 1 and not (tmp_path / "out").exists()


def test_summary_names_its_policy_and_refuses_two(mixed_runs, tmp_path, tiny_model):
    tmp, s, _ = mixed_runs
    recs = read_jsonl(tmp / "agent" / "r.jsonl")
    assert s["policy"] == str(tiny_model) and s["weights"] and recs[0]["weights"] == s["weights"]
    code, _, err = invoke(["eval", "summarize", str(tmp / "agent" / "r.jsonl")])
    assert code == 0 and f"policy {tiny_model}" in " ".join(err.split()), err
    # the records of another checkpoint appended (a second eval into the same file, a merge)
    other = [{**r, "id": r["id"] + "-b", "policy": "ckpt/iter-2", "weights": "f" * 64}
             for r in recs[:2]]
    mixed = write_jsonl(tmp_path / "mixed.jsonl", recs + other)
    with pytest.raises(BadInput, match=rf"mixed\.jsonl:7: policy: records of two policies, "
                                       rf"'{tiny_model}' \(line 1\) and 'ckpt/iter-2'"):
        run_summarize(str(mixed))
    assert not summary_path(mixed).exists()
    # the same weights under another name (a checkpoint moved before a resume): one policy
    moved = [{**r, "id": r["id"] + "-b", "policy": "elsewhere"} for r in recs[:2]]
    assert summarize(str(write_jsonl(tmp_path / "moved.jsonl", recs + moved)))["policy"] == \
        str(tiny_model)


# ----------------------------------------------------------------------- other formats end to end


def test_tsv_benchmark_end_to_end_with_the_tiny_model(tiny_model, tmp_path):

    tsv = write_tsv(tmp_path / "bench" / "hr_bench_4k.tsv", HR_HEADER, hr_rows())
    out = tmp_path / "runs" / "r.jsonl"
    s = run_eval(str(tsv), str(out), policy=str(tiny_model), mode="direct", protocol="official",
                 max_turn_tokens=4, progress=False)
    hb = s["benchmarks"]["hrbench-4k"]
    assert hb["items"] == 3 and hb["protocol"] == "official"
    assert set(hb["rotations"]) == {"cycle1", "cycle2"}
    assert hb["metric"] == "mean over option rotations"
    assert hb["paper"]["SenseNova-MARS-8B"] is None  # direct mode: not reported
    recs = read_jsonl(out)
    cached = {(out.parent / r["images"][0]["path"]).resolve() for r in recs}
    assert len(cached) == 1 and next(iter(cached)).parent == (out.parent / "eval-images").resolve()
    assert all(r["choices"] and r["answer_gt"][0] in "ABCD" for r in recs)


def test_parquet_benchmark_end_to_end(tiny_model, tmp_path):
    pytest.importorskip("pyarrow")

    f = write_parquet(tmp_path / "mmsearch.parquet", [
        {"sample_id": "s1", "query": "Where?", "query_image": {"bytes": png(), "path": None},
         "gt_answer": "Eiffel Tower", "alternative_gt_answers": [], "area": "news",
         "replies": [answer("Eiffel Tower, Paris")]},
        {"sample_id": "s2", "query": "Where?", "query_image": {"bytes": png((0, 0, 9)),
         "path": None}, "gt_answer": "Louvre", "alternative_gt_answers": ["Louvre Museum"],
         "area": "knowledge", "replies": [answer("Louvre Museum")]}])
    out = tmp_path / "r.jsonl"
    s = run_eval(str(f), str(out), protocol="official", **replay(tiny_model))
    mm = s["benchmarks"]["mmsearch"]
    assert mm["accuracy"] == 90.0 and mm["metric"] == "mean token F1"  # F1 0.8 and 1.0
    assert mm["paper"]["SenseNova-MARS-8B"] == 67.84 and mm["paper"]["items"] == 171
    assert set(mm["categories"]) == {"news", "knowledge"}
