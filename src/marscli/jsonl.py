"""Streaming JSONL in and out, the way every stage does it.

- `iter_rows(path)` yields `(line_number, dict)`; `-` is stdin. A line that is not a JSON object,
  or carries a schema version other than 1, raises `BadInput("FILE:LINE: ...")`.
- `AtomicJsonl(path)` writes to `PATH.tmp-PID` and renames on success, so a failed stage leaves
  no partial file (and a pre-existing file untouched). For `-` it buffers and prints on success.
- `AppendJsonl(path)` is for resumable stages: one complete record per `write()`, a torn last
  line (from kill -9) is cut off on open, and `ids` lists what is already there.
- `write_sidecar(path, ...)` writes `PATH.meta.json` last.
- `remove_stale_tmp(path)` removes the `PATH.tmp-PID` of killed runs (kill -9 runs no cleanup);
  `AtomicFile` calls it before writing, so a re-run after a kill leaves no temporary behind.
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import orjson

from marscli import __version__
from marscli.errors import BadInput
from marscli.secrets import redact

SCHEMA_VERSION = 1
_DUMP_OPTS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE


def dumps(row: dict) -> bytes:
    """One record as one JSONL line (newline included)."""
    return orjson.dumps(row, option=_DUMP_OPTS)


def _open_in(path: str):
    if path == "-":
        return sys.stdin.buffer
    p = Path(path)
    if not p.exists():
        raise BadInput(f"{path}: no such file")
    if p.is_dir():
        raise BadInput(f"{path}: is a folder, expected a JSONL file")
    return p.open("rb")


def iter_rows(path: str) -> Iterator[tuple[int, dict]]:
    """Yield `(line_number, row)` for each non-blank line of a JSONL file (`-`: stdin)."""
    fh = _open_in(str(path))
    try:
        for n, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            try:
                row = orjson.loads(raw)
            except orjson.JSONDecodeError as e:
                torn = "" if raw.endswith(b"\n") else " (truncated last line?)"
                raise BadInput(f"{path}:{n}: not valid JSON{torn}: {e}") from None
            if not isinstance(row, dict):
                raise BadInput(f"{path}:{n}: expected a JSON object, got {type(row).__name__}")
            v = row.get("v", SCHEMA_VERSION)
            if v != SCHEMA_VERSION:
                raise BadInput(
                    f"{path}:{n}: v: unknown schema version {v!r} — this marscli reads v=1 records"
                )
            yield n, row
    finally:
        if fh is not sys.stdin.buffer:
            fh.close()


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


def check_writable(path: Path) -> None:
    """An output path must not be a folder (a rename onto it, or an append, would fail late)."""
    if path.is_dir():
        raise BadInput(f"{path}: is a folder — name a file to write")


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


def remove_stale_tmp(path: str | Path) -> None:
    """Remove the `PATH.tmp-PID` files and folders of killed runs (kill -9 skips every cleanup):
    those whose PID no longer runs on this machine. Called before writing PATH again, so a
    re-run after a kill leaves no temporary behind."""
    path = Path(path)
    for p in path.parent.glob(f"{glob.escape(path.name)}.tmp-*"):
        pid = p.name[len(path.name) + len(".tmp-"):]
        if not pid.isdigit() or int(pid) == os.getpid() or _running(int(pid)):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


class AtomicFile:
    """Write bytes to `PATH.tmp-PID`; rename onto PATH on clean exit, delete on error."""

    def __init__(self, path: str | Path, mode: str = "wb") -> None:
        self.path = Path(path)
        self.tmp = _tmp_name(self.path)
        self.mode = mode

    def __enter__(self):
        check_writable(self.path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            remove_stale_tmp(self.path)
            self.fh = self.tmp.open(self.mode)
        except OSError as e:
            raise BadInput(f"{self.path}: cannot write here ({e.strerror or e})") from None
        return self.fh

    def __exit__(self, exc_type, exc, tb) -> None:
        self.fh.close()
        if exc_type is None:
            os.replace(self.tmp, self.path)
        else:
            self.tmp.unlink(missing_ok=True)


class AtomicJsonl:
    """All-or-nothing JSONL output. `-` buffers in memory and prints on success."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.count = 0

    def __enter__(self) -> AtomicJsonl:
        self._buf: list[bytes] | None = [] if self.path == "-" else None
        if self._buf is None:
            self._atomic = AtomicFile(self.path)
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


class AppendJsonl:
    """Append-only output for resumable stages (rollout, eval).

    Each record goes out in one `write()` and is flushed, so a kill leaves at most one torn
    last line; opening cuts that torn tail, and `ids` holds the ids already complete.
    """

    def __init__(self, path: str, key: str = "id") -> None:
        if path == "-":
            raise BadInput("-o -: resumable stages need an output file, not stdout")
        self.path = Path(path)
        self.key = key
        self.ids: set[str] = set()
        self.count = 0

    def __enter__(self) -> AppendJsonl:
        check_writable(self.path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise BadInput(f"{self.path}: cannot write here ({e.strerror or e})") from None
        if self.path.exists():
            self._repair_and_scan()
        self._fh = self.path.open("ab")
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
        self._fh.write(dumps(row))
        self._fh.flush()
        self.ids.add(row[self.key])
        self.count += 1

    def __exit__(self, exc_type, exc, tb) -> None:
        self._fh.close()


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_sidecar(out: str, *, stage: str, seed: int | None = None, config: dict | None = None,
                  inputs: list[str] | tuple[str, ...] = (), stats: dict | None = None,
                  started: float | None = None) -> None:
    """Write `OUT.meta.json`: provenance and statistics. Skipped when OUT is stdout."""
    if out == "-":
        return
    meta = {
        "v": SCHEMA_VERSION,
        "stage": stage,
        "command": sys.argv,
        "marscli": __version__,
        "seed": seed,
        "config": config or {},
        "inputs": {p: sha256_file(p) for p in inputs if p != "-" and Path(p).is_file()},
        "wall_s": round(time.time() - started, 3) if started else None,
        "stats": stats or {},
    }
    with AtomicFile(f"{out}.meta.json") as fh:
        fh.write(orjson.dumps(redact(meta),
                              option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
