"""What an output was made from: the inputs one stage read, remembered and hashed.

- `Inputs`: one stage's memory. Every input file `iter_rows` or `follow_rows` opens is
  remembered (by device and inode) with the sha256 of the bytes read, stdin's included, and
  every writer (`records.outputs`) refuses an output that is one of them (the same file, a hard
  link or a symlink to it; for `AtomicDir`, a folder holding one): `BadInput`, before anything
  is written. An input opened while it is being written (`merge OUT ... OUT`) is refused the
  same way. Inputs read another way (a corpus the indexer reads, images, a checkpoint folder,
  a system prompt) are remembered with `note_inputs`, by each stage before its first output.
- `stage_inputs()` gives each stage its own memory: `with stage_inputs():` (app.guard, around
  every command) or `@stage_inputs()` on a stage's run function, so that a Python caller of a
  stage is protected as a command is, and two stages never see each other's inputs. A scope
  opened inside another is the same scope (a command calling a stage function is one stage).
  Outside any scope nothing is remembered. Within one, the memory also ends where the stage
  does: `sidecar.write_sidecar`, a writer that fails, a bad input.
- The sidecar `OUT.meta.json` (`records.sidecar`) records the inputs' hashes as they were read
  (`Inputs.sha256`), and ends the stage's memory.
- `sha256_file(path)`: the hash of a file as it is now.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from marscli.errors import BadInput

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


class Inputs:
    """What one stage read (`files`, by inode; `stdin_sha256`) and which outputs it has open
    (`writing`, by inode and resolved name), so that the two never meet (module docstring)."""

    def __init__(self) -> None:
        self.files: dict[tuple[int, int], Input] = {}
        self.paths: dict[str, Input] = {}  # the same entries by absolute name (Inputs.sha256)
        self.stdin_sha256: str | None = None
        self.writing: dict[Key, str] = {}

    def forget(self) -> None:
        """The stage is over (its sidecar is written, or it failed): what it read no longer
        binds what comes after. Its open outputs stay open until they close."""
        self.files.clear()
        self.paths.clear()
        self.stdin_sha256 = None

    def remember(self, path: str, fh: Any) -> Input:
        """Remember an input file just opened as `fh`; BadInput (closing `fh`) when it is an
        output this stage is writing."""
        try:
            return self._enter(path, os.fstat(fh.fileno()))
        except BadInput:
            fh.close()
            raise

    def note(self, path: str | Path) -> None:
        """Remember an input the stage reads other than through `jsonl`'s readers (a corpus
        the indexer reads, images, a checkpoint folder, a system prompt); a folder counts as
        a whole (`check_no_input_inside`). Nothing for a path not there."""
        if os.path.abspath(path) in self.paths:
            return
        try:
            st = os.stat(path)
        except (OSError, ValueError):
            return
        self._enter(str(path), st)

    def _enter(self, path: str, st: os.stat_result) -> Input:
        for k in (inode(st), str(Path(path).resolve())):
            if k in self.writing:
                self.forget()  # the stage ends here
                raise BadInput(f"{path}: is the output being written ({self.writing[k]}) — an "
                               "output cannot be one of the inputs: pick another output")
        entry = Input(path)
        self.files[inode(st)] = entry
        self.paths[os.path.abspath(path)] = entry
        return entry

    def remember_stdin(self, sha256: str, size: int) -> None:
        """stdin was read to the end; a second read of a drained stdin keeps the first hash."""
        if size or self.stdin_sha256 is None:
            self.stdin_sha256 = sha256

    def drop(self, path: str | Path) -> None:
        """`path` is no longer an input: the stage replaces it in place (eval --rescore)."""
        if Path(path).is_file():
            self.files.pop(inode(os.stat(path)), None)
        self.paths.pop(os.path.abspath(path), None)

    def sha256(self, path: str) -> str | None:
        """sha256 of the bytes of an input as it was read (`-`: stdin) — what the output was
        made from, even if the file changed since — or of the file now when it was not read
        that way (a system prompt, a text file); None when there is nothing to hash. A file
        replaced at its name after it was read is still the file read: its name finds it."""
        if path == "-":
            return self.stdin_sha256
        read = self.paths.get(os.path.abspath(path))
        if read is not None and read.sha256:
            return read.sha256
        try:
            st = os.stat(path)
        except OSError:
            return None
        if not Path(path).is_file():
            return None
        entry = self.files.get(inode(st))
        if entry is not None and entry.sha256:
            return entry.sha256
        return sha256_file(path)

    def check_not_input(self, path: str | Path) -> None:
        """Refuse an output file that is an input of this stage (same inode: the same file, a
        hard link or a symlink to it), before anything is written."""
        try:
            st = os.stat(path)
        except OSError:
            return
        entry = self.files.get(inode(st))
        if entry is not None:
            self.forget()  # the stage ends here
            same = "" if os.path.abspath(entry.path) == os.path.abspath(path) else \
                f" (as {entry.path})"
            raise BadInput(f"{path}: is an input of this stage{same} — writing it would "
                           "clobber what is being read: pick another output")

    def check_no_input_inside(self, folder: str | Path) -> None:
        """Refuse an output folder that holds an input of this stage (replacing it would
        delete the input)."""
        root = Path(folder).resolve()
        for entry in self.files.values():
            p = Path(entry.path).resolve()
            if p == root:
                self.forget()  # the stage ends here
                raise BadInput(f"{folder}: is an input of this stage — replacing it would "
                               "delete what is being read: pick another output folder")
            if root in p.parents:
                self.forget()  # the stage ends here
                raise BadInput(f"{folder}: holds {entry.path}, an input of this stage — "
                               "replacing the folder would delete it: pick another output folder")

    def open_output(self, path: Path) -> list[Key]:
        """`path` is being written: no input may be it until `close_output(keys)`."""
        keys: list[Key] = [str(path.resolve())]
        try:
            keys.append(inode(os.stat(path)))
        except OSError:
            pass
        for k in keys:
            self.writing[k] = str(path)
        return keys

    def close_output(self, keys: list[Key]) -> None:
        for k in keys:
            self.writing.pop(k, None)


# The stage running in this context; None outside any (a thread a stage starts does not see
# it: contextvars are per thread, and no stage reads or writes records off its main thread).
_STAGE: ContextVar[Inputs | None] = ContextVar("marscli_stage_inputs", default=None)


@contextmanager
def stage_inputs() -> Iterator[Inputs]:
    """The scope of one stage's `Inputs`: a new one, or the one already open (module
    docstring). Also a decorator: `@stage_inputs()` on a stage's run function."""
    outer = _STAGE.get()
    if outer is not None:
        yield outer
        return
    inputs = Inputs()
    token = _STAGE.set(inputs)
    try:
        yield inputs
    finally:
        _STAGE.reset(token)


def current_inputs() -> Inputs:
    """The running stage's `Inputs`; outside any stage, an empty one nothing else will see."""
    return _STAGE.get() or Inputs()


def check_not_input(path: str | Path) -> None:
    """`Inputs.check_not_input` of the running stage: for a writer of its own (an SQLite
    index, a metrics file) before it takes the output's lock."""
    current_inputs().check_not_input(path)


def check_no_input_inside(folder: str | Path) -> None:
    """`Inputs.check_no_input_inside` of the running stage: a folder output checked before
    the work that fills it (`AtomicDir` checks again when it opens)."""
    current_inputs().check_no_input_inside(folder)


def note_inputs(*paths: str | Path | None, files_in_folders: bool = False) -> None:
    """Remember, for the running stage, inputs read other than through `jsonl`'s readers (the
    records readers remember theirs): every writer then refuses them as outputs, and a folder
    output refuses to replace a folder holding one. `None`, `-` and paths not there are
    skipped. `files_in_folders`: a folder's own files count one by one too (a checkpoint: an
    output file may not be its config.json)."""
    inputs = current_inputs()
    for p in paths:
        if p is None or str(p) in ("", "-"):
            continue
        inputs.note(p)
        if files_in_folders and os.path.isdir(p):
            for f in sorted(Path(p).iterdir()):
                if f.is_file():
                    inputs.note(f)


# ------------------------------------------------------------------ checkpoint fingerprints

WEIGHT_FILES = ("*.safetensors", "*.bin")
# Every file besides the weights that decides the tokens a checkpoint samples: the model's
# config, generation defaults, the processor (image resolution → image tokens), the tokenizer
# and the chat template (transformers 4 and 5 names alike).
TOKEN_FILES = ("config.json", "generation_config.json", "preprocessor_config.json",
               "processor_config.json", "video_preprocessor_config.json", "tokenizer.json",
               "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
               "added_tokens.json", "chat_template.json", "chat_template.jinja")
_WHOLE = 32 << 20  # weight files up to this are hashed whole; larger ones by samples
_BLOCKS, _BLOCK = 32, 128 << 10  # 32 evenly spaced 128 KiB samples: 4 MiB a file


def weights_fingerprint(policy: str | None) -> str | None:
    """A cheap sha256 of everything in a checkpoint folder that decides its tokens: the
    `TOKEN_FILES` present (config, processor, tokenizer, chat template) and each weight file's
    name, size and content (whole up to 32 MiB, else 32 evenly spaced 128 KiB blocks, so an 8B
    checkpoint costs ~16 MiB of reads: an RL update changes every block of a tensor it
    trains). None for a hub id or a served model (the name is all there is)."""
    if not policy or not Path(policy).is_dir():
        return None
    root = Path(policy)
    h = hashlib.sha256()
    files = sorted({f for pat in WEIGHT_FILES for f in root.glob(pat)})
    for f in [*(root / name for name in TOKEN_FILES), *files]:
        if not f.is_file():
            continue
        size = f.stat().st_size
        h.update(f"{f.name}\0{size}\0".encode())
        with f.open("rb") as fh:
            if size <= _WHOLE:
                h.update(fh.read())
                continue
            for i in range(_BLOCKS):
                fh.seek((size - _BLOCK) * i // (_BLOCKS - 1))
                h.update(fh.read(_BLOCK))
    return h.hexdigest()
