"""Outputs on disk under pressure (issue 22.2-22.5, 22.10; issue 20.1, 20.6): an output that is an
input is refused before anything is written, one writer per output (a lock naming the holder),
a replace killed half-way is finished by the next run, rows over the size limit are refused
without being read whole, a full disk or a read-only folder gives one line and leaves nothing
half-written, stdin's hash reaches the sidecar, checkpoints get the usual file modes.

A full disk is a file-size limit (RLIMIT_FSIZE, set in this process around one command, with
SIGXFSZ ignored so that writes fail with EFBIG). A read-only folder is a folder of mode 0555;
as root, the test drops CAP_DAC_OVERRIDE from this thread around the command (root owns the
folder, so its mode then holds)."""

from __future__ import annotations

import hashlib
import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from marscli.errors import BadInput, RuntimeFailure, save_error
from marscli.records import jsonl
from marscli.records.jsonl import iter_rows, read_rows
from marscli.records.locks import OutputLock
from marscli.records.outputs import AppendJsonl, AtomicDir, AtomicJsonl
from marscli.records.provenance import stage_inputs
from marscli.records.sidecar import write_sidecar
from marscli.train.checkpoint import check_out

from helpers import (
    ENV,
    MARSCLI,
    file_size_limit,
    held,
    invoke,
    invoke_read_only,
    prompt,
    scene,
    trajectory,
    write_jsonl,
    write_prompts,
)


def files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def one_line(err: str) -> str:
    """The one error line of a stage's stderr (log lines before it are fine), no traceback."""
    lines = [x for x in err.strip().splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err and err.rstrip().endswith(lines[0]), err
    return lines[0]


def scored(i: int) -> dict:
    return {"v": 1, "id": f"p{i // 2}#{i % 2}", "prompt_id": f"p{i // 2}", "sample": i % 2,
            "reward": {"total": float(i % 2)}, "pad": "x" * 2000}


# ----------------------------------------------------------------------------- 20.6: modes


def test_atomic_dir_gives_files_and_folders_the_umask_modes(tmp_path):
    import tempfile

    out = tmp_path / "ckpt"
    with AtomicDir(out) as ad:
        fd, name = tempfile.mkstemp(dir=ad.tmp)  # 0600, as safetensors' writer leaves its file
        os.close(fd)
        (ad.tmp / "sub").mkdir(mode=0o700)
        (ad.tmp / "sub" / "x.json").write_text("{}")
        os.chmod(ad.tmp / "sub" / "x.json", 0o600)
    umask = os.umask(0)
    os.umask(umask)
    modes = {p.relative_to(out).as_posix(): p.stat().st_mode & 0o777 for p in out.rglob("*")}
    assert modes == {Path(name).name: 0o666 & ~umask, "sub": 0o777 & ~umask,
                     "sub/x.json": 0o666 & ~umask}
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask


def test_tiny_model_weights_are_readable_by_others(tiny_model):
    if os.environ.get("MARSCLI_TINY"):
        pytest.skip("MARSCLI_TINY: a folder built elsewhere")
    umask = os.umask(0)
    os.umask(umask)
    for f in tiny_model.iterdir():
        assert f.stat().st_mode & 0o777 == 0o666 & ~umask, f


# ----------------------------------------------------------------------------- 20.1: stdin


def _stdin(monkeypatch, data: bytes) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))


def test_sidecar_records_stdin_as_dash_with_the_hash_of_what_was_read(tmp_path, monkeypatch):
    data = b'{"v": 1, "id": "a"}\n\n{"v": 1, "id": "b"}\n'
    _stdin(monkeypatch, data)
    out = tmp_path / "o.jsonl"
    with stage_inputs():  # what a stage's run function opens
        assert [r["id"] for _, r in iter_rows("-")] == ["a", "b"]
        write_sidecar(str(out), stage="t", inputs=["-"])
    assert orjson.loads(Path(f"{out}.meta.json").read_bytes())["inputs"] == {"-": sha(data)}


def test_advantages_from_a_pipe_records_the_pipe(tmp_path):
    data = b"".join(orjson.dumps(scored(i)) + b"\n" for i in range(4))
    out = tmp_path / "adv.jsonl"
    res = subprocess.run([*MARSCLI, "advantages", "-", "-o", str(out)], input=data,
                         capture_output=True, env=ENV, timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    meta = orjson.loads(Path(f"{out}.meta.json").read_bytes())
    assert meta["inputs"] == {"-": sha(data)}


def test_sidecar_hash_is_of_the_bytes_read_not_of_the_file_at_the_end(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"v": 1, "id": "a"}])
    before = src.read_bytes()
    with stage_inputs():
        read_rows(str(src))
        with src.open("ab") as fh:  # changed while the stage ran
            fh.write(b'{"v": 1, "id": "late"}\n')
        write_sidecar(str(tmp_path / "o.jsonl"), stage="t", inputs=[str(src)])
    meta = orjson.loads((tmp_path / "o.jsonl.meta.json").read_bytes())
    assert meta["inputs"] == {str(src): sha(before)}


# ----------------------------------------------------------------------------- 22.5: row size


class _Endless(io.RawIOBase):
    """A stream of one line that never ends, counting what was read from it."""

    def __init__(self) -> None:
        self.read_bytes = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        b[:] = b"x" * len(b)
        self.read_bytes += len(b)
        return len(b)


def test_a_row_over_the_limit_is_refused_without_reading_it_whole(monkeypatch):
    raw = _Endless()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BufferedReader(raw)))
    monkeypatch.setenv("MARSCLI_MAX_ROW_BYTES", "1000")
    with pytest.raises(BadInput, match=r"^-:1: row is over 1000 bytes — .*MARSCLI_MAX_ROW_BYTES"):
        list(iter_rows("-"))
    assert raw.read_bytes < 100_000  # a few buffers, not the endless line


def test_row_limit_counts_the_row_without_its_newline(tmp_path, monkeypatch):
    monkeypatch.setenv("MARSCLI_MAX_ROW_BYTES", "30")
    ok = b'{"v": 1, "id": "' + b"a" * 12 + b'"}'  # 30 bytes
    src = tmp_path / "r.jsonl"
    src.write_bytes(ok + b"\n" + ok)
    assert len(read_rows(str(src))) == 2
    src.write_bytes(ok + b"\n" + ok[:-2] + b'b"}\n')
    with pytest.raises(BadInput, match=r"r\.jsonl:2: row is over 30 bytes"):
        read_rows(str(src))
    monkeypatch.setenv("MARSCLI_MAX_ROW_BYTES", "lots")
    with pytest.raises(BadInput, match="MARSCLI_MAX_ROW_BYTES='lots': not a positive number"):
        read_rows(str(src))
    assert jsonl.MAX_ROW_BYTES == 16 << 20


def test_rollout_refuses_a_huge_prompt_row_with_file_and_line(tmp_path, tiny_model, monkeypatch):
    p = write_prompts(tmp_path / "p.jsonl", ["a"])
    with p.open("ab") as fh:
        fh.write(orjson.dumps(prompt("b", question="?" * 5000)) + b"\n")
    monkeypatch.setenv("MARSCLI_MAX_ROW_BYTES", "4000")
    code, _, err = invoke(["rollout", str(p), "-o", str(tmp_path / "t.jsonl"), "--policy",
                           str(tiny_model), "--engine", "replay", "-n", "1"])
    assert code == 2 and f"{p}:2: row is over 4000 bytes" in one_line(err)
    assert not (tmp_path / "t.jsonl").exists()


# ----------------------------------------------------------------------------- 22.2: clobber


def test_rollout_onto_its_prompt_file_is_refused_before_writing(tmp_path, tiny_model):
    p = write_prompts(tmp_path / "p.jsonl", ["a", "b"])
    before, listing = p.read_bytes(), files(tmp_path)
    for out in (p, tmp_path / "hard.jsonl", tmp_path / "sym.jsonl"):
        if out.name == "hard.jsonl":
            os.link(p, out)
        elif out.name == "sym.jsonl":
            out.symlink_to(p)
        code, _, err = invoke(["rollout", str(p), "-o", str(out), "--policy", str(tiny_model),
                               "--engine", "replay", "-n", "1"])
        assert code == 2 and "is an input of this stage" in one_line(err), err
        assert p.read_bytes() == before
    assert files(tmp_path) == sorted(listing + ["hard.jsonl", "sym.jsonl"])


def test_eval_onto_its_benchmark_is_refused_before_writing(tmp_path, tiny_model):
    from helpers import MIXED, write_bench

    b = write_bench(tmp_path / "b.jsonl", MIXED[:2])
    before, listing = b.read_bytes(), files(tmp_path)
    code, _, err = invoke(["eval", str(b), "-o", str(b), "--policy", str(tiny_model),
                           "--engine", "replay"])
    assert code == 2 and "is an input of this stage" in one_line(err), err
    assert b.read_bytes() == before and files(tmp_path) == listing


def test_atomic_outputs_refuse_an_input_and_merge_refuses_its_output_as_a_shard(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [scored(0), scored(1)])
    before = a.read_bytes()
    (tmp_path / "link.jsonl").symlink_to(a)
    code, _, err = invoke(["advantages", str(a), "-o", str(tmp_path / "link.jsonl")])
    assert code == 2 and "(as " in one_line(err) and "is an input" in err
    code, _, err = invoke(["merge", str(a), str(a)])  # the output is opened first here
    assert code == 2 and "is the output being written" in one_line(err)
    assert a.read_bytes() == before and files(tmp_path) == ["a.jsonl", "link.jsonl"]


def test_a_checkpoint_folder_holding_an_input_is_not_replaced(tmp_path, tiny_model):
    from marscli.qwen.policy import load_processor
    from marscli.stages.update import run_update

    out = tmp_path / "ckpt"
    out.mkdir()
    adv = write_jsonl(out / "adv.jsonl", [trajectory(out, load_processor(str(tiny_model)), 0)])
    before = sorted(p.name for p in out.rglob("*"))
    with pytest.raises(BadInput, match=r"holds .*adv\.jsonl, an input of this stage"):
        run_update(str(adv), str(tiny_model), str(out), force=True, lr=1e-3)
    assert sorted(p.name for p in out.rglob("*")) == before and files(tmp_path) == ["ckpt"]


def test_update_metrics_file_may_not_be_its_input(tmp_path, tiny_model):
    from marscli.qwen.policy import load_processor
    from marscli.stages.update import run_update

    adv = write_jsonl(tmp_path / "adv.jsonl",
                      [trajectory(tmp_path, load_processor(str(tiny_model)), 0)])
    before, listing = adv.read_bytes(), files(tmp_path)
    with pytest.raises(BadInput, match=r"adv\.jsonl: is an input of this stage"):
        run_update(str(adv), str(tiny_model), str(tmp_path / "ckpt"), metrics=str(adv))
    assert adv.read_bytes() == before and files(tmp_path) == listing


def test_stages_called_one_after_another_do_not_share_inputs(tmp_path):
    """A Python caller runs two stages in a row with nothing to reset: each stage's run
    function remembers what it read for itself only (provenance.stage_inputs), so what the
    first read is no input of the second, and the second still refuses its own."""
    from marscli.stages.advantages import main as advantages
    from marscli.stages.inspect import main as inspect

    a = write_jsonl(tmp_path / "a.jsonl", [scored(0), scored(1)])
    b = write_jsonl(tmp_path / "b.jsonl", [scored(2), scored(3)])
    assert inspect(str(a), as_ids=True) == 2  # reads a.jsonl and ends without a sidecar
    advantages(str(b), str(a))
    assert [r["id"] for _, r in read_rows(str(a))] == ["p1#0", "p1#1"]
    before = b.read_bytes()
    with pytest.raises(BadInput, match=r"b\.jsonl: is an input of this stage"):
        advantages(str(b), str(b))
    assert b.read_bytes() == before


def test_rescore_may_replace_its_own_input_in_place(tmp_path):
    res = write_jsonl(tmp_path / "r.jsonl", [{"v": 1, "id": "x"}])
    with stage_inputs():
        rows = read_rows(str(res))
        with pytest.raises(BadInput):
            AtomicJsonl(str(res)).__enter__()
    with stage_inputs():
        rows = read_rows(str(res))
        with AtomicJsonl(str(res), replaces_input=True) as w:
            w.write({**rows[0][1], "score": 1})
    assert read_rows(str(res))[0][1]["score"] == 1 and files(tmp_path) == ["r.jsonl"]


# ----------------------------------------------------------------------------- 22.3: one writer




def test_a_second_writer_fails_at_once_naming_the_holder(tmp_path):
    out = tmp_path / "o.jsonl"
    with held(out) as holder:
        assert (tmp_path / "o.jsonl.lock").read_text().strip() == str(holder.pid)
        for writer in (lambda: AppendJsonl(str(out)), lambda: AtomicJsonl(str(out)),
                       lambda: AtomicDir(out)):
            with pytest.raises(RuntimeFailure, match=rf"another marscli is writing it \(pid "
                                                     rf"{holder.pid}, lock .*o\.jsonl\.lock\)"):
                writer().__enter__()
        with pytest.raises(RuntimeFailure, match=str(holder.pid)):  # the sidecar shares it
            write_sidecar(str(out), stage="t")
    assert files(tmp_path) == []  # the holder removed its lock file on a clean exit
    with AppendJsonl(str(out)) as w, OutputLock(out):  # re-entrant in one process
        w.write({"id": "a"})
    assert files(tmp_path) == ["o.jsonl"]


def test_a_killed_holder_leaves_a_lock_file_that_does_not_block(tmp_path):
    out = tmp_path / "o.jsonl"
    with held(out) as holder:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (tmp_path / "o.jsonl.lock").exists()
    with AppendJsonl(str(out)) as w:
        w.write({"id": "a"})
    assert files(tmp_path) == ["o.jsonl"]


def test_two_rollouts_on_one_output_the_second_exits_1(tmp_path, tiny_model):
    p = write_prompts(tmp_path / "p.jsonl", ["a"])
    out = tmp_path / "t.jsonl"
    with held(out) as holder:
        code, _, err = invoke(["rollout", str(p), "-o", str(out), "--policy", str(tiny_model),
                               "--engine", "replay", "-n", "1"])
    assert code == 1 and f"pid {holder.pid}" in one_line(err)
    assert not out.exists()


def test_sft_refuses_an_existing_out_without_force(tmp_path, tiny_model):
    from marscli.stages.sft import run_sft

    (tmp_path / "out").mkdir()
    with pytest.raises(BadInput, match="already exists — pick a new folder or pass --force"):
        run_sft(str(tmp_path / "nope.jsonl"), str(tiny_model), str(tmp_path / "out"))


# ----------------------------------------------------------------------------- 22.4: OUT.old-PID


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_a_replace_killed_between_its_renames_is_finished_by_the_next_run(tmp_path, capsys):
    out = tmp_path / "ckpt"
    old = tmp_path / f"ckpt.old-{_dead_pid()}"
    old.mkdir()
    (old / "w").write_text("previous")
    with pytest.raises(BadInput, match="already exists"):  # no OUT: the old one is put back
        check_out(str(out), False)
    assert files(tmp_path) == ["ckpt"] and (out / "w").read_text() == "previous"
    assert "put back" in capsys.readouterr().err
    old.mkdir()
    (old / "w").write_text("garbage")
    with AtomicDir(out) as ad:  # OUT there: the leftover goes
        (ad.tmp / "w").write_text("new")
    assert files(tmp_path) == ["ckpt"] and (out / "w").read_text() == "new"
    live = tmp_path / f"ckpt.old-{os.getppid()}"  # a running pid's is left alone
    live.mkdir()
    check_out(str(out), True)
    assert live.exists()


def test_a_reader_finds_the_checkpoint_a_killed_replace_moved_aside(tmp_path, capsys):
    """`--policy OUT` with only `OUT.old-PID` left: put back when PID is gone, otherwise a
    one-line error naming where the checkpoint is (not "no such checkpoint folder")."""
    from marscli.qwen.policy import check_checkpoint

    out = tmp_path / "ckpt"
    old = tmp_path / f"ckpt.old-{_dead_pid()}"
    old.mkdir()
    (old / "config.json").write_text("{}")
    assert check_checkpoint(str(out)) == str(out)
    assert files(tmp_path) == ["ckpt"] and "put back" in capsys.readouterr().err
    live = tmp_path / f"ckpt.old-{os.getppid()}"
    out.rename(live)
    with pytest.raises(BadInput, match=f"the checkpoint is in {live} .*mv {live} {out}"):
        check_checkpoint(str(out))


def test_a_replace_whose_new_folder_fails_keeps_the_old(tmp_path, monkeypatch):
    import marscli.records.outputs as outputs

    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "w").write_text("previous")
    real = os.replace

    def refuse_the_new(src, dst):
        if ".tmp-" in str(src):
            raise OSError(5, "Input/output error")
        real(src, dst)

    monkeypatch.setattr(outputs.os, "replace", refuse_the_new)
    with pytest.raises(OSError), AtomicDir(out) as ad:
        (ad.tmp / "w").write_text("new")
    assert files(tmp_path) == ["ckpt"] and (out / "w").read_text() == "previous"


# ----------------------------------------------------------------------------- 22.10: disk, ro


def test_save_errors_of_torch_and_safetensors_become_one_line(tmp_path, monkeypatch):
    import shutil

    torch_err = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704")
    st_err = Exception("Error while serializing: I/O error: No space left on device (os error 28)")
    e = save_error(st_err, tmp_path / "m.safetensors")
    assert isinstance(e, RuntimeFailure) and str(e).startswith(f"{tmp_path}/m.safetensors: no "
                                                               "space left on the device")
    assert save_error(torch_err, tmp_path) is None  # plenty of room, no size limit: not ours
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=1000))
    assert "no space left" in str(save_error(torch_err, tmp_path / "x" / "optimizer.pt"))
    assert save_error(RuntimeError("shape mismatch"), tmp_path) is None


def _full(args: list[str], limit: int) -> tuple[int, str]:
    with file_size_limit(limit):
        code, _, err = invoke(args)
    return code, err


def test_full_disk_advantages_one_line_no_temporary(tmp_path):
    s = write_jsonl(tmp_path / "s.jsonl", [scored(i) for i in range(8)])
    code, err = _full(["advantages", str(s), "-o", str(tmp_path / "adv.jsonl")], 4000)
    assert code == 1 and "adv.jsonl: file too large" in one_line(err)
    assert files(tmp_path) == ["s.jsonl"]


def test_full_disk_index_one_line_no_temporary(tmp_path):
    """SQLite reports a full disk as `database or disk is full`, not an OSError."""
    rows = [{"id": str(i), "title": f"t{i}", "text": f"word{i} " * 200} for i in range(200)]
    c = write_jsonl(tmp_path / "c.jsonl", rows)
    code, err = _full(["index", "text", str(c), "-o", str(tmp_path / "idx.sqlite")], 64_000)
    assert code == 1 and "idx.sqlite: no space left on the device" in one_line(err), err
    assert files(tmp_path) == ["c.jsonl"]


def test_full_disk_rollout_keeps_complete_records_only(tmp_path, tiny_model):
    p = write_prompts(tmp_path / "p.jsonl", [f"q{i}" for i in range(6)])
    out = tmp_path / "t.jsonl"
    code, err = _full(["rollout", str(p), "-o", str(out), "--policy", str(tiny_model),
                       "--engine", "replay", "-n", "1"], 6000)
    assert code == 1 and "t.jsonl: file too large" in one_line(err)
    data = out.read_bytes()
    assert data.endswith(b"\n") and all(orjson.loads(x) for x in data.splitlines())
    assert [f for f in files(tmp_path) if ".tmp" in f or ".lock" in f] == []


@pytest.mark.parametrize("stage", ["update", "update-keep-optimizer", "sft-partial"])
def test_full_disk_checkpoint_stages_one_line_no_leftovers(stage, tmp_path, tiny_model):
    from marscli.qwen.policy import load_processor

    rows = [trajectory(tmp_path, load_processor(str(tiny_model)), i) for i in range(2)]
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    listing = files(tmp_path)
    out = tmp_path / "ckpt"
    if stage.startswith("update"):
        args = ["update", str(data), "--policy", str(tiny_model), "--out", str(out)]
        args += ["--keep-optimizer"] if stage.endswith("optimizer") else []
    else:
        args = ["sft", str(data), "--policy", str(tiny_model), "--out", str(out), "--epochs",
                "2", "--save-every-epoch"]
    weights = (tiny_model / "model.safetensors").stat().st_size
    # update-keep-optimizer: the weights fit, AdamW's state (twice their size) does not
    limit = weights + 4096 if stage == "update-keep-optimizer" else weights // 2
    code, err = _full(args, limit)
    assert code == 1 and "file too large" in one_line(err), err
    assert files(tmp_path) == listing


@pytest.mark.parametrize("stage", [
    "rollout", "update", "sft", "tiny-model", "index"])
def test_read_only_output_folder_one_line_exit_2(stage, tmp_path, tiny_model):
    from marscli.qwen.policy import load_processor

    ro = tmp_path / "ro"
    ro.mkdir()
    scene(tmp_path / "scene.png")
    if stage == "rollout":
        p = write_prompts(tmp_path / "p.jsonl", ["a"])
        args = ["rollout", str(p), "-o", str(ro / "t.jsonl"), "--policy", str(tiny_model),
                "--engine", "replay", "-n", "1"]
    elif stage in ("update", "sft"):
        d = write_jsonl(tmp_path / "d.jsonl",
                        [trajectory(tmp_path, load_processor(str(tiny_model)), 0)])
        args = [stage, str(d), "--policy", str(tiny_model), "--out", str(ro / "ckpt")]
    elif stage == "index":
        c = write_jsonl(tmp_path / "c.jsonl", [{"id": "1", "title": "t", "text": "red square"}])
        args = ["index", "text", str(c), "-o", str(ro / "idx.sqlite")]
    else:
        args = ["tiny-model", str(ro / "m")]
    code, _, err = invoke_read_only(ro, args)
    assert code == 2 and "ro" in one_line(err) and ("permission denied" in err
                                                    or "cannot write here" in err), err
    assert files(ro) == []
