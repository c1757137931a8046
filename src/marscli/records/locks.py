"""One writer per output, and whether a file is still being written.

- `OutputLock(OUT)`: `flock(LOCK_EX | LOCK_NB)` on `OUT.lock` (`OUT.meta.json` shares its data
  file's lock) with the holder's pid in it; a second writer fails at once (`RuntimeFailure`,
  exit 1) naming that pid. Every writer of `records.outputs` holds it; `hold_lock(OUT)` takes
  it early. See `OutputLock` for why removing the lock file is safe.
- `writer_alive(OUT)`: whether a live process holds it (`jsonl.follow_rows` watches the writer
  so); `live_writer(OUT)`: its pid, confirmed on the lock itself, which readers use to refuse a
  file still being written (`refuse_live_writer`).
- `running(pid)`: whether a process runs on this machine (the stale temporaries of
  `records.outputs` are those of pids that no longer do).
"""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path
from typing import Any

from marscli.errors import BadInput, RuntimeFailure
from marscli.records.provenance import inode


def lock_path(out: str | Path) -> Path:
    """`OUT.lock`; a sidecar `OUT.meta.json` shares its data file's lock."""
    out = Path(out)
    name = out.name
    if name.endswith(".meta.json") and name != ".meta.json":
        name = name[: -len(".meta.json")]
    return out.with_name(f"{name}.lock")


def writer_alive(out: str | Path) -> bool:
    """A live process on this machine holds (or last held) `out`'s lock file."""
    try:
        pid = int(lock_path(out).read_text().strip() or 0)
    except (OSError, ValueError):
        return False
    return pid > 0 and running(pid)


def live_writer(out: str | Path) -> int | None:
    """The pid of another process that holds `out`'s lock now; None when none does (no lock
    file, a killed holder's stale one, or this process's own lock). The pid in the file is
    confirmed by trying a shared lock, so a stale file whose pid was reused does not count."""
    import fcntl

    path = lock_path(out)
    try:
        pid = int(path.read_text().strip() or 0)
    except (OSError, ValueError):
        return None
    if pid <= 0 or pid == os.getpid() or not running(pid):
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None  # released (and removed) just now
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return pid
    except OSError:  # no file locks here: the live pid is all there is to go by
        return pid
    finally:
        os.close(fd)  # drops the shared lock, if taken
    return None


def refuse_live_writer(path: str | Path) -> None:
    """RuntimeFailure (exit 1) when another process is still writing `path` (it holds its
    lock): a reader without `--follow` would take a half-written file for the whole."""
    pid = live_writer(path)
    if pid is not None:
        raise RuntimeFailure(f"{path}: another process (pid {pid}) is still writing it — wait "
                             "for it to finish (its sidecar comes last), or score it as it "
                             "comes with reward --follow")


# lock file → [fd, holders]. The process's, not a stage's: flock belongs to the open file, so
# a second take from this process on a new descriptor would fail against itself, and a lock
# is re-entrant wherever it is taken again (a stage function called inside another, or none).
_HELD: dict[str, list] = {}


class OutputLock:
    """`flock(LOCK_EX | LOCK_NB)` on `OUT.lock`, the holder's pid written in it; a second
    writer gets `RuntimeFailure` (exit 1: nothing is wrong with its input, and a later retry
    works) naming that pid. Re-entrant within a process.

    The lock file is removed on release, while still locked. That is safe because a taker
    checks, once it holds the lock, that the name still leads to the inode it locked (else it
    locked a file just removed, and starts over on the new one): two processes can never both
    hold the lock of the same name. A kill -9 leaves the file but not the lock (the kernel drops
    it with the process), so a stale `OUT.lock` never blocks; the next writer reuses it. Where
    the file system has no flock (some network mounts), a warning and no lock.
    """

    def __init__(self, out: str | Path) -> None:
        self.out = Path(out)
        self.path = lock_path(self.out)
        self.key = str(self.path.resolve())

    def __enter__(self) -> OutputLock:
        held = _HELD.get(self.key)
        if held is not None:
            held[1] += 1
            return self
        fd = self._take()
        _HELD[self.key] = [fd, 1]
        return self

    def _take(self) -> int | None:
        import fcntl

        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise RuntimeFailure(
                    f"{self.out}: another marscli is writing it (pid {pid}, lock {self.path}) — "
                    "wait for it to end, or pick another output") from None
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                print(f"warning: {self.path}: no file locks here ({e.strerror}) — make sure "
                      "no other marscli writes this output", file=sys.stderr)
                return None
            try:
                same = inode(os.fstat(fd)) == inode(os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                return fd
            os.close(fd)  # its holder removed it as we took it: take the new one

    def __exit__(self, *exc: Any) -> None:
        held = _HELD[self.key]
        held[1] -= 1
        if held[1]:
            return
        del _HELD[self.key]
        fd = held[0]
        if fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)  # still locked: see the class docstring
        except OSError:
            pass
        os.close(fd)


def hold_lock(out: str | Path) -> OutputLock:
    """OUT's lock, taken (its folder made first); BadInput when the folder cannot be written.
    A stage that must own OUT before it starts work (reward) takes it early with this; the
    writers take it again (re-entrant) when they open OUT. Release with `__exit__()`."""
    out = Path(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        return OutputLock(out).__enter__()
    except OSError as e:
        raise BadInput(f"{out}: cannot write here ({e.strerror or e})") from None



def running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True
