"""Folders written atomically, and HF checkpoints written into them.

- `AtomicDir(OUT)`: build the folder as `OUT.tmp-PID`, rename it onto OUT on success (an existing
  OUT goes only once the new one is complete), remove it on error. Every stage that writes a
  folder uses it: `update`, `sft` (and its resumable `OUT.partial/`), `tiny-model`, `toy-world`.
- `check_out` refuses an --out that exists (without --force) or is one of the inputs.
- `save_checkpoint` writes safetensors + config in the `--save-dtype` and copies the policy's
  tokenizer, processor and chat-template files, so transformers and vLLM load the folder as is.
Only `save_checkpoint` imports torch (inside it).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Self

from marscli.errors import BadInput
from marscli.jsonl import remove_stale_tmp

# --save-dtype: auto is bfloat16 on CUDA (what engines run there), float32 on CPU; input: the
# policy's own
SAVE_DTYPES = ("auto", "float32", "bfloat16", "input")
_WEIGHTS = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".pth")
_NOT_COPIED = {"config.json", "metrics.jsonl", "marscli.meta.json", "optimizer.pt"}


class AtomicDir:
    """Build a folder in `OUT.tmp-PID` (or `tmp`, a name every rank can compute); on success
    rename it onto OUT, replacing an existing OUT only once the new one is complete; on error
    remove it. Inactive (no folder at all) where `active` is false (ranks other than 0)."""

    def __init__(self, out: str | Path, active: bool = True, tmp: str | Path | None = None) -> None:
        self.out, self.active = Path(out), active
        self.tmp = Path(tmp) if tmp is not None else self.out.with_name(
            f"{self.out.name}.tmp-{os.getpid()}")

    def __enter__(self) -> Self:
        if self.active:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            remove_stale_tmp(self.out)  # what a killed run left
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp.mkdir()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.active:
            return
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        old = None
        if self.out.exists():
            old = self.out.with_name(f"{self.out.name}.old-{os.getpid()}")
            os.replace(self.out, old)
        os.replace(self.tmp, self.out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def check_out(out: str, force: bool, *inputs: str) -> None:
    """Refuse an existing OUT without --force, and an OUT that is one of the inputs."""
    p = Path(out)
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
    lm.save_pretrained(folder, state_dict=sd, max_shard_size="5GB")
    umask = os.umask(0)
    os.umask(umask)
    for f in folder.iterdir():  # transformers writes shards 0600; make them as readable as any file
        if f.is_file():
            f.chmod(0o666 & ~umask)
    src = Path(policy)
    if src.is_dir():
        for f in sorted(src.iterdir()):
            if (f.is_file() and f.name not in _NOT_COPIED and not f.name.endswith(_WEIGHTS)
                    and not (folder / f.name).exists()):
                shutil.copy2(f, folder / f.name)
    elif processor is not None:
        processor.save_pretrained(folder)
