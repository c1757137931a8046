"""Streaming JSONL in and out, the way every stage does it.

- `iter_rows(path)` yields `(line_number, dict)`; `-` is stdin. A line that is not a JSON object,
  carries a schema version other than 1, or is longer than `max_row_bytes()` (16 MiB;
  `MARSCLI_MAX_ROW_BYTES` overrides) raises `BadInput("FILE:LINE: ...")`; a long line is read
  only up to the limit, never whole.
- Every input file `iter_rows` opens is remembered (by device and inode) with the sha256 of the
  bytes it read, stdin's included: `write_sidecar` records those hashes (taken before anything
  was written, `"-"` for stdin), and every writer below refuses an output that is one of them
  (the same file, a hard link or a symlink to it; for `AtomicDir`, a folder holding one):
  `BadInput`, before anything is written. An input opened while it is being written (`merge
  OUT ... OUT`) is refused the same way. The memory ends with the stage: `write_sidecar`, a
  writer that fails, and `forget_inputs()` clear it.
- One writer per output: `AtomicFile`, `AtomicJsonl` and `AppendJsonl` (and checkpoint's
  `AtomicDir`) hold `flock(LOCK_EX | LOCK_NB)` on `OUT.lock` (`OUT.meta.json` shares its data
  file's lock) with the holder's pid in it; a second writer fails at once (`RuntimeFailure`,
  exit 1) naming that pid. See `OutputLock` for why removing the lock file is safe.
- `AtomicJsonl(path)` writes to `PATH.tmp-PID` and renames on success, so a failed stage leaves
  no partial file (and a pre-existing file untouched), a full disk included. For `-` it buffers
  and prints on success.
- `AppendJsonl(path)` is for resumable stages: one complete record per `write()`, a torn last
  line (from kill -9) is cut off on open, a record that fails to write (a full disk) is cut off
  at once, and `ids` lists what is already there.
- `write_sidecar(path, ...)` writes `PATH.meta.json` last.
- `remove_stale_tmp(path)` removes the `PATH.tmp-PID` of killed runs (kill -9 runs no cleanup);
  `AtomicFile` calls it before writing, so a re-run after a kill leaves no temporary behind.
"""

from __future__ import annotations

import errno
import glob
import hashlib
import os
import shutil
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from marscli import __version__
from marscli.errors import BadInput, RuntimeFailure
from marscli.secrets import redact

SCHEMA_VERSION = 1
_DUMP_OPTS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE
MAX_ROW_BYTES = 16 << 20  # one JSONL line; a bigger one is refused (MARSCLI_MAX_ROW_BYTES)
ROW_LIMIT_ENV = "MARSCLI_MAX_ROW_BYTES"


def dumps(row: dict) -> bytes:
    """One record as one JSONL line (newline included)."""
    return orjson.dumps(row, option=_DUMP_OPTS)


def max_row_bytes() -> int:
    """The longest line `iter_rows` reads (read at each call, so the environment can change
    it): a 50 MB row otherwise costs gigabytes once parsed and rendered."""
    raw = os.environ.get(ROW_LIMIT_ENV, "").strip()
    if not raw:
        return MAX_ROW_BYTES
    if not raw.isdigit() or int(raw) < 1:
        raise BadInput(f"{ROW_LIMIT_ENV}={raw!r}: not a positive number of bytes — unset it "
                       f"(default {MAX_ROW_BYTES}) or give one")
    return int(raw)


# ------------------------------------------------------------------------- what was read


@dataclass
class _Input:
    """An input file as `iter_rows` opened it: its name and, once it was read to the end, the
    sha256 of the bytes read."""

    path: str
    sha256: str | None = None


_INPUTS: dict[tuple[int, int], _Input] = {}  # (st_dev, st_ino) → what was read
_STDIN: dict[str, str] = {}  # "sha256": of the bytes read from stdin
_WRITING: dict[tuple[int, int] | str, str] = {}  # open outputs: (dev, ino) or resolved path


def forget_inputs() -> None:
    """End of a stage: what it read no longer binds the next stage of this process."""
    _INPUTS.clear()
    _STDIN.clear()


def _key(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _out_keys(path: Path) -> list[tuple[int, int] | str]:
    """How an output is recognised: its resolved name, and its inode when it exists."""
    keys: list[tuple[int, int] | str] = [str(path.resolve())]
    try:
        keys.append(_key(os.stat(path)))
    except OSError:
        pass
    return keys


def check_not_input(path: str | Path) -> None:
    """Refuse an output file that is an input of this stage (same inode: the same file, a hard
    link or a symlink to it), before anything is written."""
    try:
        st = os.stat(path)
    except OSError:
        return
    entry = _INPUTS.get(_key(st))
    if entry is not None:
        forget_inputs()  # the stage ends here
        same = "" if os.path.abspath(entry.path) == os.path.abspath(path) else f" (as {entry.path})"
        raise BadInput(f"{path}: is an input of this stage{same} — writing it would clobber "
                       "what is being read: pick another output")


def check_no_input_inside(folder: str | Path) -> None:
    """Refuse an output folder that holds an input of this stage (replacing it would delete
    the input)."""
    root = Path(folder).resolve()
    for entry in _INPUTS.values():
        p = Path(entry.path).resolve()
        if p == root or root in p.parents:
            forget_inputs()  # the stage ends here
            raise BadInput(f"{folder}: holds {entry.path}, an input of this stage — replacing "
                           "the folder would delete it: pick another output folder")


def _register(path: str, fh: Any) -> _Input:
    st = os.fstat(fh.fileno())
    for k in (_key(st), str(Path(path).resolve())):
        if k in _WRITING:
            fh.close()
            forget_inputs()  # the stage ends here
            raise BadInput(f"{path}: is the output being written ({_WRITING[k]}) — an output "
                           "cannot be one of the inputs: pick another output")
    entry = _Input(path)
    _INPUTS[_key(st)] = entry
    return entry


def input_sha256(path: str) -> str | None:
    """sha256 of the bytes of an input as `iter_rows` read them (`-`: stdin) — what the output
    was made from, even if the file changed since — or of the file now when it was not read
    that way (a system prompt, a text file); None when there is nothing to hash."""
    if path == "-":
        return _STDIN.get("sha256")
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not Path(path).is_file():
        return None
    entry = _INPUTS.get(_key(st))
    if entry is not None and entry.sha256:
        return entry.sha256
    return sha256_file(path)


# ------------------------------------------------------------------------- reading


def _open_in(path: str):
    if path == "-":
        return sys.stdin.buffer
    p = Path(path)
    if not p.exists():
        raise BadInput(f"{path}: no such file")
    if p.is_dir():
        raise BadInput(f"{path}: is a folder, expected a JSONL file")
    return p.open("rb")


def _lines(fh: Any, path: str, limit: int) -> Iterator[bytes]:
    """The lines of `fh` (blank ones included), none read past `limit` bytes."""
    n = 0
    while raw := fh.readline(limit + 1):
        n += 1
        if len(raw) > limit and not raw.endswith(b"\n"):
            raise BadInput(f"{path}:{n}: row is over {limit} bytes — split it or shrink it "
                           f"(images go by path), or raise {ROW_LIMIT_ENV}")
        yield raw


def iter_rows(path: str) -> Iterator[tuple[int, dict]]:
    """Yield `(line_number, row)` for each non-blank line of a JSONL file (`-`: stdin),
    hashing the bytes as they are read (module docstring)."""
    path = str(path)
    limit = max_row_bytes()
    fh = _open_in(path)
    entry = _register(path, fh) if fh is not sys.stdin.buffer else None
    h, size = hashlib.sha256(), 0
    try:
        for n, raw in enumerate(_lines(fh, path, limit), start=1):
            h.update(raw)
            size += len(raw)
            if raw.strip():
                yield n, _parse(raw, path, n)
        if entry is not None:
            entry.sha256 = h.hexdigest()
        elif size or "sha256" not in _STDIN:  # a second read of a drained stdin keeps the first
            _STDIN["sha256"] = h.hexdigest()
    except BadInput:
        forget_inputs()  # a bad input ends the stage
        raise
    finally:
        if fh is not sys.stdin.buffer:
            fh.close()


def follow_rows(path: str, *, grace_s: float = 10.0, poll_s: float = 0.1
                ) -> Iterator[tuple[int, dict]]:
    """Yield `(line_number, row)` as another process appends complete lines to `path` (a
    stage writing it: rollout), until that stage's sidecar `path.meta.json` appears and
    everything before it is read — `tail -f` that knows when to stop. Hashed and registered as
    an input, like `iter_rows`. The writer is watched through its lock file (`OUT.lock`, its
    pid: this machine only): when no live process has held it for `grace_s` seconds and no
    sidecar has come, the writer died, and RuntimeFailure says so rather than waiting forever.
    A torn last line that a resumed writer cuts off (AppendJsonl does) is dropped unread."""
    from time import monotonic, sleep

    p, sidecar = Path(path), Path(f"{path}.meta.json")
    limit = max_row_bytes()
    dead_since: float | None = None

    def writer_gone() -> bool:
        nonlocal dead_since
        if _writer_alive(p):
            dead_since = None
            return False
        dead_since = dead_since or monotonic()
        return monotonic() - dead_since > grace_s

    while not p.exists():
        if writer_gone():
            raise RuntimeFailure(f"{path}: never appeared, and nothing is writing it — start the "
                                 "stage that writes it (rollout) first, or drop --follow")
        sleep(poll_s)
    fh = _open_in(path)
    entry = _register(path, fh)
    h, n, done = hashlib.sha256(), 0, 0  # `done`: the offset after the last complete line
    try:
        while True:
            finished = sidecar.exists()  # before the read: all it covers is read below
            fh.seek(done)  # an unfinished last line is read again: a resumed writer may cut it
            data = fh.read()
            *lines, tail = data.split(b"\n")
            for raw in lines:
                n += 1
                done += len(raw) + 1
                h.update(raw + b"\n")
                if len(raw) > limit:
                    raise BadInput(f"{path}:{n}: row is over {limit} bytes")
                if raw.strip():
                    yield n, _parse(raw + b"\n", path, n)
            if lines:
                continue
            if finished:
                if tail.strip():  # a last line without its newline: whole, or BadInput
                    h.update(tail)
                    yield n + 1, _parse(tail, path, n + 1)
                break
            if writer_gone():
                raise RuntimeFailure(f"{path}: its writer stopped without writing "
                                     f"{sidecar.name} (it failed or was killed) — re-run it; "
                                     f"{n} lines were read")
            sleep(poll_s)
        entry.sha256 = h.hexdigest()
    except BadInput:
        forget_inputs()
        raise
    finally:
        fh.close()


def _writer_alive(out: Path) -> bool:
    """A live process on this machine holds (or last held) `out`'s lock file."""
    try:
        pid = int(lock_path(out).read_text().strip() or 0)
    except (OSError, ValueError):
        return False
    return pid > 0 and _running(pid)


def _parse(raw: bytes, path: str, n: int) -> dict:
    try:
        row = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        torn = "" if raw.endswith(b"\n") else " (truncated last line?)"
        raise BadInput(f"{path}:{n}: not valid JSON{torn}: {e}") from None
    if not isinstance(row, dict):
        raise BadInput(f"{path}:{n}: expected a JSON object, got {type(row).__name__}")
    v = row.get("v", SCHEMA_VERSION)
    if v != SCHEMA_VERSION:
        raise BadInput(f"{path}:{n}: v: unknown schema version {v!r} — this marscli reads v=1 "
                       "records")
    return row


def read_rows(path: str, *, allow_empty: bool = False) -> list[tuple[int, dict]]:
    rows = list(iter_rows(path))
    if not rows and not allow_empty:
        raise BadInput(f"{path}: empty input — expected at least one JSONL record")
    return rows


_MISSING = object()


def get_field(row: dict, dotted: str, types: type | tuple[type, ...], src: str, line: int,
              default: Any = _MISSING) -> Any:
    """Fetch `a.b.c` from a row, checking its type; errors name FILE:LINE: field."""
    cur: Any = row
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            if default is not _MISSING:
                return default
            raise BadInput(f"{src}:{line}: {dotted}: missing required field")
        cur = cur[part]
    # bool is an int in Python; a reward of `true` is a mistake, not a 1.
    if isinstance(cur, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise BadInput(f"{src}:{line}: {dotted}: expected {_tname(types)}, got bool")
    if not isinstance(cur, types):
        raise BadInput(f"{src}:{line}: {dotted}: expected {_tname(types)}, "
                       f"got {type(cur).__name__}")
    return cur


def _tname(types: type | tuple[type, ...]) -> str:
    ts = types if isinstance(types, tuple) else (types,)
    return " or ".join(t.__name__ for t in ts)


# ------------------------------------------------------------------------- one writer


def check_writable(path: Path) -> None:
    """An output path must not be a folder (a rename onto it, or an append, would fail late)."""
    if path.is_dir():
        raise BadInput(f"{path}: is a folder — name a file to write")


def lock_path(out: str | Path) -> Path:
    """`OUT.lock`; a sidecar `OUT.meta.json` shares its data file's lock."""
    out = Path(out)
    name = out.name
    if name.endswith(".meta.json") and name != ".meta.json":
        name = name[: -len(".meta.json")]
    return out.with_name(f"{name}.lock")


_HELD: dict[str, list] = {}  # lock file → [fd, holders in this process]


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
                same = _key(os.fstat(fd)) == _key(os.stat(self.path))
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


def _tmp_name(path: Path) -> Path:
    return path.with_name(f"{path.name}.tmp-{os.getpid()}")


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


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
        if pid.isdigit() and int(pid) != os.getpid() and not _running(int(pid)):
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

    def _open_output(self, path: Path) -> None:
        check_writable(path)
        check_not_input(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._lock = OutputLock(path).__enter__()
        except OSError as e:
            raise BadInput(f"{path}: cannot write here ({e.strerror or e})") from None
        self._keys = _out_keys(path)
        for k in self._keys:
            _WRITING[k] = str(path)

    def _close_output(self, failed: bool) -> None:
        for k in self._keys:
            _WRITING.pop(k, None)
        self._lock.__exit__(None, None, None)
        if failed:
            forget_inputs()  # the stage is over


class AtomicFile(_Output):
    """Write bytes to `PATH.tmp-PID`; rename onto PATH on clean exit, delete on error (a full
    disk while closing included). `replaces_input=True` is for a stage that rewrites its own
    input in place (eval --rescore): the new file replaces the old one only at the end."""

    def __init__(self, path: str | Path, mode: str = "wb", replaces_input: bool = False) -> None:
        self.path = Path(path)
        self.tmp = _tmp_name(self.path)
        self.mode = mode
        self.replaces_input = replaces_input

    def __enter__(self):
        if self.replaces_input and self.path.is_file():
            _INPUTS.pop(_key(os.stat(self.path)), None)
        self._open_output(self.path)
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

    def __init__(self, path: str, key: str = "id") -> None:
        if path == "-":
            raise BadInput("-o -: resumable stages need an output file, not stdout")
        self.path = Path(path)
        self.key = key
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
                    self.ids.add(orjson.loads(line)[self.key])
                except (orjson.JSONDecodeError, KeyError, TypeError):
                    raise BadInput(
                        f"{self.path}:{n}: {self.key}: existing output is not a "
                        "record of this stage — move it away or pick another -o") from None

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


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_sidecar(out: str, *, stage: str, seed: int | None = None, config: dict | None = None,
                  inputs: list[str] | tuple[str, ...] = (), stats: dict | None = None,
                  started: float | None = None) -> None:
    """Write `OUT.meta.json`: provenance and statistics, the inputs' hashes as they were read
    (`input_sha256`). Skipped when OUT is stdout. Ends the stage's memory of its inputs."""
    if out == "-":
        forget_inputs()
        return
    hashes = {p: input_sha256(p) for p in inputs}
    meta = {
        "v": SCHEMA_VERSION,
        "stage": stage,
        "command": sys.argv,
        "marscli": __version__,
        "seed": seed,
        "config": config or {},
        "inputs": {p: h for p, h in hashes.items() if h is not None},
        "wall_s": round(time.time() - started, 3) if started else None,
        "stats": stats or {},
    }
    try:
        with AtomicFile(f"{out}.meta.json") as fh:
            fh.write(orjson.dumps(redact(meta),
                                  option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
    finally:
        forget_inputs()
