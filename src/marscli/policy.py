"""Loading a policy checkpoint (HF format folder or hub id) with clear errors for bad ones."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from marscli.errors import BadInput, RuntimeFailure

DEFAULT_POLICY = "sensenova/SenseNova-MARS-8B"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def check_checkpoint(path: str, option: str = "--policy") -> str:
    """Validate a local checkpoint folder (or accept a hub id); return what to load."""
    p = Path(path)
    if not p.exists():
        if _HUB_ID.match(path) and not path.startswith("."):
            return path  # a hub id: transformers resolves (and, with a network, downloads) it
        raise BadInput(f"{option}: {path}: no such checkpoint folder")
    if not p.is_dir():
        raise BadInput(f"{option}: {path}: expected a checkpoint folder (config.json, "
                       "*.safetensors, tokenizer, processor)")
    if not (p / "config.json").is_file():
        raise BadInput(f"{option}: {path}: checkpoint folder has no config.json")
    for f in p.glob("*.safetensors"):
        _check_safetensors(f, option)
    return str(p)


def _check_safetensors(f: Path, option: str) -> None:
    """A truncated shard fails here with its name, not deep inside from_pretrained."""
    import json
    import struct

    size = f.stat().st_size
    try:
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
    except (struct.error, ValueError, UnicodeDecodeError):
        raise BadInput(f"{option}: {f}: not a valid safetensors file (bad header)") from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise BadInput(f"{option}: {f}: truncated safetensors file ({size} bytes, header "
                       f"promises {8 + n + end})")


def load_processor(path: str) -> Any:
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(path)
    except OSError as e:
        raise BadInput(f"--policy: {path}: cannot load the processor ({e})") from None


def load_model(path: str, device: str = "cpu", dtype: str | None = None) -> Any:
    """`AutoModelForImageTextToText` in eval mode; fp32 on CPU, bf16 on CUDA unless told."""
    import torch
    from transformers import AutoModelForImageTextToText

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise BadInput(f"--device {device}: CUDA is not available on this machine")
    dt = getattr(torch, dtype) if dtype else (torch.bfloat16 if device.startswith("cuda")
                                              else torch.float32)
    try:
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=dt)
    except OSError as e:
        raise BadInput(f"--policy: {path}: cannot load the model ({e})") from None
    except Exception as e:  # corrupt weights surface as many error types
        raise RuntimeFailure(
            f"--policy: {path}: loading failed ({type(e).__name__}: {e})"
        ) from None
    return model.to(device).eval()
