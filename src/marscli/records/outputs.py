"""Outputs written whole, one writer at a time, never onto an input of the stage.

- One writer per output: `AtomicFile`, `AtomicJsonl`, `AppendJsonl` and `AtomicDir` hold
  `OutputLock(OUT)` (`records.locks`); a second writer fails at once naming the first's pid.
- Every writer first refuses an output that is an input of the stage (`provenance.Inputs`),
  and while open stands as an output no input of the stage may be; a writer that fails ends
  the stage's memory of its inputs.
- `AtomicFile(path)` writes to `PATH.tmp-PID` (`tmp_path`) and renames on success, so a failed
  stage leaves no partial file (and a pre-existing file untouched), a full disk included.
  `AtomicJsonl(path)` does so with records; for `-` it buffers and prints on success.
- `AppendJsonl(path)` is for resumable stages: one complete record per `write()`, a torn last
  line (from kill -9) is cut off on open, a record that fails to write (a full disk) is cut off
  at once, and `ids` lists what is already there (`on_row` sees each of those records: the
  resume check of `agent/runner.py` reads what made them).
- `AtomicDir(OUT)`: a folder built as `OUT.tmp-PID` and renamed onto OUT on success (an
  existing OUT goes only once the new one is complete), removed on error. Every stage that
  writes a folder uses it: `update`, `sft` (and its resumable `OUT.partial/`), `tiny-model`,
  `toy-world`. Files and folders in it get the usual modes (`usual_modes`: 0666/0777 less the
  umask; transformers and safetensors write 0600). A replace killed between its two renames
  leaves `OUT.old-PID` (and no OUT): the next `AtomicDir` on OUT, or `recover_replaced(OUT)`,
  puts it back when OUT is missing (the interrupted replace never happened) and removes it when
  OUT is there, once PID no longer runs.
- `remove_stale_tmp(path)` removes the `PATH.tmp-PID` of killed runs (kill -9 runs no cleanup);
  `AtomicFile` and `AtomicDir` call it before writing, so a re-run after a kill leaves no
  temporary behind.
"""

from __future__ import annotations

import glob
import os
import shutil
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Self

import orjson

from marscli.errors import BadInput
from marscli.records.jsonl import dumps
from marscli.records.locks import OutputLock, hold_lock, running
from marscli.records.provenance import current_inputs


def check_writable(path: Path) -> None:
    """An output path must not be a folder (a rename onto it, or an append, would fail late)."""
    if path.is_dir():
        raise BadInput(f"{path}: is a folder — name a file to write")


def tmp_path(path: str | Path, pid: int | None = None) -> Path:
    """`PATH.tmp-PID` (this process's pid unless `pid` is given: one every rank can compute),
    where an output is written before it is renamed onto PATH."""
    path = Path(path)
    return path.with_name(f"{path.name}.tmp-{os.getpid() if pid is None else pid}")


def remove_stale_tmp(path: str | Path, kind: str = "tmp") -> None:
    """Remove the `PATH.tmp-PID` files and folders of killed runs (kill -9 skips every cleanup):
    those whose PID no longer runs on this machine. Called before writing PATH again, so a
    re-run after a kill leaves no temporary behind. (`kind="old"`: `PATH.old-PID`.)"""
    path = Path(path)
    for p, _pid in stale(path, kind):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def stale(path: Path, kind: str = "tmp") -> list[tuple[Path, int]]:
    """`PATH.KIND-PID` names whose PID no longer runs (nor is this process)."""
    found = []
    for p in path.parent.glob(f"{glob.escape(path.name)}.{kind}-*"):
        pid = p.name[len(path.name) + len(kind) + 2:]
        if pid.isdigit() and int(pid) != os.getpid() and not running(int(pid)):
            found.append((p, int(pid)))
    return sorted(found)


def _named(e: OSError, path: Path) -> OSError:
    """The same error naming `path` (a failed write() names no file)."""
    if e.filename or e.errno is None:
        return e
    return type(e)(e.errno, e.strerror, str(path))


class _Output:
    """What every file writer does on entry and exit: refuse an input, lock, and (while open)
    stand as an output that no input may be (module docstring)."""

    def _open_output(self, path: Path, replaces_input: bool = False) -> None:
        self._inputs = current_inputs()  # the stage's, until this output closes
        if replaces_input:
            self._inputs.drop(path)
        check_writable(path)
        self._inputs.check_not_input(path)
        self._lock = hold_lock(path)
        self._keys = self._inputs.open_output(path)

    def _close_output(self, failed: bool) -> None:
        self._inputs.close_output(self._keys)
        self._lock.__exit__(None, None, None)
        if failed:
            self._inputs.forget()  # the stage is over


class AtomicFile(_Output):
    """Write bytes to `PATH.tmp-PID`; rename onto PATH on clean exit, delete on error (a full
    disk while closing included). `replaces_input=True` is for a stage that rewrites its own
    input in place (eval --rescore): the new file replaces the old one only at the end."""

    def __init__(self, path: str | Path, mode: str = "wb", replaces_input: bool = False) -> None:
        self.path = Path(path)
        self.tmp = tmp_path(self.path)
        self.mode = mode
        self.replaces_input = replaces_input

    def __enter__(self):
        self._open_output(self.path, self.replaces_input)
        try:
            remove_stale_tmp(self.path)
            self.fh = self.tmp.open(self.mode)
        except OSError as e:
            self._close_output(failed=True)
            raise BadInput(f"{self.path}: cannot write here ({e.strerror or e})") from None
        return self.fh

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.fh.close()
            if exc_type is None:
                os.replace(self.tmp, self.path)
        except OSError as e:
            self.tmp.unlink(missing_ok=True)
            self._close_output(failed=True)
            raise _named(e, self.path) from None
        if exc_type is not None:
            self.tmp.unlink(missing_ok=True)
        self._close_output(failed=exc_type is not None)


def write_output(output: str, data: bytes) -> None:
    """A whole output's bytes (a PNG, a page): to stdout for `-`, else atomically to `output`."""
    if output == "-":
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
        return
    with AtomicFile(output) as fh:
        fh.write(data)


class AtomicJsonl:
    """All-or-nothing JSONL output. `-` buffers in memory and prints on success."""

    def __init__(self, path: str, replaces_input: bool = False) -> None:
        self.path = path
        self.count = 0
        self.replaces_input = replaces_input

    def __enter__(self) -> AtomicJsonl:
        self._buf: list[bytes] | None = [] if self.path == "-" else None
        if self._buf is None:
            self._atomic = AtomicFile(self.path, replaces_input=self.replaces_input)
            self._fh = self._atomic.__enter__()
        return self

    def write(self, row: dict) -> None:
        line = dumps(row)
        if self._buf is not None:
            self._buf.append(line)
        else:
            self._fh.write(line)
        self.count += 1

    def write_all(self, rows: Iterable[dict]) -> None:
        for r in rows:
            self.write(r)

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._buf is not None:
            if exc_type is None:
                sys.stdout.buffer.write(b"".join(self._buf))
                sys.stdout.buffer.flush()
            return
        self._atomic.__exit__(exc_type, exc, tb)


class AppendJsonl(_Output):
    """Append-only output for resumable stages (rollout, eval).

    Each record goes out whole (unbuffered) before `write()` returns, so a kill leaves at most
    one torn last line; opening cuts that torn tail, a write that fails (a full disk) cuts its
    own, and `ids` holds the ids already complete.
    """

    def __init__(self, path: str, key: str = "id",
                 on_row: Callable[[int, dict], None] | None = None) -> None:
        if path == "-":
            raise BadInput("-o -: resumable stages need an output file, not stdout")
        self.path = Path(path)
        self.key = key
        self.on_row = on_row  # sees each record already there (line, row) as it is scanned
        self.ids: set[str] = set()
        self.count = 0

    def __enter__(self) -> AppendJsonl:
        self._open_output(self.path)  # locked before the repair: two resumers never both cut
        try:
            if self.path.exists():
                self._repair_and_scan()
            self._fh = self.path.open("ab", buffering=0)
        except BaseException:
            self._close_output(failed=True)
            raise
        return self

    def _repair_and_scan(self) -> None:
        data = self.path.read_bytes()
        keep = data.rfind(b"\n") + 1  # everything after the last newline is a torn record
        if keep < len(data):
            with self.path.open("r+b") as fh:
                fh.truncate(keep)
            print(f"{self.path}: cut a torn last record ({len(data) - keep} bytes)",
                  file=sys.stderr)
        for n, line in enumerate(data[:keep].splitlines(), start=1):
            if line.strip():
                try:
                    row = orjson.loads(line)
                    self.ids.add(row[self.key])
                except (orjson.JSONDecodeError, KeyError, TypeError):
                    raise BadInput(
                        f"{self.path}:{n}: {self.key}: existing output is not a "
                        "record of this stage — move it away or pick another -o") from None
                if self.on_row is not None:
                    self.on_row(n, row)

    def write(self, row: dict) -> None:
        data = memoryview(dumps(row))
        start = self._fh.seek(0, os.SEEK_END)
        try:
            while data:
                data = data[self._fh.write(data):]
        except OSError as e:
            self._fh.truncate(start)  # no half record left behind
            raise _named(e, self.path) from None
        self.ids.add(row[self.key])
        self.count += 1

    def __exit__(self, exc_type, exc, tb) -> None:
        self._fh.close()
        self._close_output(failed=exc_type is not None)


class AtomicDir:
    """Build a folder in `OUT.tmp-PID` (or `tmp`, a name every rank can compute); on success
    rename it onto OUT, replacing an existing OUT only once the new one is complete; on error
    remove it. Inactive (no folder, no lock) where `active` is false (ranks other than 0)."""

    def __init__(self, out: str | Path, active: bool = True, tmp: str | Path | None = None) -> None:
        self.out, self.active = Path(out), active
        if active:
            check_replaceable(self.out)
        self.tmp = Path(tmp) if tmp is not None else tmp_path(self.out)

    def __enter__(self) -> Self:
        if not self.active:
            return self
        current_inputs().check_no_input_inside(self.out)
        try:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self._lock = OutputLock(self.out).__enter__()
        except OSError as e:
            raise BadInput(f"{self.out}: cannot write here ({e.strerror or e})") from None
        try:
            recover_replaced(self.out)
            remove_stale_tmp(self.out)  # what a killed run left
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp.mkdir()
        except BaseException:
            self._lock.__exit__()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.active:
            return
        try:
            if exc_type is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)
                return
            try:
                usual_modes(self.tmp)
                self._swap()
            except BaseException:
                shutil.rmtree(self.tmp, ignore_errors=True)
                raise
        finally:
            self._lock.__exit__()

    def _swap(self) -> None:
        old = None
        if self.out.exists():
            old = self.out.with_name(f"{self.out.name}.old-{os.getpid()}")
            os.replace(self.out, old)
        try:
            os.replace(self.tmp, self.out)  # a kill before this line: recover_replaced
        except BaseException:
            if old is not None:  # the new one failed: the old stays where it was
                os.replace(old, self.out)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def check_replaceable(out: Path) -> None:
    """A folder output is renamed onto OUT whole, so OUT cannot be the current folder or one
    holding it (`.`, `..`: the rename fails half-way, or the shell is left in a deleted
    folder) nor a mount point (rename refuses it, EBUSY)."""
    where = out.resolve()
    try:
        here = Path.cwd().resolve()
    except OSError:  # the current folder was deleted: nothing to hold
        here = None
    if here is not None and (where == here or where in here.parents):
        what = "the current folder" if where == here else "a folder holding the current folder"
        raise BadInput(f"{out}: is {what} — a folder output replaces OUT whole; run from "
                       "outside it or name another OUT")
    if where.is_dir() and os.path.ismount(where):
        raise BadInput(f"{out}: is a mount point, which cannot be replaced — name a folder "
                       "inside it")


def recover_replaced(out: str | Path) -> None:
    """Finish what a replace killed between AtomicDir's two renames left (`OUT.old-PID`, PID no
    longer running): without OUT, the old folder goes back (the replace never happened, and
    it is the last complete one); with OUT, it is garbage and goes."""
    out = Path(out)
    for old, pid in stale(out, "old"):
        if out.exists() or out.is_symlink():
            shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink(missing_ok=True)
            print(f"{old}: removed (left by pid {pid}, killed while replacing {out})",
                  file=sys.stderr)
        else:
            os.replace(old, out)
            print(f"{out}: put back from {old.name} (pid {pid} was killed while replacing it)",
                  file=sys.stderr)


def find_replaced(path: Path, option: str = "--policy") -> None:
    """A checkpoint folder that is missing because a replace moved it aside (`PATH.old-PID`,
    AtomicDir's first rename) and never put the new one in: put it back when PID no longer
    runs (the replace was killed or failed: the old folder is the last complete one), or say
    where it is while PID runs."""
    recover_replaced(path)
    if path.exists():
        return
    for old in sorted(path.parent.glob(f"{glob.escape(path.name)}.old-*")):
        pid = old.name[len(path.name) + len(".old-"):]
        if pid.isdigit() and old.is_dir():
            raise BadInput(f"{option}: {path}: missing — the checkpoint is in {old} (moved "
                           f"aside by pid {pid}, still running, while it replaces "
                           f"{path.name}); wait for it, or `mv {old} {path}`")


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def usual_modes(folder: Path) -> None:
    """Give `folder` and everything in it the modes a plain write would (0666 files, 0777
    folders and executables, less the umask): transformers and safetensors write 0600, and
    a checkpoint others cannot read is of no use on a shared cluster."""
    umask = _umask()
    folder.chmod(0o777 & ~umask)
    for root, dirs, files in os.walk(folder):
        for d in dirs:
            Path(root, d).chmod(0o777 & ~umask)
        for f in files:
            p = Path(root, f)
            if not p.is_symlink():
                p.chmod((0o777 if p.stat().st_mode & 0o100 else 0o666) & ~umask)
