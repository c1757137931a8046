"""The training state on node-local storage (`make rl STATE_DIR=...`, train/persist.py).

`update --state-dir` writes the same bytes as without it, train_state/ a link to the node-local
copy; a copy into the run folder is whole or absent (killed half-way, a full disk); a lost
working copy is refused by `update` (one line, exit 2) and redone by make from the last durable
copy: on 1 rank and on 2 (DeepSpeed ZeRO-2, gloo) the resumed run's last checkpoint equals the
uninterrupted run's byte for byte, and a state written by 2 ranks and persisted loads on 1.
Faults of STATE_DIR itself (not writable, full, another run's) are one line, exit 2, before any
work; a full disk mid-save or mid-copy is exit 1 with the last durable copy intact.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from marscli.train import persist
from marscli.train.persist import DURABLE, LINK

from helpers import file_size_limit, invoke, trajectory, write_jsonl

ROOT = Path(__file__).resolve().parents[2]
# One intra-op thread: on 2 shared cores OpenMP's spinning threads slow a contended run, and
# runs compared bit for bit must use the same count.
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "NO_COLOR": "1",
       "OMP_NUM_THREADS": "1"}


def tree(folder: Path) -> dict[str, str]:
    """sha256 of every file below `folder` (a linked folder's not), by relative path."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def state_files(ckpt: Path) -> dict[str, str]:
    return tree(ckpt / LINK)


def one_line(err: str) -> str:
    """The one error line of a stage's stderr (log lines before it are fine), no traceback."""
    lines = [x for x in err.strip().splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err and err.rstrip().endswith(lines[0]), err
    return lines[0]


def wait_persists(state: Path) -> None:
    """Until no persist of the run holds a checkpoint's lock (a background copy ended)."""
    for lock in state.glob(f"*{persist.LOCK}"):
        os.close(persist._lock(Path(lock.name.removesuffix(persist.LOCK)), state))


def no_tmp(*roots: Path) -> None:
    left = [p for r in roots for p in r.rglob("*") if ".tmp-" in p.name]
    assert not left, left


# ----------------------------------------------------------------------------- one update


@pytest.fixture(scope="module")
def updated(tmp_path_factory, tiny_model, processor) -> tuple[Path, Path, Path]:
    """RUN/ckpt-1 from an update with --keep-optimizer and --state-dir STATE (RUN/ckpt-0 a
    link to the tiny model, iteration 0's advantage rows beside), and the same update without
    --state-dir."""
    from marscli.stages.update import run_update

    root = tmp_path_factory.mktemp("updated")
    run, state = root / "run", root / "local" / "run"
    (run / "iter-0").mkdir(parents=True)
    (run / "ckpt-0").symlink_to(tiny_model)
    adv = write_jsonl(run / "iter-0" / "advantages.jsonl",
                      [trajectory(run / "iter-0", processor, i) for i in range(2)])
    Path(f"{adv}.meta.json").write_text("{}")
    opts = {"lr": 1e-4, "keep_optimizer": True, "save_dtype": "bfloat16"}
    run_update(str(adv), str(run / "ckpt-0"), str(run / "ckpt-1"), state_dir=str(state), **opts)
    run_update(str(adv), str(run / "ckpt-0"), str(root / "plain"), **opts)
    return run, state, root / "plain"


@pytest.fixture
def fresh(tmp_path, updated) -> tuple[Path, Path]:
    """A copy of `updated`'s run and node-local folder for one test, the link re-pointed."""
    run0, state0, _ = updated
    run, state = tmp_path / "run", tmp_path / "local" / "run"
    shutil.copytree(run0, run, symlinks=True)
    shutil.copytree(state0, state)
    (run / "ckpt-1" / LINK).unlink()
    (run / "ckpt-1" / LINK).symlink_to(state / "ckpt-1")
    return run, state


def test_update_with_a_state_dir_writes_the_same_bytes_through_a_link(updated):
    """OUT/train_state is a link to STATE/<OUT's name>; every file of the export and of the
    state equals a plain update's, and the reading side (read_state, the masters, the
    moments' index) goes through the link unchanged."""
    from marscli.train.trainstate import check_state, master_source, read_state

    run, state, plain = updated
    ckpt = run / "ckpt-1"
    assert (ckpt / LINK).is_symlink() and (ckpt / LINK).resolve() == state / "ckpt-1"
    assert not any(p.name.startswith("ckpt-1.") for p in state.iterdir())  # no temporary
    assert state_files(ckpt) == state_files(plain)
    def export(c: Path) -> dict[str, str]:  # less wall times and the command line
        return {k: v for k, v in tree(c).items() if not k.startswith(f"{LINK}/")
                and k not in ("marscli.meta.json", "metrics.jsonl")}

    assert export(ckpt) == export(plain) and "model.safetensors" in export(ckpt)
    check_state(str(ckpt))
    assert read_state(ckpt) == read_state(plain)
    assert master_source(ckpt).separate  # bf16 export: the fp32 masters read from the link
    meta = json.loads((ckpt / "marscli.meta.json").read_text())
    assert meta["config"]["state_dir"] == str(state)


# ----------------------------------------------------------------------------- STATE_DIR faults


def test_a_state_dir_that_cannot_take_the_state_is_one_line_exit_2(fresh, tmp_path,
                                                                   monkeypatch):
    """Not writable (under a file: also as root), full, or another run's: one line, exit 2,
    before anything loads or is written."""
    run, state = fresh
    adv = run / "iter-0" / "advantages.jsonl"
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    update = ["update", str(adv), "--policy", str(run / "ckpt-1"), "--keep-optimizer"]
    code, _, err = invoke([*update, "--out", str(tmp_path / "o1"), "--state-dir",
                           str(blocker / "sub")])
    assert code == 2 and "--state-dir" in one_line(err) and "cannot write there" in err
    code, _, err = invoke(["state", "check", str(run), "1", "--state-dir", str(blocker / "x")])
    assert code == 2 and "STATE_DIR" in one_line(err)
    usage = shutil.disk_usage(state)
    monkeypatch.setattr(persist.shutil, "disk_usage", lambda p: usage._replace(free=1000))
    code, _, err = invoke([*update, "--out", str(tmp_path / "o2"), "--state-dir", str(state)])
    assert code == 2 and "GB free, a training state takes" in one_line(err)
    code, _, err = invoke(["state", "check", str(run), "1", "--state-dir", str(state)])
    assert code == 2 and "GB free" in one_line(err)
    monkeypatch.undo()
    code, _, err = invoke(["state", "check", str(tmp_path / "other"), "0", "--state-dir",
                           str(state)])
    assert code == 2 and f"holds the training state of {run}" in one_line(err)
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()
    assert sorted(p.name for p in state.iterdir()) == [persist.OWNER, "ckpt-1"]


def test_a_lost_working_copy_is_refused_then_linked_to_its_durable_copy(fresh, tmp_path):
    """The link dangles (another node's /dev/shm): `update` refuses it in one line, exit 2,
    before any work, where reading through it would silently start a fresh AdamW; with a
    durable copy `state check` points the link at it, and the state reads again."""
    from marscli.train.trainstate import read_state

    run, state = fresh
    ckpt = run / "ckpt-1"
    before = state_files(ckpt)
    adv = run / "iter-0" / "advantages.jsonl"
    code, _, err = invoke(["state", "persist", str(run), "1", "--state-dir", str(state)])
    assert code == 0 and tree(ckpt / DURABLE) == before
    shutil.rmtree(state)
    code, _, err = invoke(["update", str(adv), "--policy", str(ckpt), "--out",
                           str(tmp_path / "o"), "--keep-optimizer"])
    assert code == 2 and f"{ckpt / LINK}: links to {state / 'ckpt-1'}, which is not there" in (
        one_line(err)) and "durable copy" in err
    assert not (tmp_path / "o").exists()
    assert persist.redo_from(str(run), 1, str(state)) == 1  # no redo: the durable copy serves
    code, _, err = invoke(["state", "check", str(run), "1", "--state-dir", str(state)])
    assert code == 0 and os.readlink(ckpt / LINK) == DURABLE
    assert state_files(ckpt) == before and read_state(ckpt)["optimizer"]


def test_redo_from_goes_back_to_the_newest_state_and_needs_the_advantages(fresh):
    run, state = fresh
    shutil.rmtree(state / "ckpt-1")
    assert persist.redo_from(str(run), 1, str(state)) == 0  # ckpt-0: the base, no state
    (run / "iter-0" / "advantages.jsonl.meta.json").unlink()
    code, _, err = invoke(["state", "redo-from", str(run), "1", "--state-dir", str(state)])
    assert code == 2 and "advantages.jsonl is missing" in one_line(err)


# ----------------------------------------------------------------------------- full disks, kills


def test_a_full_disk_mid_save_is_exit_1_and_leaves_the_durable_copy(fresh, tmp_path):
    """The working copy of ckpt-2 does not fit (a file-size limit: AdamW's state is twice the
    export): exit 1, one line; no ckpt-2, no temporary in STATE; ckpt-1's durable and working
    copies as they were."""
    run, state = fresh
    ckpt = run / "ckpt-1"
    assert invoke(["state", "persist", str(run), "1", "--state-dir", str(state)])[0] == 0
    before = (tree(ckpt / DURABLE), state_files(ckpt))
    limit = (ckpt / "model.safetensors").stat().st_size + 4096
    with file_size_limit(limit):
        code, _, err = invoke(["update", str(run / "iter-0" / "advantages.jsonl"), "--policy",
                               str(ckpt), "--out", str(run / "ckpt-2"), "--keep-optimizer",
                               "--save-dtype", "bfloat16", "--state-dir", str(state)])
    assert code == 1 and "file too large" in one_line(err), err
    assert not (run / "ckpt-2").exists()
    assert sorted(p.name for p in state.iterdir() if not p.name.endswith(persist.LOCK)) == [
        "ckpt-1"]
    assert (tree(ckpt / DURABLE), state_files(ckpt)) == before
    no_tmp(run, state)


def test_a_full_disk_mid_persist_is_exit_1_and_leaves_no_copy(fresh):
    """The copy hits the limit: exit 1, one line, no train_state.durable (nothing make would
    take for complete), no temporary, the working copy and its link as they were; the same
    persist later completes. In the background the failure is kept for `state check`, which
    runs the persist again."""
    run, state = fresh
    ckpt = run / "ckpt-1"
    before = state_files(ckpt)
    small = min(p.stat().st_size for p in (state / "ckpt-1").rglob("*.safetensors"))
    with file_size_limit(small // 2):
        code, _, err = invoke(["state", "persist", str(run), "1", "--state-dir", str(state)])
        assert code == 1 and "file too large" in one_line(err)
        assert invoke(["state", "persist", str(run), "1", "--state-dir", str(state),
                       "--background"])[0] == 0  # the copy runs on, inheriting the limit
    wait_persists(state)
    assert not persist.durable(ckpt) and (ckpt / persist.ERROR).is_file()
    assert "file too large" in (ckpt / persist.ERROR).read_text()
    assert (ckpt / LINK).is_symlink() and state_files(ckpt) == before
    no_tmp(run)
    code, _, err = invoke(["state", "check", str(run), "1", "--state-dir", str(state)])
    assert code == 0 and "its last persist failed" in err
    assert tree(ckpt / DURABLE) == before and not (ckpt / persist.ERROR).exists()


KILL_MID_COPY = """
import os, signal, sys
from marscli.train import persist
copy = persist._copy_file
def copy_then_die(a, b):
    copy(a, b)
    os.kill(os.getpid(), signal.SIGKILL)  # after the first file: state.json comes last
persist._copy_file = copy_then_die
persist.persist(sys.argv[1], 1, sys.argv[2])
"""


def test_a_persist_killed_half_way_leaves_nothing_taken_for_complete(fresh):
    """kill -9 in the middle of the copy: no train_state.durable, only a `.tmp-PID` that
    nothing reads; with the working copy then lost, the redo goes back to ckpt-0, not to the
    half copy; the next persist removes the temporary and completes."""
    run, state = fresh
    ckpt = run / "ckpt-1"
    before = state_files(ckpt)
    p = subprocess.run([sys.executable, "-c", KILL_MID_COPY, str(run), str(state)], env=ENV,
                       cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == -signal.SIGKILL, p.stderr
    assert not persist.durable(ckpt) and list(ckpt.glob(f"{DURABLE}.tmp-*"))
    hidden = state.with_name("hidden")
    (state / "ckpt-1").rename(hidden)  # the working copy lost
    assert not persist.usable(ckpt, state) and persist.redo_from(str(run), 1, str(state)) == 0
    hidden.rename(state / "ckpt-1")
    assert invoke(["state", "persist", str(run), "1", "--state-dir", str(state)])[0] == 0
    assert tree(ckpt / DURABLE) == before
    no_tmp(run)


# ----------------------------------------------------------------------------- settle, prune


def fake_state(folder: Path, tag: str) -> Path:
    folder.mkdir(parents=True)
    (folder / "state.json").write_text(json.dumps({"v": 2, "tag": tag}))
    return folder


def test_settle_and_prune_keep_the_newest_durable_copy(tmp_path):
    """prune (KEEP_STATE=1, after ckpt-4): ckpt-4 keeps its working copy; ckpt-2, the newest
    durable, keeps its durable copy only (its link then leads there); ckpt-1 and ckpt-3 lose
    everything, their working copies too, and so does a copy no checkpoint links to; ckpt-0 is
    never touched. settle puts ckpt-4's state in the link's place; one killed between its two
    renames is finished by the next check."""
    run, state = tmp_path / "run", tmp_path / "local" / "run"
    fake_state(run / "ckpt-0" / LINK, "sft")
    for k in (1, 2, 3, 4):
        (run / f"ckpt-{k}").mkdir(parents=True)
        (run / f"ckpt-{k}" / LINK).symlink_to(fake_state(state / f"ckpt-{k}", f"local{k}"))
    for k in (1, 2):
        fake_state(run / f"ckpt-{k}" / DURABLE, f"durable{k}")
    fake_state(state / "ckpt-9", "orphan")
    persist.prune(str(run), 4, 1, str(state))
    assert [persist._has_state(run / f"ckpt-{k}") for k in range(5)] == [
        True, False, True, False, True]
    assert os.readlink(run / "ckpt-2" / LINK) == DURABLE
    assert sorted(p.name for p in state.glob("ckpt-*") if p.is_dir()) == ["ckpt-4"]
    assert json.loads((run / "ckpt-0" / LINK / "state.json").read_text())["tag"] == "sft"
    persist.settle(str(run), 4, str(state))
    ckpt = run / "ckpt-4"
    assert not (ckpt / LINK).is_symlink() and not (ckpt / DURABLE).exists()
    assert json.loads((ckpt / LINK / "state.json").read_text())["tag"] == "local4"
    assert not (state / "ckpt-4").exists()
    persist.prune(str(run), 4, 1, str(state))  # the settled one is now the newest durable
    assert not persist._has_state(run / "ckpt-2") and persist._has_state(ckpt)
    (ckpt / LINK).rename(ckpt / DURABLE)  # killed between settle's renames
    assert invoke(["state", "check", str(run), "4", "--state-dir", str(state)])[0] == 0
    assert json.loads((ckpt / LINK / "state.json").read_text())["tag"] == "local4"


# ----------------------------------------------------------------------------- the Makefile


def dry(*args: str) -> subprocess.CompletedProcess:
    e = {k: v for k, v in ENV.items() if k not in ("MAKEFLAGS", "STATE_DIR", "SLURM", "NNODES")}
    return subprocess.run(["make", "--no-print-directory", "-n", *args], cwd=ROOT, env=e,
                          text=True, capture_output=True, timeout=120, check=False)


def test_make_with_and_without_a_state_dir(tmp_path):
    """Unset: the update's command line as ever, no state command. Set: check, the redo,
    the update writing into RUN_STATE, the persist every PERSIST_EVERY, the prune through
    `marscli state`; SLURM=1 or NNODES=2 refused before anything runs."""
    run = tmp_path / "run"
    (run / "ckpt-1").mkdir(parents=True)
    (run / "ckpt-1" / "config.json").write_text("{}")  # iteration 1 from a checkpoint there
    base = ["rl-iter", "RECIPE=recipes/tiny.mk", f"RUN={run}", "ITER=1", "FOLLOW=0"]
    r = dry(*base)
    assert r.returncode == 0, r.stderr
    plain = r.stdout.replace("\\\n", " ").splitlines()
    (update,) = [x for x in plain if "stages/update.sh" in x]
    assert update.endswith(f"--metrics {run}/iter-1/metrics.jsonl")
    assert not [x for x in plain if " state " in x]
    local = tmp_path / "shm"
    lines = dry(*base, f"STATE_DIR={local}", "PERSIST_EVERY=2").stdout.replace(
        "\\\n", " ").splitlines()
    (update,) = [x for x in lines if "stages/update.sh" in x]
    assert update.endswith(f"--metrics {run}/iter-1/metrics.jsonl --state-dir {local}/run")
    state = [x.split(" state ", 1)[1] for x in lines if " state " in x]
    assert [x.split()[0] for x in state] == ["check", "check", "redo-from", "adopt", "persist",
                                             "prune"], state
    assert f"persist {run} 2 --background --state-dir {local}/run" in state[4]
    assert "[ $(( 2 % 2 )) != 0 ] ||" in next(x for x in lines if " persist " in x)
    for bad in ("SLURM=1", "NNODES=2"):
        r = dry(*base, f"STATE_DIR={local}", bad)
        assert r.returncode == 2 and "node-local" in r.stderr, r.stderr
    assert not local.exists()  # a dry run writes nothing


# ----------------------------------------------------------------------------- the loop, resumed

LOOP = ["RECIPE=recipes/tiny.mk", "COLD_START=none", "BASE=recipes/tiny-vlm", "KINDS=perception",
        "PROMPTS_PER_ITER=8", "N=4", "MAX_TURNS=3", "MAX_TURN_TOKENS=48",
        "ADV_OPTS=--estimator bn-gspo --minibatches 2",
        "WORLD_OPTS=--entities 5 --grid 4 --zoom-cells 2 --clutter 0 --train 8 --test 4 --sft 0 "
        "--kinds perception --seed 0"]


def make(target: str, run: Path, *args: str) -> subprocess.CompletedProcess:
    r = subprocess.run(["make", "--no-print-directory", target, f"RUN={run}", *LOOP, *args],
                       cwd=ROOT, env={k: v for k, v in ENV.items() if k != "MAKEFLAGS"},
                       capture_output=True, text=True, timeout=900, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-4000:]
    return r


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """The toy world and its index, shared by the loops (the tiny VLM that sees is ckpt-0,
    COLD_START=none: its rollouts score, so the updates move the weights and the moments)."""
    w = tmp_path_factory.mktemp("world") / "world"
    make(f"{w}/text.sqlite.meta.json", w.parent / "unused", f"WORLD={w}")
    return w


def lost_and_resumed(tmp_path: Path, world: Path, iters: int, *args: str) -> tuple[Path, Path,
                                                                                  str]:
    """make rl-iter 0..ITERS-1 with STATE_DIR; a copy of the run as it is then (stopped before
    the end of make rl); `make rl` to its end on the run (the uninterrupted reference); the
    node-local folder wiped; `make rl` on the copy (the resumed run). Returns both runs and
    the resumed make's stderr."""
    run, local = tmp_path / "run", tmp_path / "shm"
    loop = [f"WORLD={world}", f"STATE_DIR={local}", f"ITERS={iters}", *args]
    for i in range(iters):
        make("rl-iter", run, f"ITER={i}", *loop)
    wait_persists(local / "run")
    copy = tmp_path / "copy"
    shutil.copytree(run, copy, symlinks=True)  # the files' times kept: make sees them done
    make("rl", run, *loop)
    shutil.rmtree(local)
    return run, copy, make("rl", copy, *loop).stderr


def check_resumed(run: Path, copy: Path, last: int) -> None:
    """Both runs end alike, byte for byte, the last state settled in the run folder and no
    other state, working copy or temporary left."""
    a, b = run / f"ckpt-{last}", copy / f"ckpt-{last}"
    assert not (b / LINK).is_symlink() and (b / LINK / "state.json").is_file()
    assert tree(a) == tree(b)
    for r in (run, copy):
        assert [k for k in range(1, last) if persist._has_state(r / f"ckpt-{k}")] == []
    local = run.parent / "shm"
    assert sorted(p.name for p in (local / "copy").iterdir()
                  if not p.name.endswith(persist.LOCK)) == [persist.OWNER]
    no_tmp(run, copy)


@pytest.mark.slow
def test_a_lost_state_is_redone_from_the_last_durable_copy_bit_for_bit(tmp_path, world):
    """1 rank, 3 iterations, PERSIST_EVERY=2: ckpt-2 is copied into the run folder (in the
    background), ckpt-3 is not; its working copy lost, make redoes iteration 2's update from
    ckpt-2's durable copy and the same advantage rows, and ckpt-3 equals the uninterrupted
    run's, state included, to the byte."""
    run, copy, err = lost_and_resumed(tmp_path, world, 3, "PERSIST_EVERY=2")
    assert "redoing the updates of iterations 2..2 from ckpt-2's" in err, err
    assert "differ" not in err
    check_resumed(run, copy, 3)
    metrics = [(r / "iter-2" / "metrics.jsonl").read_bytes() for r in (run, copy)]
    assert metrics[0] == metrics[1]  # the redo's metrics stay in its scratch folder


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, world) -> tuple[Path, Path, str]:
    """2 ranks, DeepSpeed ZeRO-2 with --keep-optimizer, 2 iterations, PERSIST_EVERY=3 (nothing
    copied before the end): lost_and_resumed."""
    return lost_and_resumed(tmp_path_factory.mktemp("two"), world, 2, "PERSIST_EVERY=3",
                            "NPROC=2", "DEEPSPEED=recipes/ds_zero2.json")


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_redo_both_updates_from_ckpt_0_bit_for_bit(two_ranks):
    run, copy, err = two_ranks
    assert "redoing the updates of iterations 0..1 from ckpt-0's" in err, err
    check_resumed(run, copy, 2)
    names = sorted(p.name for p in (copy / "ckpt-2" / LINK).iterdir())
    assert names == ["moments-rank-00000-of-00002.safetensors",
                     "moments-rank-00001-of-00002.safetensors", "shards.json", "state.json"]


@pytest.mark.slow
@pytest.mark.distributed
def test_a_state_of_two_ranks_persisted_loads_on_one(two_ranks, tmp_path):
    """ckpt-2's state, written by 2 ranks and copied into the run folder, and the same files
    as a node-local working copy behind a link, each read by a 1-rank update (re-sharded by
    name): both carry AdamW's state and give the same checkpoint, byte for byte."""
    run, _, _ = two_ranks
    linked = tmp_path / "linked"
    shutil.copytree(run / "ckpt-2", linked, ignore=shutil.ignore_patterns(LINK))
    shutil.copytree(run / "ckpt-2" / LINK, tmp_path / "shm" / "ckpt-2")
    (linked / LINK).symlink_to(tmp_path / "shm" / "ckpt-2")
    outs = []
    for policy in (run / "ckpt-2", linked):
        out = tmp_path / f"from-{policy.name}"
        r = subprocess.run([*[sys.executable, "-m", "marscli"], "update",
                            str(run / "iter-0" / "advantages.jsonl"), "--policy", str(policy),
                            "--out", str(out), "--deepspeed", "recipes/ds_zero2.json",
                            "--keep-optimizer", "--lr", "1e-4", "--seed", "1"], cwd=ROOT,
                           env=ENV, capture_output=True, text=True, timeout=600, check=False)
        assert r.returncode == 0, r.stderr[-4000:]
        meta = json.loads((out / "marscli.meta.json").read_text())
        assert meta["stats"]["optimizer"] == "carried" and meta["stats"]["ranks"] == 1
        outs.append(out)
    skip = {"marscli.meta.json", "metrics.jsonl"}
    a, b = ({k: v for k, v in tree(o).items() if k not in skip} for o in outs)
    assert a == b and "train_state/moments-rank-00000-of-00001.safetensors" in a
