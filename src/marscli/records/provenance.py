"""What an output was made from: the inputs a stage read, and the sidecar that records them.

- Every input file `iter_rows` or `follow_rows` opens is remembered (`remember_input`, by
  device and inode) with the sha256 of the bytes read, stdin's included, and every writer
  (`records.outputs`) refuses an output that is one of them (`check_not_input`: the same file,
  a hard link or a symlink to it; `check_no_input_inside`, for `AtomicDir`: a folder holding
  one): `BadInput`, before anything is written. An input opened while it is being written
  (`merge OUT ... OUT`) is refused the same way. The memory ends with the stage:
  `write_sidecar`, a writer that fails, a bad input, and `forget_inputs()` clear it.
- `write_sidecar(OUT, ...)` writes `OUT.meta.json`, the stage's last file: provenance and
  statistics, with the inputs' hashes as they were read (`input_sha256`).
- `sha256_file(path)`: the hash of a file as it is now.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from marscli import __version__
from marscli.errors import BadInput
from marscli.secrets import redact

Key = tuple[int, int] | str  # (st_dev, st_ino), or a resolved path for a file not there yet


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def inode(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


@dataclass
class Input:
    """An input file as it was opened: its name and, once it was read to the end, the sha256
    of the bytes read."""

    path: str
    sha256: str | None = None


_INPUTS: dict[tuple[int, int], Input] = {}  # (st_dev, st_ino) → what was read
_STDIN: dict[str, str] = {}  # "sha256": of the bytes read from stdin
_WRITING: dict[Key, str] = {}  # open outputs: (dev, ino) or resolved path


def forget_inputs() -> None:
    """End of a stage: what it read no longer binds the next stage of this process."""
    _INPUTS.clear()
    _STDIN.clear()


def remember_input(path: str, fh: Any) -> Input:
    """Remember an input file just opened as `fh`; BadInput (closing `fh`) when it is an output
    being written."""
    st = os.fstat(fh.fileno())
    for k in (inode(st), str(Path(path).resolve())):
        if k in _WRITING:
            fh.close()
            forget_inputs()  # the stage ends here
            raise BadInput(f"{path}: is the output being written ({_WRITING[k]}) — an output "
                           "cannot be one of the inputs: pick another output")
    entry = Input(path)
    _INPUTS[inode(st)] = entry
    return entry


def remember_stdin(sha256: str, size: int) -> None:
    """stdin was read to the end; a second read of a drained stdin keeps the first hash."""
    if size or "sha256" not in _STDIN:
        _STDIN["sha256"] = sha256


def drop_input(path: str | Path) -> None:
    """`path` is no longer an input: the stage replaces it in place (eval --rescore)."""
    if Path(path).is_file():
        _INPUTS.pop(inode(os.stat(path)), None)


def input_sha256(path: str) -> str | None:
    """sha256 of the bytes of an input as it was read (`-`: stdin) — what the output was made
    from, even if the file changed since — or of the file now when it was not read that way
    (a system prompt, a text file); None when there is nothing to hash."""
    if path == "-":
        return _STDIN.get("sha256")
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not Path(path).is_file():
        return None
    entry = _INPUTS.get(inode(st))
    if entry is not None and entry.sha256:
        return entry.sha256
    return sha256_file(path)


def check_not_input(path: str | Path) -> None:
    """Refuse an output file that is an input of this stage (same inode: the same file, a hard
    link or a symlink to it), before anything is written."""
    try:
        st = os.stat(path)
    except OSError:
        return
    entry = _INPUTS.get(inode(st))
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


def open_output(path: Path) -> list[Key]:
    """`path` is being written: no input may be it until `close_output(keys)`."""
    keys: list[Key] = [str(path.resolve())]
    try:
        keys.append(inode(os.stat(path)))
    except OSError:
        pass
    for k in keys:
        _WRITING[k] = str(path)
    return keys


def close_output(keys: list[Key]) -> None:
    for k in keys:
        _WRITING.pop(k, None)


def write_sidecar(out: str, *, stage: str, seed: int | None = None, config: dict | None = None,
                  inputs: list[str] | tuple[str, ...] = (), stats: dict | None = None,
                  started: float | None = None) -> None:
    """Write `OUT.meta.json`: provenance and statistics, the inputs' hashes as they were read
    (`input_sha256`). Skipped when OUT is stdout. Ends the stage's memory of its inputs."""
    # jsonl and outputs import this module (their reads and writes are remembered here)
    from marscli.records.jsonl import SCHEMA_VERSION
    from marscli.records.outputs import AtomicFile

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
