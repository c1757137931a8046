"""Folders written atomically, and HF checkpoints written into them.

- `AtomicDir(OUT)`: build the folder as `OUT.tmp-PID`, rename it onto OUT on success (an existing
  OUT goes only once the new one is complete), remove it on error. Every stage that writes a
  folder uses it: `update`, `sft` (and its resumable `OUT.partial/`), `tiny-model`, `toy-world`.
  While open it holds `OUT.lock` (jsonl.OutputLock: a second writer fails at once naming the
  holder's pid), and it refuses an OUT that holds an input the stage read. Files and folders
  in it get the usual modes (0666/0777 less the umask: transformers and safetensors write 0600).
- A replace killed between its two renames leaves `OUT.old-PID` (and no OUT): the next
  `AtomicDir` or `check_out` on OUT puts it back when OUT is missing (the interrupted replace
  never happened) and removes it when OUT is there, once PID no longer runs.
- `check_out` refuses an --out that exists (without --force) or is one of the inputs.
- `save_errors(path)`: a full disk seen by torch.save (a RuntimeError from inline_container.cc)
  or safetensors (an "os error N" message) becomes the one-line error of errors.save_error.
- `save_checkpoint` writes safetensors + config in the `--save-dtype` and copies the policy's
  tokenizer, processor and chat-template files, so transformers and vLLM load the folder as is.
Only `save_checkpoint` imports torch (inside it).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Self

from marscli.errors import BadInput, MarsError, save_error
from marscli.records.jsonl import OutputLock, check_no_input_inside, remove_stale_tmp, stale

# --save-dtype: auto is bfloat16 on CUDA (what engines run there), float32 on CPU; input: the
# policy's own
SAVE_DTYPES = ("auto", "float32", "bfloat16", "input")
_WEIGHTS = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".pth")
_NOT_COPIED = {"config.json", "metrics.jsonl", "marscli.meta.json", "optimizer.pt"}


class AtomicDir:
    """Build a folder in `OUT.tmp-PID` (or `tmp`, a name every rank can compute); on success
    rename it onto OUT, replacing an existing OUT only once the new one is complete; on error
    remove it. Inactive (no folder, no lock) where `active` is false (ranks other than 0)."""

    def __init__(self, out: str | Path, active: bool = True, tmp: str | Path | None = None) -> None:
        self.out, self.active = Path(out), active
        self.tmp = Path(tmp) if tmp is not None else self.out.with_name(
            f"{self.out.name}.tmp-{os.getpid()}")

    def __enter__(self) -> Self:
        if not self.active:
            return self
        check_no_input_inside(self.out)
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
        os.replace(self.tmp, self.out)  # a kill before this line: recover_replaced
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


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


@contextmanager
def save_errors(path: str | Path) -> Iterator[None]:
    """Turn a full disk (or a file-size limit) that torch.save or safetensors report in their
    own words into the one-line error of `errors.save_error`; any other error stays as it is."""
    try:
        yield
    except MarsError:
        raise
    except Exception as e:
        err = save_error(e, path)
        if err is None:
            raise
        raise err from None


def check_out(out: str, force: bool, *inputs: str) -> None:
    """Refuse an existing OUT without --force, and an OUT that is one of the inputs."""
    p = Path(out)
    recover_replaced(p)
    for i in inputs:
        if i and Path(i).exists() and p.resolve() == Path(i).resolve():
            raise BadInput(f"--out: {out}: is an input checkpoint — write to a new folder")
    if p.exists() and not force:
        raise BadInput(f"--out: {out}: already exists — pick a new folder or pass --force")
    if p.exists() and not p.is_dir():
        raise BadInput(f"--out: {out}: exists and is not a folder")


def check_save_dtype(name: str) -> None:
    if name not in SAVE_DTYPES:
        raise BadInput(f"--save-dtype: {name!r} — choose auto, float32, bfloat16 or input")


def save_dtype_name(name: str, policy: str, device: str = "cpu") -> str:
    """The dtype to save in: `name`; for "auto" bfloat16 on CUDA, float32 elsewhere; for
    "input" the policy's own (float32 if it names none)."""
    if name == "auto":
        return "bfloat16" if device.startswith("cuda") else "float32"
    if name == "input":
        cfg_path = Path(policy) / "config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        name = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
        if name == "float16":
            return name
    check_save_dtype(name)
    return name


def save_checkpoint(lm: Any, state_dict: dict | None, folder: Path, policy: str,
                    dtype: str = "float32", processor: Any = None) -> None:
    """Write the HF checkpoint of `lm` (its config, `state_dict` as safetensors) into `folder`
    and copy the policy's tokenizer/processor/chat-template files so that AutoProcessor and
    vLLM load it. Nothing happens without a state dict (ranks other than 0)."""
    if state_dict is None:
        return
    import torch

    dt = getattr(torch, save_dtype_name(dtype, policy))  # "auto" is resolved by the caller
    sd = {k: (v.to(dt) if v.is_floating_point() else v) for k, v in state_dict.items()}
    lm.config.dtype = dt
    from marscli.qwen.policy import quiet_transformers

    with save_errors(folder), quiet_transformers():  # no "Writing model shards" bar in logs
        lm.save_pretrained(folder, state_dict=sd, max_shard_size="5GB")
    usual_modes(folder)  # transformers writes shards 0600
    src = Path(policy)
    if src.is_dir():
        for f in sorted(src.iterdir()):
            if (f.is_file() and f.name not in _NOT_COPIED and not f.name.endswith(_WEIGHTS)
                    and not (folder / f.name).exists()):
                shutil.copy2(f, folder / f.name)
    elif processor is not None:
        processor.save_pretrained(folder)
