"""The loop's training state on node-local storage, copied durably into the run folder.

    RUN/ckpt-k/train_state           a link to STATE/ckpt-k, the working copy (node-local)
    RUN/ckpt-k/train_state.durable/  its durable copy, once persisted
    STATE = STATE_DIR/<run's name>   (make's RUN_STATE), with .marscli-run naming the run

`update --state-dir STATE` writes OUT's train_state/ into STATE/<OUT's name> (built as
`.tmp-PID`, renamed when whole) and OUT/train_state as a link to it: the next update reads the
state through the link (trainstate.py reads it as ever), and none of it crosses the shared
file system (~100 GB an iteration at 8B). `persist` copies it to
`train_state.durable.tmp-PID` beside the link, fsyncs every file and folder, and renames it
`train_state.durable`: the rename is the commit point, so a folder of that name is whole, and
a copy killed half-way is a `.tmp-PID` that nothing reads (the next persist removes it).
`settle` (the end of make rl) puts the durable copy in the link's place: the finished run is
self-contained, in the layout of a run without STATE_DIR.

When the working copy is gone (a wiped /dev/shm, another node after a re-allocation), the
link dangles: `check` re-points it at the durable copy when there is one; otherwise
`redo-from` names the newest checkpoint whose state is there (ckpt-0's always is), make redoes
the updates since then from the same advantage rows into STATE/redo/ (the rollouts were a
function of the exported weights and the seeds, so nothing else is redone), and `adopt` links
the result: bit for bit what the lost state was, on CPU (`tests/train/test_state_dir.py`).
Importing this module is cheap: no torch (the trainer's helpers import it inside).
"""

from __future__ import annotations

import errno
import fcntl
import filecmp
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from marscli.errors import BadInput, MarsError, RuntimeFailure, os_error
from marscli.records.outputs import remove_stale_tmp, tmp_path
from marscli.train.trainstate import DURABLE, STATE_DIR, check_present, restamp

LINK = STATE_DIR  # a folder, or a link to the working copy
LOCK = ".persist-lock"  # STATE/ckpt-k.persist-lock: one persist (prune, settle) at a time
ERROR = "train_state.persist-error"  # a background persist that failed: its one line
OWNER = ".marscli-run"  # in STATE: the run whose working copies it holds
REDO = "redo"  # in STATE: the checkpoints of redone updates
COPIERS = 8  # files copied at once: a parallel file system writes streams in parallel


def local_path(state_dir: str | Path, out: str | Path) -> Path:
    """Where `update --state-dir` puts OUT's working copy."""
    return Path(state_dir).absolute() / Path(out).name


# ------------------------------------------------------------------------------ the trainer


def check_state_dir(state_dir: str, out: str, policy: str | None, need: int = 0) -> None:
    """--state-dir can take OUT's working copy: a folder this process can write (created),
    not --policy's own working copy, and `need` bytes free. BadInput (exit 2) otherwise."""
    d = Path(state_dir)
    _writable(d, "--state-dir")
    mine = local_path(d, out)
    if policy and (Path(policy) / LINK).resolve() == mine.resolve():
        raise BadInput(f"--state-dir: {mine} holds --policy's own training state — name --out "
                       "differently, or use another --state-dir")
    _room(d, need, "--state-dir")


def state_need(policy: str, export_dtype: str, optimizer: bool) -> int:
    """Bytes of the train_state/ an update of `policy` writes: 4 B a parameter of fp32 masters
    (unless the export is float32), 8 of AdamW's moments with `optimizer`."""
    from marscli.qwen.policy import safetensors_header

    n = 0
    for f in Path(policy).glob("*.safetensors"):
        for h in safetensors_header(f).values():
            k = 1
            for s in h["shape"]:
                k *= s
            n += k
    return n * ((4 if export_dtype != "float32" else 0) + (8 if optimizer else 0))


def check_everywhere(state_dir: str, d: Any) -> None:
    """Every rank sees rank 0's --state-dir (collective): node-local storage holds one
    node's ranks only, and rank files written elsewhere would be lost."""
    from marscli.train.distributed import all_reduce, barrier

    pid = int(all_reduce([os.getpid() if d.main else 0], d)[0])
    probe = Path(state_dir) / f".probe-{pid}"
    if d.main:
        probe.write_text("")
    barrier(d)
    seen = all_reduce([1.0 if probe.is_file() else 0.0], d, "min")[0]
    barrier(d)
    if d.main:
        probe.unlink(missing_ok=True)
    if seen < 1:
        raise BadInput(f"--state-dir: {state_dir}: not the same folder on every rank "
                       "(node-local storage, ranks on several nodes) — leave --state-dir out, "
                       "or train on one node")


# ------------------------------------------------------------------------------ the loop


def ckpt_of(run: str | Path, k: int) -> Path:
    return Path(run) / f"ckpt-{k}"


def durable(ckpt: Path) -> bool:
    """The checkpoint's state is in the run folder: a durable copy, or a plain folder (a run
    without STATE_DIR, a settled checkpoint, the cold start's)."""
    link = ckpt / LINK
    return (ckpt / DURABLE).is_dir() or (link.is_dir() and not link.is_symlink())


def usable(ckpt: Path, state: Path | None) -> bool:
    """Its state can be read, at once or after `repair`."""
    link = ckpt / LINK
    return ((link / "state.json").is_file() or durable(ckpt)
            or (state is not None and link.is_symlink()
                and (state / ckpt.name / "state.json").is_file()))


def repair(ckpt: Path, state: Path | None) -> None:
    """Finish a settle killed between its two renames; point a link whose working copy is
    gone at the durable copy, or at STATE's copy of the checkpoint (what a redo wrote)."""
    link = ckpt / LINK
    if not link.exists() and not link.is_symlink() and (ckpt / DURABLE).is_dir():
        os.rename(ckpt / DURABLE, link)
        _fsync_dir(ckpt)
        _note(f"{link}: put in place from {DURABLE} (a settle was interrupted)")
    elif link.is_symlink() and not (link / "state.json").is_file():
        gone = os.readlink(link)
        if (ckpt / DURABLE).is_dir():
            _relink(link, Path(DURABLE))
        elif state is not None and (state / ckpt.name / "state.json").is_file():
            _relink(link, state / ckpt.name)
        else:
            return
        _note(f"{link}: {gone} is gone — now {os.readlink(link)}")


def check(run: str, k: int, state: str | None) -> None:
    """Before an update of ckpt-K (and before any work of make rl-iter): STATE is this run's,
    writable and has room for one more state; what kills left in RUN is finished (`repair`);
    a background persist of ckpt-K that failed is run again, here (exit 1 if it fails again)."""
    run_p = Path(run)
    st = Path(state).absolute() if state else None
    if st is not None:
        _writable(st, "STATE_DIR")
        _owner(st, run_p)
        newest = ckpt_of(run_p, k)
        _room(st, _size(newest / LINK) if (newest / LINK).is_dir() else 0, "STATE_DIR")
    for c in _ckpts(run_p).values():
        repair(c, st)
    if (ckpt_of(run_p, k) / ERROR).is_file():
        _note(f"{ckpt_of(run_p, k)}: its last persist failed "
              f"({(ckpt_of(run_p, k) / ERROR).read_text().strip()}); trying again")
        persist(run, k, state)


def redo_from(run: str, k: int, state: str | None) -> int:
    """The newest checkpoint j <= K whose state can be read (ckpt-0's always can: a lost one
    is refused), after checking that the advantage rows of iterations j..K-1 are there. The
    updates j..K-1 are what make redoes."""
    run_p = Path(run)
    st = Path(state).absolute() if state else None
    j = next((i for i in range(k, 0, -1) if usable(ckpt_of(run_p, i), st)), 0)
    zero = ckpt_of(run_p, 0)
    if j == 0 and (zero / LINK).is_symlink() and not usable(zero, st):
        raise BadInput(f"{zero / LINK}: links to {os.readlink(zero / LINK)}, which is not there, "
                       "and there is no durable copy — make the cold start again (delete "
                       f"{zero}), or restore its train_state/")
    for i in range(j, k):
        adv = run_p / f"iter-{i}" / "advantages.jsonl"
        if not Path(f"{adv}.meta.json").is_file():
            raise BadInput(f"{ckpt_of(run_p, k) / LINK}: the training state is gone and the "
                           f"updates since ckpt-{j} cannot be redone: {adv} is missing — "
                           f"restart the loop from ckpt-{j} (delete ckpt-{j + 1} onwards)")
    if j < k:
        _note(f"{ckpt_of(run_p, k) / LINK}: the training state is gone (node-local, lost) — "
              f"redoing the updates of iterations {j}..{k - 1} from ckpt-{j}'s")
    return j


def persist(run: str, k: int, state: str | None = None, background: bool = False) -> None:
    """Copy ckpt-K's working copy into the run folder (module docstring); nothing to do when
    it is durable already. `background`: the copy runs on in a process of its own, which holds
    the checkpoint's lock from this call on; a failure leaves its line in ERROR for `check`."""
    ckpt = ckpt_of(run, k)
    fd = _lock(ckpt, state)
    try:
        if background:
            log = Path(run) / "logs" / f"persist-ckpt-{k}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            with log.open("ab") as out:
                subprocess.Popen([sys.executable, "-m", "marscli", "state", "persist", str(run),
                                  str(k), "--lock-fd", str(fd)], pass_fds=(fd,),
                                 stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                 start_new_session=True)
            return
        _persist_locked(ckpt)
    finally:
        os.close(fd)


def persist_child(run: str, k: int, fd: int) -> None:
    """The background persist: the lock is held already (on `fd`, inherited); a failure's
    line goes into ERROR as well as to the log."""
    ckpt = ckpt_of(run, k)
    try:
        _persist_locked(ckpt)
    except MarsError as e:
        (ckpt / ERROR).write_text(f"{e}\n")
        raise
    finally:
        os.close(fd)


def settle(run: str, k: int, state: str | None) -> None:
    """ckpt-K's state durable, in the link's place (the end of make rl), and its working copy
    removed. A kill between the two renames is finished by `repair`."""
    ckpt = ckpt_of(run, k)
    st = Path(state).absolute() if state else None
    fd = _lock(ckpt, state)
    try:
        repair(ckpt, st)
        link = ckpt / LINK
        if not link.is_symlink():
            return
        _persist_locked(ckpt)
        local = link.resolve()
        link.unlink()
        os.rename(ckpt / DURABLE, link)  # a kill before this line: repair
        _fsync_dir(ckpt)
        _remove_local(local, st)
    finally:
        os.close(fd)
    if st is not None:  # settled: no persist of it will ever wait on this lock
        _lock_path(ckpt, st).unlink(missing_ok=True)


def adopt(run: str, k: int, state: str | None) -> None:
    """After make redid updates into STATE/redo/: link ckpt-K's state to the redone copy
    (`repair`), say if the redone weights differ from the run's (a GPU's kernels need not be
    bit-exact: the loop then goes on from the redone state), and remove STATE/redo/."""
    if not state:
        return
    st = Path(state).absolute()
    redo = st / REDO / f"ckpt-{k}"
    ckpt = ckpt_of(run, k)
    if redo.is_dir():
        mine = sorted(p.name for p in ckpt.glob("*.safetensors"))
        same = mine == sorted(p.name for p in redo.glob("*.safetensors")) and all(
            filecmp.cmp(ckpt / n, redo / n, shallow=False) for n in mine)
        if not same:
            _note(f"{ckpt}: the redone update's weights differ from the run's (kernels that "
                  "are not bit-exact) — the loop goes on from the redone state")
    repair(ckpt, st)
    if redo.is_dir() and not same:  # the redone state is now this checkpoint's (its export's)
        restamp(ckpt)
    shutil.rmtree(st / REDO, ignore_errors=True)


def prune(run: str, upto: int, keep: int, state: str | None) -> None:
    """make's prune_state with STATE_DIR: the states of ckpt-1..(UPTO - KEEP) go (the working
    copy, its link, the durable copy), except the newest durable one (what a lost working copy
    is redone from), of which only the working copy goes (its link then leads to the durable
    copy); then the working copies in STATE that no checkpoint links to."""
    run_p = Path(run)
    st = Path(state).absolute() if state else None
    ckpts = _ckpts(run_p)
    gone = [i for i, c in ckpts.items() if 0 < i <= upto - keep and _has_state(c)]
    fds = [_lock(ckpts[i], state) for i in gone]  # copies still running end first
    try:
        last = max((i for i, c in ckpts.items() if i > 0 and durable(c)), default=None)
        for i in gone:
            _prune_one(ckpts[i], st, keep_durable=i == last)
    finally:
        for i, fd in zip(gone, fds, strict=True):
            os.close(fd)
            if not _has_state(ckpts[i]):
                _lock_path(ckpts[i], state).unlink(missing_ok=True)
    if st is not None and st.is_dir():
        linked = {(c / LINK).resolve() for c in ckpts.values() if (c / LINK).is_symlink()}
        for d in st.glob("ckpt-*"):
            name = d.name.removeprefix("ckpt-")
            if name.isdigit() and d.is_dir() and d.resolve() not in linked:
                shutil.rmtree(d, ignore_errors=True)
            if name.isdigit():
                remove_stale_tmp(d)


# ------------------------------------------------------------------------------ helpers


def _persist_locked(ckpt: Path) -> None:
    """The copy itself (the caller holds the lock): to DURABLE.tmp-PID, fsynced, renamed."""
    link = ckpt / LINK
    if durable(ckpt) or not link.is_symlink():
        (ckpt / ERROR).unlink(missing_ok=True)
        return
    check_present(ckpt)
    src = link.resolve()
    remove_stale_tmp(ckpt / DURABLE)  # a persist killed half-way
    tmp = tmp_path(ckpt / DURABLE)
    before = os.stat(src / "state.json")
    try:
        _copy_tree(src, tmp)
        after = os.stat(src / "state.json")
        if (before.st_ino, before.st_mtime_ns) != (after.st_ino, after.st_mtime_ns):
            raise RuntimeFailure(f"{src}: replaced while it was copied (an update of the same "
                                 f"checkpoint ran) — run `marscli state persist` again")
        os.rename(tmp, ckpt / DURABLE)  # the commit point
        _fsync_dir(ckpt)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        err = os_error(e) if isinstance(e, OSError) else None
        if err is not None:
            raise err from None
        raise
    (ckpt / ERROR).unlink(missing_ok=True)


def _copy_tree(src: Path, dst: Path) -> None:
    """Every file of `src` into the new folder `dst`, each fsynced (COPIERS at once),
    state.json last (what the trainer writes last), then every folder fsynced."""
    files = sorted(p.relative_to(src) for p in src.rglob("*") if p.is_file())
    dst.mkdir()
    for d in sorted({f.parent for f in files}):
        (dst / d).mkdir(parents=True, exist_ok=True)
    last = [f for f in files if f == Path("state.json")]
    with ThreadPoolExecutor(COPIERS) as pool:
        list(pool.map(lambda f: _copy_file(src / f, dst / f),
                      [f for f in files if f not in last]))
    for f in last:
        _copy_file(src / f, dst / f)
    for d in sorted({f.parent for f in files}, key=lambda p: -len(p.parts)):
        _fsync_dir(dst / d)


def _copy_file(a: Path, b: Path) -> None:
    shutil.copyfile(a, b)  # sendfile on Linux: no copy through this process's memory
    fd = os.open(b, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as e:  # some file systems cannot fsync a folder; their renames are durable
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def _lock(ckpt: Path, state: str | Path | None) -> int:
    """An exclusive flock (waits for a running persist of the checkpoint); the fd, which the
    caller closes (or a background copy inherits). In STATE, node-local as every user of the
    lock is (a shared file system's flock may be off), else in the checkpoint."""
    path = _lock_path(ckpt, state)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError as e:  # no file locks on this file system: as locks.OutputLock
        if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
            os.close(fd)
            raise
        _note(f"warning: {path}: no file locks here ({e.strerror}) — run one persist at a time")
    return fd


def _lock_path(ckpt: Path, state: str | Path | None) -> Path:
    return Path(state) / f"{ckpt.name}{LOCK}" if state else ckpt / f"{LINK}{LOCK}"


def _relink(link: Path, target: Path) -> None:
    """Point `link` at `target` in one rename (readers see the old link or the new one)."""
    tmp = link.with_name(f"{link.name}.link-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    os.symlink(target, tmp)
    os.replace(tmp, link)


def _remove_local(local: Path, state: Path | None) -> None:
    """A working copy goes only from this run's STATE (a link may lead anywhere)."""
    if state is not None and local.parent == state and local.name.startswith("ckpt-"):
        shutil.rmtree(local, ignore_errors=True)


def _prune_one(c: Path, st: Path | None, keep_durable: bool) -> None:
    link = c / LINK
    if link.is_symlink():
        local = link.resolve()
        if keep_durable:
            _relink(link, Path(DURABLE))
        else:
            link.unlink()
        _remove_local(local, st)
    elif link.is_dir() and not keep_durable:
        shutil.rmtree(link)
    if not keep_durable:
        shutil.rmtree(c / DURABLE, ignore_errors=True)
        (c / ERROR).unlink(missing_ok=True)
    remove_stale_tmp(c / DURABLE)


def _has_state(ckpt: Path) -> bool:
    link = ckpt / LINK
    return link.exists() or link.is_symlink() or (ckpt / DURABLE).exists() or any(
        ckpt.glob(f"{DURABLE}.tmp-*"))


def _ckpts(run: Path) -> dict[int, Path]:
    out = {}
    for c in run.glob("ckpt-*"):
        k = c.name.removeprefix("ckpt-")
        if k.isdigit() and c.is_dir():
            out[int(k)] = c
    return dict(sorted(out.items()))


def _size(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def _writable(d: Path, what: str) -> None:
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / f".probe-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise BadInput(f"{what}: {d}: cannot write there ({e.strerror or e}) — point it at a "
                       "folder of this node's local storage you can write (/dev/shm/$USER/..., "
                       "a local NVMe)") from None


def _room(d: Path, need: int, what: str) -> None:
    free = shutil.disk_usage(d).free
    if free < need:
        raise BadInput(f"{what}: {d}: {free / 1e9:.2f} GB free, a training state takes "
                       f"{need / 1e9:.2f} GB — free space there, or point it elsewhere")


def _owner(state: Path, run: Path) -> None:
    """STATE holds one run's working copies: the first check names the run, later ones must
    name the same (seeds and ablations get a folder each: make's RUN_STATE)."""
    f = state / OWNER
    me = str(run.absolute())
    if not f.is_file():
        f.write_text(me + "\n")
    elif f.read_text().strip() != me:
        raise BadInput(f"STATE_DIR: {state} holds the training state of {f.read_text().strip()}"
                       f" — give each run a STATE_DIR of its own")


def _note(msg: str) -> None:
    print(f"state: {msg}", file=sys.stderr)
