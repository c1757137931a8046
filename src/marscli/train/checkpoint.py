"""HF checkpoints: the folder an --out names, and the weights written into it.

- `check_out` refuses an --out that exists (without --force) or is one of the input
  checkpoints; first it finishes a replace a kill interrupted (`outputs.recover_replaced`).
  (`outputs.find_replaced` does so for a checkpoint read: `--policy`.)
  The folder itself is built by `records.outputs.AtomicDir`.
- `errors.save_errors(path)` around every writer: a full disk seen by torch.save (a RuntimeError
  from inline_container.cc) or safetensors (an "os error N" message) becomes one line.
- `WeightShards` writes the weights as they are gathered, parameter by parameter, into
  safetensors shards of at most 5 GB (and their index, as transformers names them), so the
  rank that saves holds one parameter at a time, never the whole model.
- `save_checkpoint` writes the config in the `--save-dtype` and copies the policy's tokenizer,
  processor and chat-template files, so transformers and vLLM load the folder as is.
Only the writers import torch (inside them).
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from marscli.errors import BadInput, save_errors
from marscli.records.outputs import recover_replaced, usual_modes

# --save-dtype: auto is bfloat16 on CUDA (what engines run there), float32 on CPU; input: the
# policy's own
SAVE_DTYPES = ("auto", "float32", "bfloat16", "input")
_WEIGHTS = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".pth")
_NOT_COPIED = {"config.json", "metrics.jsonl", "marscli.meta.json", "optimizer.pt"}


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


SHARD_BYTES = 5_000_000_000  # transformers' "5GB": vLLM and from_pretrained read any split
_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


class WeightShards:
    """The HF weights of `specs` (name, shape, in the order `put` will receive them) in `dtype`,
    written into `folder` as they arrive: each shard's header first (every name and shape is
    known before the first gather), then each tensor's bytes. One shard is
    `model.safetensors`; several are `model-0000K-of-0000N.safetensors` with
    `model.safetensors.index.json`, transformers' layout. Holding the whole export on rank 0
    would cost 2 bytes a parameter (17.5 GB at 8B, 67 GB at 32B) before the first byte is
    written; safetensors' own `save_file` would copy it once more."""

    def __init__(self, folder: Path, specs: Sequence[tuple[str, list[int]]], dtype: str,
                 max_bytes: int = SHARD_BYTES) -> None:
        import torch

        self.folder, self.dtype, self.width = folder, getattr(torch, dtype), _width(dtype)
        self.code = _ST_DTYPES[dtype]
        self.files: list[list[tuple[str, list[int]]]] = [[]]
        size = 0
        for name, shape in specs:
            n = self.width * _numel(shape)
            if self.files[-1] and size + n > max_bytes:
                self.files.append([])
                size = 0
            self.files[-1].append((name, list(shape)))
            size += n
        self.order = [name for f in self.files for name, _ in f]
        self.at = 0
        self.out: Any = None
        folder.mkdir(parents=True, exist_ok=True)

    def name(self, k: int) -> str:
        n = len(self.files)
        return "model.safetensors" if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors"

    def put(self, name: str, tensor: Any) -> None:
        """The next tensor (a bug if it is not the next name or its shape differs)."""
        if self.at >= len(self.order) or name != self.order[self.at]:
            raise RuntimeError(f"export: got {name}, expected "
                               f"{self.order[self.at] if self.at < len(self.order) else 'no more'}")
        k, shape = self._where(self.at)
        if list(tensor.shape) != shape:
            raise RuntimeError(f"export: {name} has shape {list(tensor.shape)}, planned {shape}")
        if self.out is None:
            # open across puts: closed when the shard's last tensor is written
            self.out = open(self.folder / self.name(k), "wb")  # noqa: SIM115
            self.out.write(self._header(k))
        import torch

        flat = tensor.detach().reshape(-1).to("cpu", self.dtype).contiguous()
        self.out.write(flat.view(torch.uint8).numpy().data)
        self.at += 1
        if self.at == len(self.order) or self._where(self.at)[0] != k:
            self.out.close()
            self.out = None

    def close(self) -> None:
        """Check that every planned tensor came; write the index of a split export."""
        if self.at != len(self.order):
            raise RuntimeError(f"export: {len(self.order) - self.at} tensors never came")
        if len(self.files) > 1:
            index = {"metadata": {"total_size": sum(self.width * _numel(s) for f in self.files
                                                    for _, s in f)},
                     "weight_map": {n: self.name(k) for k, f in enumerate(self.files)
                                    for n, _ in f}}
            (self.folder / "model.safetensors.index.json").write_text(
                json.dumps(index, indent=2, sort_keys=True) + "\n")

    def _where(self, i: int) -> tuple[int, list[int]]:
        for k, f in enumerate(self.files):
            if i < len(f):
                return k, f[i][1]
            i -= len(f)
        raise IndexError(i)

    def _header(self, k: int) -> bytes:
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        at = 0
        for name, shape in self.files[k]:
            n = self.width * _numel(shape)
            header[name] = {"dtype": self.code, "shape": shape, "data_offsets": [at, at + n]}
            at += n
        head = json.dumps(header, separators=(",", ":")).encode()
        head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned, as safetensors writes
        return struct.pack("<Q", len(head)) + head


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _width(dtype: str) -> int:
    if dtype not in _ST_DTYPES:
        raise BadInput(f"--save-dtype: {dtype!r} — choose auto, float32, bfloat16 or input")
    return 4 if dtype == "float32" else 2


def save_checkpoint(lm: Any, folder: Path, policy: str, dtype: str = "float32",
                    processor: Any = None) -> None:
    """Write everything of the HF checkpoint of `lm` but its weights (`WeightShards` writes
    those) into `folder`: the config and generation config, as `save_pretrained` writes them,
    in `dtype`; then the policy's tokenizer/processor/chat-template files, so that
    AutoProcessor and vLLM load it."""
    import torch

    lm.config.dtype = getattr(torch, dtype)
    lm.config.architectures = [type(lm).__name__]
    with save_errors(folder):
        folder.mkdir(parents=True, exist_ok=True)
        lm.config.save_pretrained(folder)
        if lm.can_generate() and getattr(lm, "generation_config", None) is not None:
            lm.generation_config.save_pretrained(folder)
    usual_modes(folder)  # transformers writes shards 0600
    src = Path(policy)
    if src.is_dir():
        for f in sorted(src.iterdir()):
            if (f.is_file() and f.name not in _NOT_COPIED and not f.name.endswith(_WEIGHTS)
                    and not (folder / f.name).exists()):
                shutil.copy2(f, folder / f.name)
    elif processor is not None:
        processor.save_pretrained(folder)
