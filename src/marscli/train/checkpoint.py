"""HF checkpoints: the folder an --out names, and the weights written into it.

- `check_out` refuses an --out that exists (without --force) or is one of the input
  checkpoints; first it finishes a replace a kill interrupted (`outputs.recover_replaced`).
  The folder itself is built by `records.outputs.AtomicDir`.
- `save_errors(path)`: a full disk seen by torch.save (a RuntimeError from inline_container.cc)
  or safetensors (an "os error N" message) becomes the one-line error of errors.save_error.
- `save_checkpoint` writes safetensors + config in the `--save-dtype` and copies the policy's
  tokenizer, processor and chat-template files, so transformers and vLLM load the folder as is.
Only `save_checkpoint` imports torch (inside it).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from marscli.errors import BadInput, MarsError, save_error
from marscli.records.outputs import recover_replaced, usual_modes

# --save-dtype: auto is bfloat16 on CUDA (what engines run there), float32 on CPU; input: the
# policy's own
SAVE_DTYPES = ("auto", "float32", "bfloat16", "input")
_WEIGHTS = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".pth")
_NOT_COPIED = {"config.json", "metrics.jsonl", "marscli.meta.json", "optimizer.pt"}


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
