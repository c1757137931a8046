"""Nothing silently wrong, round two (issue 33): a follower that notices a file replaced or
truncated under it, readers that refuse a file still being written, one follower per output,
settings files that are not settings, merge that refuses unfinished shards, trackers that are
outputs checked before any work, a fingerprint that covers the processor, and prompts past the
context refused per row.

Another process "writing" a file is a process holding its lock (`OutputLock`), as rollout does;
a follower is seen to have the file open through /proc/PID/fd before the file is replaced, so
that the test replaces the file it is reading, not one it has yet to open."""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from marscli.errors import BadInput, RuntimeFailure
from marscli.records.jsonl import follow_rows, read_rows
from marscli.records.provenance import stage_inputs
from marscli.records.sidecar import write_sidecar

from helpers import ENV, held, invoke, read_jsonl, write_jsonl

PY = sys.executable


def one_line(err: str) -> str:
    """The one error line of a stage's stderr, no traceback."""
    lines = [x for x in err.strip().splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err and err.rstrip().endswith(lines[0]), err
    return lines[0]


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def traj(i: int, answer: str = "Paris") -> dict:
    return {"v": 1, "id": f"q#{i}", "prompt_id": "q", "question": "Capital of France?",
            "answer_gt": ["Paris"], "final_answer": answer, "stop": "answer",
            "segments": [{"role": "prompt"}, {"role": "model",
                                                 "text": f"<answer>{answer}</answer>"}]}


def lines(rows: list[dict]) -> bytes:
    return b"".join(orjson.dumps(r) + b"\n" for r in rows)




def follower(tmp_path: Path, src: str, out: str) -> subprocess.Popen:
    return subprocess.Popen([PY, "-m", "marscli", "reward", src, "-o", out, "--follow"],
                            cwd=tmp_path, stderr=subprocess.PIPE, text=True, env=ENV)


def wait_open(proc: subprocess.Popen, path: Path, timeout: float = 60) -> None:
    """Until `proc` has `path` open (its follower read it)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert proc.poll() is None, proc.communicate()[1]
        with contextlib.suppress(OSError):
            fds = Path(f"/proc/{proc.pid}/fd")
            if any(os.readlink(fd) == str(path.resolve()) for fd in fds.iterdir()):
                time.sleep(0.3)  # and read what is there
                return
        time.sleep(0.05)
    raise AssertionError(f"{path} never opened by pid {proc.pid}")


# ----------------------------------------------------------------------------- 1: follow


def test_follow_a_file_replaced_under_it_exits_1_and_writes_nothing(tmp_path):
    """rollout --force restarted at the same path: the follower had the killed attempt's
    rows; it used to exit 0 with them (and hash the new file in its sidecar)."""
    src = tmp_path / "t.jsonl"
    with held(src):
        src.write_bytes(lines([traj(0), traj(1, "Lyon")]))
        p = follower(tmp_path, "t.jsonl", "s.jsonl")
        wait_open(p, src)
        src.unlink()  # the new run starts over: a new file, its rows, its sidecar
        src.write_bytes(lines([traj(0, "Nice"), traj(1), traj(2)]))
        (tmp_path / "t.jsonl.meta.json").write_text("{}")
        _, err = p.communicate(timeout=60)
    assert p.returncode == 1 and "was replaced or removed while being followed" in one_line(err)
    assert not (tmp_path / "s.jsonl").exists() and not (tmp_path / "s.jsonl.meta.json").exists()


def test_follow_a_file_truncated_in_place_exits_1(tmp_path):
    src = tmp_path / "t.jsonl"
    with held(src):
        src.write_bytes(lines([traj(0), traj(1), traj(2)]))
        p = follower(tmp_path, "t.jsonl", "s.jsonl")
        wait_open(p, src)
        with src.open("r+b") as fh:  # rows already scored are gone from the file
            fh.truncate(len(lines([traj(0)])))
        (tmp_path / "t.jsonl.meta.json").write_text("{}")
        _, err = p.communicate(timeout=60)
    assert p.returncode == 1 and "shrank from" in one_line(err)
    assert not (tmp_path / "s.jsonl").exists()


def test_follow_a_file_rewritten_in_place_and_grown_exits_1(tmp_path):
    """Truncated and written again, as long or longer: the same inode and no shrink seen, so
    the follower used to read on from its offset, scoring the end of another file after the
    start of this one (exit 0)."""
    src = tmp_path / "t.jsonl"
    with held(src):
        src.write_bytes(lines([traj(0), traj(1)]))
        p = follower(tmp_path, "t.jsonl", "s.jsonl")
        wait_open(p, src)
        with src.open("r+b") as fh:  # the same lengths: the old offset is a line boundary
            fh.write(lines([traj(0, "Lyons"), traj(1, "Lyons"), traj(2)]))
        (tmp_path / "t.jsonl.meta.json").write_text("{}")
        _, err = p.communicate(timeout=60)
    assert p.returncode == 1 and "was rewritten in place while being followed" in one_line(err)
    assert not (tmp_path / "s.jsonl").exists() and not (tmp_path / "s.jsonl.meta.json").exists()


def test_follow_rows_generator_stops_on_truncate_then_regrow(tmp_path):
    """The library's check: rows already yielded, then the file truncated to nothing and
    written again, longer, between two polls."""
    src = tmp_path / "t.jsonl"
    src.write_bytes(lines([traj(0)]))
    with held(src), stage_inputs():
        rows = follow_rows(str(src), poll_s=0.01)
        assert next(rows)[1]["id"] == "q#0"
        with src.open("r+b") as fh:
            fh.truncate(0)
            fh.write(lines([traj(0, "Lyons"), traj(1)]))
        assert src.stat().st_size > len(lines([traj(0)]))
        with pytest.raises(RuntimeFailure, match="was rewritten in place"):
            next(rows)


def test_follow_stopped_by_sigterm_ends_at_once_and_leaves_nothing_final(tmp_path):
    """`kill PID` to a follower waiting for its writer: it ends within seconds with neither
    output nor sidecar (make redoes `scored`), and nothing it left blocks the rerun."""
    import signal

    src = tmp_path / "t.jsonl"
    with held(src):
        src.write_bytes(lines([traj(0), traj(1, "Lyon")]))
        p = follower(tmp_path, "t.jsonl", "s.jsonl")
        wait_open(p, src)
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=60)
        assert p.returncode == -signal.SIGTERM and time.monotonic() - t0 < 20
        assert sorted(x.name for x in tmp_path.iterdir() if x.name.startswith("s.")) in (
            [], ["s.jsonl.lock"])  # a lock no process holds: it blocks nobody
        with src.open("ab") as fh:
            fh.write(lines([traj(2)]))
        (tmp_path / "t.jsonl.meta.json").write_text("{}")
    rerun = follower(tmp_path, "t.jsonl", "s.jsonl")
    _, err = rerun.communicate(timeout=60)
    assert rerun.returncode == 0, err
    assert [r["reward"]["accuracy"] for r in read_jsonl(tmp_path / "s.jsonl")] == [1.0, 0.0, 1.0]


def test_follow_sidecar_hashes_the_bytes_it_scored(tmp_path):
    """A finished follow records the hash of exactly what it read, even when the file at the
    name is another one by the time the sidecar is written."""
    src = tmp_path / "t.jsonl"
    data = lines([traj(0), traj(1)]) + b"  "  # a blank tail without its newline is read too
    src.write_bytes(data)
    (tmp_path / "t.jsonl.meta.json").write_text("{}")
    with stage_inputs():
        assert [r["id"] for _, r in follow_rows(str(src))] == ["q#0", "q#1"]
        src.unlink()
        src.write_bytes(lines([traj(5)]))  # replaced after the follow ended
        write_sidecar(str(tmp_path / "s.jsonl"), stage="t", inputs=[str(src)])
    meta = orjson.loads((tmp_path / "s.jsonl.meta.json").read_bytes())
    assert meta["inputs"] == {str(src): sha(data)}


def test_a_file_replaced_after_it_was_read_keeps_the_hash_of_what_was_read(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"v": 1, "id": "a"}])
    before = src.read_bytes()
    with stage_inputs():
        read_rows(str(src))
        (tmp_path / "new.jsonl").write_bytes(b'{"v": 1, "id": "b"}\n')
        os.replace(tmp_path / "new.jsonl", src)
        write_sidecar(str(tmp_path / "o.jsonl"), stage="t", inputs=[str(src)])
    meta = orjson.loads((tmp_path / "o.jsonl.meta.json").read_bytes())
    assert meta["inputs"] == {str(src): sha(before)}


# ----------------------------------------------------------------------------- 9: readers


def test_a_reader_without_follow_refuses_a_file_still_being_written(tmp_path):
    src = write_jsonl(tmp_path / "t.jsonl", [traj(0)])
    with held(src) as writer:
        code, _, err = invoke(["reward", str(src), "-o", str(tmp_path / "s.jsonl")])
        assert code == 1 and f"(pid {writer.pid}) is still writing it" in one_line(err)
        code, _, err = invoke(["advantages", str(src), "-o", str(tmp_path / "a.jsonl")])
        assert code == 1 and "still writing it" in one_line(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.jsonl"]
    code, _, err = invoke(["reward", str(src), "-o", str(tmp_path / "s.jsonl")])  # done now
    assert code == 0, err


def test_a_stale_lock_of_a_killed_writer_does_not_block_readers(tmp_path):
    src = write_jsonl(tmp_path / "t.jsonl", [traj(0)])
    (tmp_path / "t.jsonl.lock").write_text(f"{os.getpid()}\n")  # a live pid, but no lock held
    code, _, err = invoke(["reward", str(src), "-o", str(tmp_path / "s.jsonl")])
    assert code == 0, err
    dead = subprocess.run([PY, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    (tmp_path / "t.jsonl.lock").write_text(f"{dead}\n")
    code, _, err = invoke(["reward", str(src), "-o", str(tmp_path / "s2.jsonl")])
    assert code == 0, err


def test_a_second_follower_on_one_output_exits_1_at_once(tmp_path):
    src = tmp_path / "t.jsonl"
    with held(src):
        src.write_bytes(lines([traj(0)]))
        first = follower(tmp_path, "t.jsonl", "s.jsonl")
        wait_open(first, src)
        second = subprocess.run([PY, "-m", "marscli", "reward", "t.jsonl", "-o", "s.jsonl",
                                 "--follow"], cwd=tmp_path, capture_output=True, text=True,
                                env=ENV, timeout=60)
        assert second.returncode == 1
        assert f"another marscli is writing it (pid {first.pid}" in one_line(second.stderr)
        (tmp_path / "t.jsonl.meta.json").write_text("{}")
        _, err = first.communicate(timeout=60)
    assert first.returncode == 0, err
    assert [r["reward"]["accuracy"] for r in read_jsonl(tmp_path / "s.jsonl")] == [1.0]


def test_follow_onto_its_own_input_is_refused(tmp_path):
    code, _, err = invoke(["reward", str(tmp_path / "t.jsonl"), "-o", str(tmp_path / "t.jsonl"),
                           "--follow"])
    assert code == 2 and "is the file being followed" in one_line(err)


@pytest.mark.parametrize("content", [b"[1, 2]\n", b'{"v": 1, "settings": [1]}\n', b'"x"', None])
def test_a_settings_file_that_is_not_settings_is_one_line(tmp_path, content):
    from marscli.agent.runner import check_settings, start_over

    out = tmp_path / "t.jsonl"
    out.write_bytes(lines([traj(0)]))
    settings = tmp_path / "t.jsonl.settings.json"
    if content is None:
        settings.mkdir()
    else:
        settings.write_bytes(content)
    with pytest.raises(BadInput, match=r"t\.jsonl\.settings\.json: (not a settings file|is a "
                                       r"folder)"):
        check_settings(str(out), {"seed": 0}, {"q#0"})
    if content is None:  # --force removes nothing when it cannot remove everything
        with pytest.raises(BadInput, match="is a folder where --force removes a file"):
            start_over(str(out))
        assert out.exists()


@pytest.mark.parametrize("content", [b"[1, 2]\n", b'{"v": 1, "sett', None])
def test_rescore_with_a_bad_settings_file_is_one_line_before_any_rescoring(tmp_path, content):
    """`eval rescore` used to score every record (judge calls paid), rewrite RESULTS, and only
    then read the settings file: a traceback, RESULTS already rewritten."""
    results = tmp_path / "r.jsonl"
    results.write_bytes(lines([traj(0), traj(1, "Lyon")]))
    before = results.read_bytes()
    settings = tmp_path / "r.jsonl.settings.json"
    if content is None:
        settings.mkdir()
    else:
        settings.write_bytes(content)
    code, _, err = invoke(["eval", "rescore", str(results)])
    assert code == 2 and f"{settings}: " in one_line(err)
    assert results.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.jsonl", "r.jsonl.settings.json"]
    if content is not None:
        assert settings.read_bytes() == content


# ----------------------------------------------------------------------------- 4: merge


def shard(tmp_path: Path, i: int, ids: list[str], sidecar: bool = True, tail: bytes = b"") -> str:
    path = write_jsonl(tmp_path / f"o.jsonl.shard-{i}", [{"v": 1, "id": x} for x in ids], tail)
    if sidecar:
        Path(f"{path}.meta.json").write_text("{}")
    return str(path)


def test_merge_refuses_a_shard_without_its_sidecar_and_allow_partial_merges_it(tmp_path):
    out = tmp_path / "o.jsonl"
    a = shard(tmp_path, 0, ["a#0", "a#1"])
    b = shard(tmp_path, 1, ["b#0"], sidecar=False, tail=b'{"v": 1, "id": "b#1", "se')  # killed
    code, _, err = invoke(["merge", str(out), a, b])
    assert code == 1 and f"{b}: no sidecar o.jsonl.shard-1.meta.json" in one_line(err)
    assert "--allow-partial" in err and not out.exists()
    code, _, err = invoke(["merge", str(out), a, b, "--allow-partial"])
    assert code == 0, err
    assert "dropped a torn last record" in err and "1 of them unfinished" in err
    assert [r["id"] for r in read_jsonl(out)] == ["a#0", "a#1", "b#0"]
    meta = orjson.loads((tmp_path / "o.jsonl.meta.json").read_bytes())
    assert meta["stats"]["partial"] == [b] and meta["stats"]["torn_dropped"] == 1
    assert meta["stats"]["shards"] == {
        a: {"records": 2, "sha256": sha(Path(a).read_bytes()), "complete": True},
        b: {"records": 1, "sha256": sha(Path(b).read_bytes()), "complete": False}}


def test_merge_refuses_a_shard_still_being_written_even_with_allow_partial(tmp_path):
    out = tmp_path / "o.jsonl"
    a = shard(tmp_path, 0, ["a#0"])
    b = shard(tmp_path, 1, ["b#0"], sidecar=False)
    with held(Path(b)) as writer:
        for extra in ([], ["--allow-partial"]):
            code, _, err = invoke(["merge", str(out), a, b, *extra])
            assert code == 1 and f"{b}: still being written (pid {writer.pid}" in one_line(err)
    assert not out.exists()


def test_merge_of_finished_shards_with_a_torn_line_is_still_bad_input(tmp_path):
    a = shard(tmp_path, 0, ["a#0"], tail=b'{"v": 1, "id"')
    code, _, err = invoke(["merge", str(tmp_path / "o.jsonl"), a, "--allow-partial"])
    assert code == 2 and "not valid JSON (truncated last line?)" in one_line(err)


def test_merge_refuses_its_output_as_a_shard_before_the_shard_checks(tmp_path):
    a = shard(tmp_path, 0, ["a#0"], sidecar=False)
    code, _, err = invoke(["merge", a, a])
    assert code == 2 and "is the output being written" in one_line(err)


def test_follow_rows_generator_stops_on_replacement(tmp_path):
    """The check at the library's level: rows already yielded, then the file is another."""
    src = tmp_path / "t.jsonl"
    src.write_bytes(lines([traj(0)]))
    with held(src), stage_inputs():
        rows = follow_rows(str(src), poll_s=0.01)
        assert next(rows)[1]["id"] == "q#0"
        src.unlink()
        src.write_bytes(lines([traj(0), traj(1)]))
        with pytest.raises(RuntimeFailure, match="was replaced or removed"):
            next(rows)


# ----------------------------------------------------------------------------- 3, 8: trackers


def rollout_args(tmp_path: Path, tiny_model: Path, *extra: str) -> list[str]:
    from helpers import scene, write_prompts

    scene(tmp_path / "scene.png")
    p = write_prompts(tmp_path / "p.jsonl", ["a"])
    return ["rollout", str(p), "-o", str(tmp_path / "t.jsonl"), "--policy", str(tiny_model),
            "--engine", "replay", "-n", "1", *extra]


@pytest.mark.parametrize("target", ["p.jsonl", "t.jsonl", "t.jsonl.meta.json",
                                    "ckpt/config.json"])
def test_rollout_track_jsonl_onto_its_input_or_output_is_refused_before_work(
        tmp_path, tiny_model, target):
    import shutil

    ckpt = tmp_path / "ckpt"  # the policy, a copy: a tracker let in would write into it
    shutil.copytree(tiny_model, ckpt)
    args = rollout_args(tmp_path, ckpt, "--track", f"jsonl:{tmp_path / target}")
    before = {p: p.read_bytes() for p in (tmp_path / "p.jsonl", ckpt / "config.json")}
    code, _, err = invoke(args)
    assert code == 2 and "a tracker would write into the stage's data" in one_line(err)
    assert f"is an {'output' if target.startswith('t.') else 'input'} of this stage" in err
    assert {p: p.read_bytes() for p in before} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "p.jsonl", "scene.png"]


def test_rollout_track_jsonl_onto_its_search_index_is_refused_before_work(tmp_path, tiny_model):
    from marscli.search.text_index import build_text_index

    corpus = write_jsonl(tmp_path / "c.jsonl", [{"id": "1", "title": "t", "text": "a fact"}])
    index = tmp_path / "idx.sqlite"
    build_text_index(str(corpus), index, progress=False)
    before = index.read_bytes()
    code, _, err = invoke(rollout_args(tmp_path, tiny_model, "--text-search", f"local:{index}",
                                       "--track", f"jsonl:{index}"))
    assert code == 2 and "idx.sqlite is an input of this stage" in one_line(err)
    assert index.read_bytes() == before and not (tmp_path / "t.jsonl").exists()


def test_update_track_jsonl_onto_its_advantages_file_is_refused(tmp_path, tiny_model):
    from marscli.qwen.policy import load_processor
    from marscli.stages.update import run_update

    from helpers import trajectory

    adv = write_jsonl(tmp_path / "adv.jsonl",
                      [trajectory(tmp_path, load_processor(str(tiny_model)), 0)])
    before = adv.read_bytes()
    with pytest.raises(BadInput, match=r"--track: jsonl:.*adv\.jsonl is an input of this stage"):
        run_update(str(adv), str(tiny_model), str(tmp_path / "ckpt"), track=f"jsonl:{adv}")
    assert adv.read_bytes() == before and not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("spec", ["tensorboard:{tmp}/ckpt/tb", "jsonl:{policy}/track.jsonl"])
def test_sft_tracker_inside_its_output_or_its_policy_is_refused(tmp_path, tiny_model, spec,
                                                                 monkeypatch):
    from marscli.qwen.policy import load_processor
    from marscli.stages.sft import run_sft

    from helpers import trajectory

    data = write_jsonl(tmp_path / "d.jsonl",
                       [trajectory(tmp_path, load_processor(str(tiny_model)), 0)])
    monkeypatch.setenv("MARSCLI_TRACK", spec.format(tmp=tmp_path, policy=tiny_model))
    with pytest.raises(BadInput, match=r"MARSCLI_TRACK: .* of this stage"):
        run_sft(str(data), str(tiny_model), str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt").exists() and not (tiny_model / "track.jsonl").exists()


def test_tensorboard_under_a_regular_file_is_one_line_before_the_rollout(tmp_path, tiny_model):
    (tmp_path / "afile").write_text("x")
    code, _, err = invoke(rollout_args(tmp_path, tiny_model, "--track",
                                       f"tensorboard:{tmp_path / 'afile' / 'tb'}"))
    assert code == 2 and "cannot write" in one_line(err) and "afile" in err
    assert not (tmp_path / "t.jsonl").exists() and not (tmp_path / "t.jsonl.meta.json").exists()


def test_read_only_tensorboard_folder_is_one_line_before_the_rollout(tmp_path, tiny_model):
    from helpers import invoke_read_only

    ro = tmp_path / "tb"
    ro.mkdir()
    code, _, err = invoke_read_only(ro, rollout_args(tmp_path, tiny_model, "--track",
                                                     f"tensorboard:{ro}"))
    assert code == 2 and "cannot write" in one_line(err) and "Permission denied" in err
    assert not (tmp_path / "t.jsonl").exists() and not (tmp_path / "t.jsonl.meta.json").exists()


@pytest.mark.parametrize("spec", ["tensorboard:{tmp}/tb", "jsonl:{tmp}/ckpt/config.json"])
def test_eval_tracker_is_checked_before_the_benchmark_is_loaded(tmp_path, tiny_model, spec):
    """A TSV benchmark's images go to `eval-images/` as it loads; the tracker used to be opened
    after that (a read-only TensorBoard folder: exit 2 with the cache filled), and one into
    the policy's folder was let in."""
    import shutil

    from helpers import HR_HEADER, hr_rows, invoke_read_only, write_tsv

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_model, ckpt)
    config = (ckpt / "config.json").read_bytes()
    tsv = write_tsv(tmp_path / "bench" / "hr_bench_4k.tsv", HR_HEADER, hr_rows())
    (tmp_path / "runs").mkdir()
    (tmp_path / "tb").mkdir()
    args = ["eval", str(tsv), "-o", str(tmp_path / "runs" / "r.jsonl"), "--policy", str(ckpt),
            "--engine", "replay", "--mode", "direct", "--track", spec.format(tmp=tmp_path)]
    code, _, err = invoke_read_only(tmp_path / "tb", args)
    assert code == 2
    if spec.startswith("tensorboard"):
        assert "cannot write" in one_line(err) and "Permission denied" in err
    else:
        assert "is an input of this stage" in one_line(err)
    assert list((tmp_path / "runs").iterdir()) == [] and list((tmp_path / "tb").iterdir()) == []
    assert (ckpt / "config.json").read_bytes() == config


def test_missing_wandb_is_one_line_before_the_rollout(tmp_path, tiny_model, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb → ImportError
    code, _, err = invoke(rollout_args(tmp_path, tiny_model, "--track", "wandb:proj"))
    assert code == 2 and "wandb is not installed" in one_line(err)
    assert not (tmp_path / "t.jsonl").exists() and not (tmp_path / "t.jsonl.meta.json").exists()


def test_a_tracker_beside_the_data_still_works(tmp_path, tiny_model):
    """Kept: a jsonl tracker in the run folder, not onto any file of the stage."""
    code, _, err = invoke(rollout_args(tmp_path, tiny_model, "--track",
                                       f"jsonl:{tmp_path / 'track.jsonl'}"))
    assert code == 0, err
    (row,) = read_jsonl(tmp_path / "track.jsonl")
    assert row["metrics"]["trajectories"] == 1


# ----------------------------------------------------------------------------- 5: fingerprint


@pytest.mark.parametrize("name", ["processor_config.json", "preprocessor_config.json",
                                  "tokenizer.json", "tokenizer_config.json",
                                  "chat_template.jinja", "generation_config.json",
                                  "config.json", "model.safetensors"])
def test_fingerprint_covers_every_file_that_decides_the_tokens(tmp_path, tiny_model, name):
    import shutil

    from marscli.records.provenance import weights_fingerprint

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_model, ckpt)
    before = weights_fingerprint(str(ckpt))
    with (ckpt / name).open("ab") as fh:  # a new file where the checkpoint had none counts too
        fh.write(b" ")
    changed = weights_fingerprint(str(ckpt))
    assert changed != before
    (ckpt / "README.md").write_text("notes")  # a file that decides nothing does not count
    assert weights_fingerprint(str(ckpt)) == changed


def test_resume_after_the_processor_changed_is_refused(tmp_path, tiny_model):
    """Killed, processor_config.json edited (another image resolution), resumed: one file
    would mix two resolutions; the resume is refused naming the weights."""
    import json
    import shutil

    from helpers import scene, write_prompts

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_model, ckpt)
    scene(tmp_path / "scene.png")
    args = ["rollout", str(tmp_path / "p.jsonl"), "-o", str(tmp_path / "t.jsonl"), "--policy",
            str(ckpt), "--engine", "replay", "-n", "1"]
    write_prompts(tmp_path / "p.jsonl", ["a"])
    code, _, err = invoke(args)
    assert code == 0, err
    cfg = json.loads((ckpt / "processor_config.json").read_text())
    cfg["image_processor"]["size"]["longest_edge"] //= 2  # max pixels: fewer image tokens
    (ckpt / "processor_config.json").write_text(json.dumps(cfg))
    write_prompts(tmp_path / "p.jsonl", ["a", "b"])
    before = (tmp_path / "t.jsonl").read_bytes()
    code, _, err = invoke(args)
    assert code == 2 and "--policy (its weights) differs" in one_line(err)
    assert (tmp_path / "t.jsonl").read_bytes() == before


def test_sft_resume_fingerprint_covers_the_processor(tmp_path, tiny_model):
    import shutil

    from marscli.train.config import SftConfig
    from marscli.train.sft_resume import resume_fingerprint

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_model, ckpt)
    data = write_jsonl(tmp_path / "d.jsonl", [{"v": 1, "id": "a"}])
    fp = resume_fingerprint(str(data), str(ckpt), SftConfig(), None, None, [1])
    with (ckpt / "processor_config.json").open("ab") as fh:
        fh.write(b" ")
    assert resume_fingerprint(str(data), str(ckpt), SftConfig(), None, None, [1]) != fp


# ----------------------------------------------------------------------------- 6: prompt length


def long_and_short(tmp_path: Path) -> Path:
    """Two prompts: 621 and 1022 tokens on the tiny model (system prompt, image, question)."""
    from helpers import answer, scene

    scene(tmp_path / "scene.png")
    rows = [{"v": 1, "id": pid, "image": "scene.png", "question": q, "answer": ["red"],
             "replies": [answer("red")]}
            for pid, q in (("short", "What colour?"), ("long", "What colour? " + "red " * 400))]
    return write_jsonl(tmp_path / "p.jsonl", rows)


def test_hf_refuses_a_prompt_past_the_models_context_per_row(tmp_path, tiny_model):
    """The hf engine used to sample a prompt past `max_position_embeddings` silently."""
    import json
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_model, ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["text_config"]["max_position_embeddings"] = 800
    (ckpt / "config.json").write_text(json.dumps(cfg))
    p = long_and_short(tmp_path)
    out = tmp_path / "t.jsonl"
    code, _, err = invoke(["rollout", str(p), "-o", str(out), "--policy", str(ckpt), "--engine",
                           "hf", "-n", "2", "--max-turns", "1", "--max-turn-tokens", "4",
                           "--device", "cpu"])
    assert code == 0, err
    assert "2 trajectories refused" in err
    recs = {r["id"]: r for r in read_jsonl(out)}
    for k in (0, 1):
        long, short = recs[f"long#{k}"], recs[f"short#{k}"]
        assert long["stop"] == "prompt_too_long" and long["turns"] == 0
        assert long["error"] == "prompt of 1022 tokens, past the model's context of 800"
        assert [s["role"] for s in long["segments"]] == ["prompt"]
        assert long["generated_tokens"] == 0 and long["final_answer"] is None
        assert short["stop"] != "prompt_too_long" and short["turns"] == 1
        assert 1 <= short["generated_tokens"] <= 4
    meta = orjson.loads((tmp_path / "t.jsonl.meta.json").read_bytes())
    assert meta["stats"]["stop"]["prompt_too_long"] == 2


def test_max_prompt_tokens_refuses_per_row_and_is_a_setting(tmp_path, tiny_model):
    p = long_and_short(tmp_path)
    out = tmp_path / "t.jsonl"
    args = ["rollout", str(p), "-o", str(out), "--policy", str(tiny_model), "--engine",
            "replay", "-n", "2"]
    code, _, err = invoke([*args, "--max-prompt-tokens", "700"])
    assert code == 0, err
    stops = {r["id"]: (r["stop"], r.get("error")) for r in read_jsonl(out)}
    assert stops["long#0"] == ("prompt_too_long",
                               "prompt of 1022 tokens, over --max-prompt-tokens 700")
    assert stops["short#1"] == ("answer", None)
    settings = orjson.loads((tmp_path / "t.jsonl.settings.json").read_bytes())["settings"]
    assert settings["max_prompt_tokens"] == 700
    code, _, err = invoke([*args, "--max-prompt-tokens", "2000"])  # resuming with another
    assert code == 2 and "--max-prompt-tokens differs" in one_line(err)
    code, _, err = invoke([*args, "--max-prompt-tokens", "0"])
    assert code == 2 and "--max-prompt-tokens: 0 is out of range" in one_line(err)


def test_reward_scores_a_refused_row_0_and_advantages_leave_it_out(tmp_path, tiny_model):
    p = long_and_short(tmp_path)
    traj = tmp_path / "t.jsonl"
    code, _, err = invoke(["rollout", str(p), "-o", str(traj), "--policy", str(tiny_model),
                           "--engine", "replay", "-n", "2", "--max-prompt-tokens", "700"])
    assert code == 0, err
    scored, adv = tmp_path / "s.jsonl", tmp_path / "a.jsonl"
    code, _, err = invoke(["reward", str(traj), "-o", str(scored)])
    assert code == 0, err
    rewards = {r["id"]: r["reward"] for r in read_jsonl(scored)}
    assert rewards["long#0"] == {"total": 0.0, "accuracy": 0.0, "format": 0.0, "judge": "exact"}
    assert rewards["short#0"]["total"] == 1.5
    meta = orjson.loads((tmp_path / "s.jsonl.meta.json").read_bytes())
    assert meta["stats"]["prompt_too_long"] == 2 and "2 prompt_too_long rows scored 0" in err
    code, _, err = invoke(["advantages", str(scored), "-o", str(adv)])
    assert code == 0, err
    assert "skipped 2 prompt_too_long rows" in err
    assert sorted(r["id"] for r in read_jsonl(adv)) == ["short#0", "short#1"]
    meta = orjson.loads((tmp_path / "a.jsonl.meta.json").read_bytes())
    assert meta["stats"]["prompt_too_long_rows"] == 2 and meta["stats"]["groups"] == 1
    only_long = write_jsonl(tmp_path / "l.jsonl",
                            [r for r in read_jsonl(scored) if r["id"].startswith("long")])
    code, _, err = invoke(["advantages", str(only_long), "-o", str(tmp_path / "b.jsonl")])
    assert code == 2 and "stop prompt_too_long" in one_line(err)
