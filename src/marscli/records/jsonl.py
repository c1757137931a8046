"""Records as JSONL lines: reading them, following a file being written, writing one.

- `iter_rows(path)` yields `(line_number, dict)`; `-` is stdin. A line that is not a JSON object,
  carries a schema version other than 1, or is longer than `max_row_bytes()` (16 MiB;
  `MARSCLI_MAX_ROW_BYTES` overrides) raises `BadInput("FILE:LINE: ...")`; a long line is read
  only up to the limit, never whole. `read_rows(path)`: all of them, at least one.
- Every file read is remembered by the running stage (`provenance.Inputs`) with the sha256 of
  the bytes read, stdin's included: the sidecar records those hashes, and no output of the
  stage may be one of those files. A bad input ends the stage's memory.
- `follow_rows(path)` reads a file as another stage appends to it, until that stage's sidecar
  appears (`reward --follow`), watching that the file stays the one it opened (same inode,
  never shorter than what was read, the last bytes read still there). `iter_rows` refuses a
  file another process is still writing (it holds the file's lock: `locks.live_writer`).
- `dumps(row)`: one record as one line; `get_field(row, "a.b", type, ...)`: a field, checked,
  its errors naming FILE:LINE. Writing whole files is `records.outputs`.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson

from marscli.errors import BadInput, RuntimeFailure
from marscli.records.locks import refuse_live_writer, writer_alive
from marscli.records.provenance import current_inputs

SCHEMA_VERSION = 1
_DUMP_OPTS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE
MAX_ROW_BYTES = 16 << 20  # one JSONL line; a bigger one is refused (MARSCLI_MAX_ROW_BYTES)
# the last bytes a follower read, compared with the file at each poll: a file truncated and
# written again in place keeps its inode and may grow past what was read
FOLLOW_CHECK_BYTES = 4096
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


def iter_rows(path: str, on_torn: Callable[[int, bytes], None] | None = None
              ) -> Iterator[tuple[int, dict]]:
    """Yield `(line_number, row)` for each non-blank line of a JSONL file (`-`: stdin),
    hashing the bytes as they are read (module docstring). `on_torn(line, raw)`: what to do
    with a last line that has no newline and is not valid JSON (a killed writer's torn
    record) instead of refusing the file (`merge --allow-partial` drops it)."""
    path = str(path)
    limit = max_row_bytes()
    if path != "-":
        refuse_live_writer(path)
    fh = _open_in(path)
    inputs = current_inputs()
    entry = inputs.remember(path, fh) if fh is not sys.stdin.buffer else None
    h, size = hashlib.sha256(), 0
    try:
        for n, raw in enumerate(_lines(fh, path, limit), start=1):
            h.update(raw)
            size += len(raw)
            if not raw.strip():
                continue
            if on_torn is not None and not raw.endswith(b"\n"):
                try:
                    orjson.loads(raw)
                except orjson.JSONDecodeError:
                    on_torn(n, raw)
                    continue
            yield n, _parse(raw, path, n)
        if entry is not None:
            entry.sha256 = h.hexdigest()
        else:
            inputs.remember_stdin(h.hexdigest(), size)
    except BadInput:
        inputs.forget()  # a bad input ends the stage
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
    A torn last line that a resumed writer cuts off (AppendJsonl does) is dropped unread. A
    file replaced under its name (a new inode, or none), truncated below what was read, or
    rewritten in place (its last bytes read are others now) ends it with RuntimeFailure
    (`_same_file`): what was read is no longer that file."""
    from time import sleep

    p, sidecar = Path(path), Path(f"{path}.meta.json")
    limit = max_row_bytes()
    writer_gone = _writer_watch(p, grace_s)
    _await_file(path, writer_gone, poll_s)
    fh = _open_in(path)
    inputs = current_inputs()
    entry = inputs.remember(path, fh)
    h, n, done = hashlib.sha256(), 0, 0  # `done`: the offset after the last complete line
    last = b""  # the bytes before `done`, up to FOLLOW_CHECK_BYTES of them
    try:
        while True:
            finished = sidecar.exists()  # before the read: all it covers is read below
            _same_file(path, fh, done, last)  # after it: a sidecar seen is this file's
            lines, tail, last = _read_on(fh, done, last)
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
                h.update(tail)  # the hash covers every byte read, a blank tail included
                if tail.strip():  # a last line without its newline: whole, or BadInput
                    yield n + 1, _parse(tail, path, n + 1)
                break
            if writer_gone():
                raise RuntimeFailure(f"{path}: its writer stopped without writing "
                                     f"{sidecar.name} (it failed or was killed) — re-run it; "
                                     f"{n} lines were read")
            sleep(poll_s)
        entry.sha256 = h.hexdigest()
    except BadInput:
        inputs.forget()  # a bad input ends the stage
        raise
    finally:
        fh.close()


def _writer_watch(p: Path, grace_s: float) -> Callable[[], bool]:
    """A check, called at each poll, whether the writer of `p` is gone: no live process has
    held its lock for over `grace_s` seconds. Not at the first poll that finds none: a writer
    that has not yet written its lock file reads as not alive."""
    from time import monotonic

    dead_since: float | None = None

    def writer_gone() -> bool:
        nonlocal dead_since
        if writer_alive(p):
            dead_since = None
            return False
        dead_since = dead_since or monotonic()
        return monotonic() - dead_since > grace_s

    return writer_gone


def _await_file(path: str, writer_gone: Callable[[], bool], poll_s: float) -> None:
    """Return once `path` exists; RuntimeFailure if its writer is gone before it does."""
    from time import sleep

    while not Path(path).exists():
        if writer_gone():
            raise RuntimeFailure(f"{path}: never appeared, and nothing is writing it — start the "
                                 "stage that writes it (rollout) first, or drop --follow")
        sleep(poll_s)


def _read_on(fh: Any, done: int, last: bytes) -> tuple[list[bytes], bytes, bytes]:
    """The complete lines written after offset `done`, the unfinished tail after them, and
    `last` moved on to end where those complete lines end."""
    fh.seek(done)  # an unfinished last line is read again: a resumed writer may cut it
    data = fh.read()
    *lines, tail = data.split(b"\n")
    return lines, tail, (last + data[: len(data) - len(tail)])[-FOLLOW_CHECK_BYTES:]


def _same_file(path: str, fh: Any, done: int, last: bytes) -> None:
    """RuntimeFailure when the file being followed is no longer the one read: its name leads
    to another file (replaced, e.g. by `rollout --force`) or to none, it shrank below what
    was read (truncated in place), or the `last` bytes read before `done` are others now
    (truncated and written again in place: same inode, as long or longer). A torn tail cut by
    a resumed writer shrinks it to `done` at least, which is fine."""
    mine = os.fstat(fh.fileno())
    try:
        now = os.stat(path)
    except FileNotFoundError:
        now = None
    if now is None or (now.st_dev, now.st_ino) != (mine.st_dev, mine.st_ino):
        raise RuntimeFailure(f"{path}: was replaced or removed while being followed (another "
                             "run started over?) — the rows read are not that file's; re-run "
                             "reward once its writer has finished")
    if mine.st_size < done:
        raise RuntimeFailure(f"{path}: shrank from {done} to {mine.st_size} bytes while being "
                             "followed (truncated in place) — rows already read are gone from "
                             "it; re-run reward once its writer has finished")
    if os.pread(fh.fileno(), len(last), done - len(last)) != last:
        raise RuntimeFailure(f"{path}: was rewritten in place while being followed (its bytes "
                             f"before offset {done} changed) — the rows read are not that "
                             "file's; re-run reward once its writer has finished")


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


