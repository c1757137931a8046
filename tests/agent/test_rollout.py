"""`marscli rollout` end to end on the tiny model: token-exact trajectories, resumption after
kill -9, shards that add up to one run, seeded determinism, and input checked before any
generation."""

from __future__ import annotations

import random
from pathlib import Path

import orjson
import pytest

from marscli.agent.runner import media_dir
from marscli.errors import BadInput, RuntimeFailure
from marscli.qwen.tokens import assemble, expand, special_ids
from marscli.records.shards import parse_shard, shard_of
from marscli.stages.rollout import run_rollout

from fakes import FakeServer, retrieve_reply
from helpers import (
    REPLIES,
    ZOOM_THEN_ANSWER,
    invoke,
    kill_9_after_first_record,
    marscli,
    messages_of,
    read_jsonl,
    scene,
    strip_ms,
    write_prompts,
)

# ----------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_replay_rollout_is_token_exact(tiny_model, tmp_path):
    from marscli.qwen.policy import load_processor

    prompts = write_prompts(tmp_path / "p.jsonl", ["a", "b"])
    with prompts.open("ab") as fh:  # a third prompt that makes every kind of mistake first
        fh.write(orjson.dumps({"v": 1, "id": "c", "image": "scene.png", "question": "Year?",
                               "answer": ["1997"], "replies": REPLIES}) + b"\n")
    out = tmp_path / "runs" / "t.jsonl"
    res = marscli("rollout", str(prompts), "-o", str(out), "--policy", str(tiny_model),
                  "--engine", "replay", "-n", "2", "--batch-size", "4")
    assert res.returncode == 0, res.stderr
    assert res.stdout == ""
    recs = read_jsonl(out)
    assert sorted(r["id"] for r in recs) == ["a#0", "a#1", "b#0", "b#1", "c#0", "c#1"]
    assert all(r["id"] == f"{r['prompt_id']}#{r['sample']}" for r in recs)
    proc = load_processor(str(tiny_model))
    ids = special_ids(proc.tokenizer)
    media = (tmp_path / "runs" / "t.media").resolve()
    for rec in recs:
        assert rec["v"] == 1 and rec["stop"] == "answer" and rec["policy"] == str(tiny_model)
        # scripted replies have no log-probs: null, never 0 (which would claim probability 1)
        assert "logprobs_mode" in rec and rec["logprobs_mode"] is None
        models = [s for s in rec["segments"] if s["role"] == "model"]
        assert models and all("logprobs" in s and s["logprobs"] is None for s in models)
        assert all("logprobs" not in s for s in rec["segments"] if s["role"] != "model")
        ours = assemble(rec["segments"], ids.image_pad)
        msgs, images = messages_of({**rec, "_base": str(out.parent)}, proc)
        text = proc.apply_chat_template(msgs, tokenize=False)
        theirs = proc(text=[text], images=images, return_tensors="pt")["input_ids"][0].tolist()
        assert ours.input_ids == theirs[:-1]  # the template's last "\n" follows <|im_end|>
        assert rec["images"][0]["path"] == "../scene.png"
        for im in rec["images"][1:]:  # crops: relative to the output's folder, in t.media/
            assert (out.parent / im["path"]).resolve().parent == media
    meta = orjson.loads(Path(f"{out}.meta.json").read_bytes())
    s = meta["stats"]
    assert meta["stage"] == "rollout" and meta["seed"] == 0
    assert s["trajectories"] == s["new"] == 6 and s["skipped"] == 0
    assert s["turns"] == {"2": 4, "7": 2} and s["stop"] == {"answer": 6}
    assert s["tool_calls"] == {"image_zoom_in_tool": 4 + 2 * 4, "no_such_tool": 2}
    assert s["tool_errors"] == {"image_zoom_in_tool": 4, "no_such_tool": 2}
    assert s["format_errors"] == 2 and s["trajectories_per_s"] > 0
    assert s["generated_tokens_per_s"] > 0 and s["mean_response_tokens"] > 0


@pytest.mark.slow
def test_hf_rollout_is_seeded(tiny_model, tmp_path):
    """Same seed, byte-identical records apart from `ms` — even after other draws from torch's
    global generator; another seed, other samples."""
    import torch

    prompts = write_prompts(tmp_path / "p.jsonl", ["a", "b"])
    common = ["--policy", str(tiny_model), "-n", "2", "--max-turns", "2",
              "--max-turn-tokens", "8", "--batch-size", "4"]
    out_a = tmp_path / "a" / "t.jsonl"
    res = marscli("rollout", str(prompts), "-o", str(out_a), "--seed", "3", *common)
    assert res.returncode == 0, res.stderr
    recs = read_jsonl(out_a)
    assert len(recs) == 4
    for r in recs:
        assert r["logprobs_mode"] == "raw"  # log-softmax of the logits at temperature 1
        models = [s for s in r["segments"] if s["role"] == "model"]
        assert 1 <= len(models) <= 2 and r["turns"] == len(models)
        assert all(len(s["logprobs"]) == len(s["tokens"]) <= 8 for s in models)
        assert all(lp <= 0 for s in models for lp in s["logprobs"])
        prompt = expand(r["segments"][0]["tokens"], 0)
        assert 0 < prompt.count(0) < len(prompt)  # image placeholders expanded from -n
    kw = {"policy": str(tiny_model), "n": 2, "max_turns": 2, "max_turn_tokens": 8,
          "batch_size": 4, "progress": False}
    torch.manual_seed(1234)
    torch.rand(100)
    out_b = tmp_path / "b" / "t.jsonl"
    run_rollout(str(prompts), str(out_b), seed=3, **kw)
    assert [strip_ms(r) for r in read_jsonl(out_b)] == [strip_ms(r) for r in recs]
    assert all(isinstance(r["ms"], dict) for r in recs)  # timings live in `ms` only
    out_c = tmp_path / "c" / "t.jsonl"
    run_rollout(str(prompts), str(out_c), seed=4, **kw)
    assert [strip_ms(r) for r in read_jsonl(out_c)] != [strip_ms(r) for r in recs]


@pytest.mark.parametrize("temperature", ["1", "0"])  # the sampler, and greedy decoding
def test_hf_refuses_non_finite_logits_naming_the_checkpoint(tiny_model, tmp_path, temperature):
    """A diverged checkpoint (nan weights): one line naming it, exit 1, not torch's
    multinomial traceback (nor, greedy, an argmax over nan)."""
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "diverged"
    shutil.copytree(tiny_model, bad)
    w = load_file(bad / "model.safetensors")
    save_file({k: v * float("nan") if k.endswith("norm.weight") and "visual" not in k else v
               for k, v in w.items()}, bad / "model.safetensors", metadata={"format": "pt"})
    prompts = write_prompts(tmp_path / "p.jsonl", ["a"])
    res = marscli("rollout", str(prompts), "-o", str(tmp_path / "r" / "t.jsonl"), "--policy",
                  str(bad), "-n", "1", "--max-turns", "1", "--max-turn-tokens", "4",
                  "--temperature", temperature)
    assert res.returncode == 1, res.stderr
    assert f"{bad}: the model's logits are not finite" in res.stderr
    assert "Traceback" not in res.stderr


# ----------------------------------------------------------------------- resumption


@pytest.mark.slow
def test_kill_9_then_resume_loses_and_duplicates_nothing(tiny_model, tmp_path):
    ids = [f"q{i:02d}" for i in range(24)]
    prompts = write_prompts(tmp_path / "p.jsonl", ids)
    out = tmp_path / "killed" / "t.jsonl"
    args = ["rollout", str(prompts), "-o", str(out), "--policy", str(tiny_model), "--engine",
            "replay", "-n", "4", "--batch-size", "2"]
    partial = kill_9_after_first_record(args, out)
    assert 0 < partial < 96, "the kill must land mid-run"
    with out.open("ab") as fh:  # whatever the kill left, a torn last record is cut on resume
        fh.write(b'{"v": 1, "id": "q99#0", "segm')

    res = marscli(*args, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "cut a torn last record" in res.stderr
    resumed = read_jsonl(out)
    got = [r["id"] for r in resumed]
    assert len(got) == len(set(got)) == 96
    assert set(got) == {f"{i}#{k}" for i in ids for k in range(4)}
    assert list(tmp_path.rglob("*.tmp-*")) == []
    meta = orjson.loads(Path(f"{out}.meta.json").read_bytes())["stats"]
    assert meta["trajectories"] == 96 and meta["new"] + meta["skipped"] == 96
    assert meta["skipped"] >= partial

    # the same records as a run never interrupted (replay is deterministic)
    clean = tmp_path / "clean" / "t.jsonl"
    run_rollout(str(prompts), str(clean), policy=str(tiny_model), engine="replay", n=4,
                batch_size=2, progress=False)
    by_id = {r["id"]: strip_ms(r) for r in read_jsonl(clean)}
    assert {r["id"]: strip_ms(r) for r in resumed} == by_id


def test_finished_run_is_not_redone(tiny_model, tmp_path, monkeypatch):
    prompts = write_prompts(tmp_path / "p.jsonl", ["a"], replies=[ZOOM_THEN_ANSWER[1]])
    out = tmp_path / "t.jsonl"
    first = run_rollout(str(prompts), str(out), policy=str(tiny_model), engine="replay", n=3,
                        progress=False)
    before = out.read_bytes()
    # nothing left to do: the engine is not even loaded
    def no_engine(*a, **kw):
        raise AssertionError("the engine was loaded")

    monkeypatch.setattr("marscli.agent.runner.make_engine", no_engine)
    again = run_rollout(str(prompts), str(out), policy=str(tiny_model), engine="replay",
                        n=3, progress=False)
    assert out.read_bytes() == before
    assert first["new"] == 3 and again["new"] == 0 and again["skipped"] == 3
    assert again["trajectories"] == 3 and again["stop"] == {"answer": 3}


def _rewrite(prompts: Path, pid: str, **change) -> None:
    rows = [{**r, **change} if r["id"] == pid else r for r in read_jsonl(prompts)]
    prompts.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))


@pytest.mark.parametrize("change, part", [
    ({"question": "What shape?"}, "question"),
    ({"answer": ["blue"]}, "answer"),
    ({"image": "other.png"}, "image"),  # the row points at another picture
    (None, "image"),  # the same path, its picture replaced
])
def test_a_row_changed_under_its_id_is_refused_on_resume(tiny_model, tmp_path, change, part):
    """A re-run over a prompt file whose row kept its id but changed its question, image or
    gold: before, its old records were kept as done (and the sidecar hashed the new file);
    now exit 2, one line naming the id and what changed, nothing appended; --force redoes."""
    prompts = write_prompts(tmp_path / "p.jsonl", ["a", "b"], replies=[ZOOM_THEN_ANSWER[1]])
    out = tmp_path / "t.jsonl"
    args = ["rollout", str(prompts), "-o", str(out), "--policy", str(tiny_model), "--engine",
            "replay", "-n", "2"]
    assert invoke(args)[0] == 0
    before = out.read_bytes()
    scene(tmp_path / "other.png", (320, 240))
    if change is None:
        scene(tmp_path / "scene.png", (320, 240))  # both rows show it: "a" is the first
    else:
        _rewrite(prompts, "b", **change)
    code, _, err = invoke(args)
    pid = "a" if change is None else "b"
    assert code == 2 and err.count("\n") == 1, err
    assert f"{part}: prompt {pid!r} changed since its records" in err and "--force" in err, err
    assert out.read_bytes() == before
    code, _, err = invoke([*args, "--force"])
    assert code == 0, err
    assert {r["id"] for r in read_jsonl(out)} == {"a#0", "a#1", "b#0", "b#1"}


def test_appended_rows_resume_and_old_records_without_input_hash_stay_readable(tiny_model,
                                                                                tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", ["a"], replies=[ZOOM_THEN_ANSWER[1]])
    out = tmp_path / "t.jsonl"
    kw = {"policy": str(tiny_model), "engine": "replay", "n": 2, "progress": False}
    run_rollout(str(prompts), str(out), **kw)
    write_prompts(prompts, ["a", "b"], replies=[ZOOM_THEN_ANSWER[1]])  # a row appended
    stats = run_rollout(str(prompts), str(out), **kw)
    assert stats["new"] == 2 and stats["skipped"] == 2
    recs = read_jsonl(out)
    # the same content under another id: the same hashes (of the row's content, not its id)
    assert recs[0]["input_hash"] == recs[3]["input_hash"]
    assert sorted(recs[0]["input_hash"]) == ["answer", "image", "image_search", "question"]
    # records written before the field: read and resumed as they were (nothing to compare)
    out.write_bytes(b"".join(orjson.dumps({k: v for k, v in r.items() if k != "input_hash"})
                             + b"\n" for r in recs))
    write_prompts(prompts, ["a", "b", "c"], replies=[ZOOM_THEN_ANSWER[1]], question="Shape?")
    stats = run_rollout(str(prompts), str(out), **kw)
    assert stats["new"] == 2 and stats["skipped"] == 4


# ----------------------------------------------------------------------- shards


def test_shards_add_up_to_one_run(tiny_model, tmp_path):
    ids = [f"item-{i}" for i in range(12)]
    answer = [ZOOM_THEN_ANSWER[1]]
    prompts = write_prompts(tmp_path / "p.jsonl", ids, replies=answer)
    kw = {"policy": str(tiny_model), "engine": "replay", "n": 2, "progress": False}
    run_rollout(str(prompts), str(tmp_path / "all.jsonl"), **kw)
    whole = [r["id"] for r in read_jsonl(tmp_path / "all.jsonl")]
    parts = []
    for i in range(3):
        run_rollout(str(prompts), str(tmp_path / f"s{i}.jsonl"), shard=(i, 3), **kw)
        parts.append({r["id"] for r in read_jsonl(tmp_path / f"s{i}.jsonl")})
    assert all(parts) and sum(len(p) for p in parts) == len(whole) == 24
    assert set().union(*parts) == set(whole)
    # the partition follows the ids, not their order in the file
    shuffled = ids[:]
    random.Random(0).shuffle(shuffled)
    other = write_prompts(tmp_path / "shuffled.jsonl", shuffled, replies=answer)
    run_rollout(str(other), str(tmp_path / "x1.jsonl"), shard=(1, 3), **kw)
    assert {r["id"] for r in read_jsonl(tmp_path / "x1.jsonl")} == parts[1]


def test_parse_shard_and_stable_hash():
    assert parse_shard(None) == (0, 1)
    assert parse_shard("0/4") == (0, 4) and parse_shard("3/4") == (3, 4)
    for bad in ("3/2", "2/2", "1/0", "-1/2", "a/b", "1", "1/2/3"):
        with pytest.raises(BadInput, match="--shard"):
            parse_shard(bad)
    # a stable hash: shards made by another process or version must line up
    assert [shard_of(f"q{i}", 8) for i in range(10)] == [7, 2, 3, 7, 3, 5, 1, 7, 1, 0]
    assert media_dir("runs/it-1/traj.jsonl") == Path("runs/it-1/traj.media")


# ----------------------------------------------------------------------- bad input


def test_missing_image_fails_before_anything(tiny_model, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", ["ok"])
    with prompts.open("ab") as fh:
        fh.write(orjson.dumps({"v": 1, "id": "bad", "image": "missing.png",
                               "question": "q"}) + b"\n")
    out = tmp_path / "out" / "t.jsonl"
    res = marscli("rollout", str(prompts), "-o", str(out), "--policy", str(tiny_model))
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{prompts}:2" in lines[0] and "missing.png" in lines[0]
    assert not (tmp_path / "out").exists()


def test_undecodable_image_and_duplicate_ids(tiny_model, tmp_path):
    (tmp_path / "junk.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"v": 1, "id": "j", "image": "junk.png", "question": "q"}\n')
    out = tmp_path / "t.jsonl"
    with pytest.raises(BadInput, match=r"p\.jsonl:1: image: .*junk\.png.*cannot be decoded"):
        run_rollout(str(prompts), str(out), policy=str(tiny_model), engine="replay")
    write_prompts(prompts, ["x", "y", "x"])
    with pytest.raises(BadInput, match=r"p\.jsonl:3: id: duplicate id 'x' \(first on line 1\)"):
        run_rollout(str(prompts), str(out), policy=str(tiny_model), engine="replay")
    assert not out.exists()


@pytest.mark.parametrize("args, option", [
    (["--shard", "3/2"], "--shard"),
    (["-n", "0"], "-n"),
    (["--temperature", "-0.5"], "--temperature"),
    (["--top-p", "0"], "--top-p"),
    (["--max-turns", "0"], "--max-turns"),
    (["--base-url", "http://127.0.0.1:1/v1"], "--base-url"),
    (["-n", "1000000000000"], "-n"),  # an upper bound, before anything is read
    (["--batch-size", "100000"], "--batch-size"),
    (["--engine", "nope"], "unknown engine 'nope'"),
])
def test_bad_options_exit_2(tiny_model, tmp_path, args, option):
    prompts = write_prompts(tmp_path / "p.jsonl", ["a"])
    out = tmp_path / "t.jsonl"
    res = marscli("rollout", str(prompts), "-o", str(out), "--policy", str(tiny_model), *args)
    assert res.returncode == 2, res.stderr
    assert res.stderr.startswith(f"error: {option}") and res.stderr.count("\n") == 1
    assert not out.exists()


def test_policy_is_required_and_vllm_missing_is_explained(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", ["a"])
    with pytest.raises(BadInput, match="--policy: required for --engine hf"):
        run_rollout(str(prompts), str(tmp_path / "t.jsonl"))
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeFailure, match="vLLM is not installed"):
            run_rollout(str(prompts), str(tmp_path / "t.jsonl"), engine="vllm", policy="x/y")
    assert not (tmp_path / "t.jsonl").exists()


# ----------------------------------------------------------------------- media folder


def test_hostile_id_writes_only_inside_the_media_folder(tiny_model, tmp_path):
    root = tmp_path / "root"
    (root / "a" / "b").mkdir(parents=True)
    prompts = write_prompts(root / "p.jsonl", ["../../evil", "/abs/evil", "..", "ok"])
    out = root / "a" / "b" / "t.jsonl"
    run_rollout(str(prompts), str(out), policy=str(tiny_model), engine="replay", n=1,
                progress=False)
    media = (root / "a" / "b" / "t.media").resolve()
    files = {p.resolve() for p in root.rglob("*") if p.is_file()}
    outside = files - {prompts.resolve(), (root / "scene.png").resolve(), out.resolve(),
                       Path(f"{out}.meta.json").resolve(), Path(f"{out}.settings.json").resolve()}
    assert outside and all(p.parent == media for p in outside)
    assert len(outside) == 4  # one crop per trajectory, none overwriting another
    assert not list(tmp_path.rglob("evil*")) and not Path("/abs").exists()
    recs = read_jsonl(out)
    assert {(out.parent / r["images"][1]["path"]).resolve() for r in recs} == outside


def test_a_finished_output_that_grows_loses_its_sidecar_first(tiny_model, tmp_path, monkeypatch):
    """A rerun that appends to a finished output (more prompts) removes its sidecar before the
    first new record, so a kill mid-way leaves no sidecar claiming the grown file is complete
    (make's target; merge takes a shard with a sidecar as finished)."""
    out = tmp_path / "t.jsonl"
    kw = {"policy": str(tiny_model), "engine": "replay", "n": 2, "progress": False}
    prompts = write_prompts(tmp_path / "p.jsonl", ["a"], replies=[ZOOM_THEN_ANSWER[1]])
    run_rollout(str(prompts), str(out), **kw)
    sidecar = Path(f"{out}.meta.json")
    assert sidecar.is_file()

    def killed(*a, **k):
        raise KeyboardInterrupt  # where the first new record would be appended

    monkeypatch.setattr("marscli.agent.runner._append", killed)
    write_prompts(prompts, ["a", "b"], replies=[ZOOM_THEN_ANSWER[1]])
    with pytest.raises(KeyboardInterrupt):
        run_rollout(str(prompts), str(out), **kw)
    assert not sidecar.exists()
    monkeypatch.undo()
    stats = run_rollout(str(prompts), str(out), **kw)  # the resumed run writes it again
    assert stats["new"] == 2 and stats["skipped"] == 2 and sidecar.is_file()


# ------------------------------------------------------------- a search backend that fails


def search_then_answer(query: str) -> list[str]:
    return [f'<thinking>Look it up.</thinking><tool_call>{{"name": "text_search_tool", '
            f'"arguments": {{"query": "{query}"}}}}</tool_call>',
            "<thinking>Red.</thinking><answer>red</answer>"]


def retriever(fail: set[str]) -> FakeServer:
    """A Search-R1 retriever that answers HTTP 500 to the queries in `fail` (every query: "*")."""
    def script(path, body, attempt):
        query = body["queries"][0] if isinstance(body, dict) and body.get("queries") else ""
        if "*" in fail or query in fail:
            return 500, "backend down"
        return 200, retrieve_reply("Red Corp")
    return FakeServer({"/retrieve": script})


SEARCH_OPTS = {"timeout": 2.0, "attempts": 1, "backoff": 0.0, "cache": None}


def test_rollout_stops_on_a_broken_search_backend_and_resumes(tiny_model, tmp_path):
    """Every search fails: exit 1, one line naming the tool and its rate, the records kept and no
    sidecar; once the threshold allows it (or the backend is fixed), the re-run resumes."""
    prompts = write_prompts(tmp_path / "p.jsonl", ["a", "b", "c"], replies=search_then_answer("q"))
    out = tmp_path / "t.jsonl"
    args = ["rollout", str(prompts), "-o", str(out), "--policy", str(tiny_model), "--engine",
            "replay", "-n", "1", "--search-retries", "0", "--search-timeout", "2"]
    with retriever({"*"}) as srv:
        res = marscli(*args, "--text-search", f"retriever:{srv.url}")
        assert res.returncode == 1, res.stderr
        err = [line for line in res.stderr.splitlines() if line.startswith("error:")]
        assert len(err) == 1, res.stderr
        assert "text_search_tool: 100.0% of 3 calls failed" in err[0]
        assert "--max-tool-failure-rate 5%" in err[0] and "kept" in err[0]
        assert len(read_jsonl(out)) == 3  # the records are kept for the re-run
        assert not Path(f"{out}.meta.json").exists()  # make does not take it for done
        res = marscli(*args, "--text-search", f"retriever:{srv.url}",
                      "--max-tool-failure-rate", "1")
        assert res.returncode == 0, res.stderr
        assert "0 new, 3 already" in res.stderr  # resumed: nothing generated again
        assert Path(f"{out}.meta.json").is_file()


def test_a_failure_rate_under_the_threshold_passes(tiny_model, tmp_path):
    """One search in four fails (25%): over the default 5% the run stops, under 30% it passes."""
    prompts = write_prompts(tmp_path / "p.jsonl", ["a"], replies=search_then_answer("fail"))
    with prompts.open("ab") as fh:
        for pid in ("b", "c", "d"):
            fh.write(orjson.dumps({"v": 1, "id": pid, "image": "scene.png", "question": "Q?",
                                   "answer": ["red"], "replies": search_then_answer(pid)})
                     + b"\n")
    kw = {"engine": "replay", "policy": str(tiny_model), "n": 1, "progress": False,
          "search_opts": SEARCH_OPTS}
    with retriever({"fail"}) as srv:
        with pytest.raises(RuntimeFailure, match=r"text_search_tool: 25\.0% of 4 calls failed"):
            run_rollout(str(prompts), str(tmp_path / "a.jsonl"), **kw,
                        text_search=f"retriever:{srv.url}")
        stats = run_rollout(str(prompts), str(tmp_path / "b.jsonl"), **kw,
                            text_search=f"retriever:{srv.url}", max_tool_failure_rate=0.3)
    assert stats["tool_failures"] == {"text_search_tool": 1}
    assert stats["tool_failure_rates"] == {"text_search_tool": 0.25}
    assert Path(tmp_path / "b.jsonl.meta.json").is_file()


def test_the_threshold_is_declared_once():
    from marscli.agent.generation import MAX_TOOL_FAILURE_RATE, JobOptions

    assert JobOptions().max_tool_failure_rate == MAX_TOOL_FAILURE_RATE
