"""`marscli env`: versions for bug reports. Each import is tried, never required."""

from __future__ import annotations

import importlib
import platform

from marscli import __version__


def _version(mod: str) -> str:
    try:
        return getattr(importlib.import_module(mod), "__version__", "installed")
    except Exception as e:  # any import failure is worth reporting as such
        return f"not available ({type(e).__name__})"


def describe() -> dict[str, str]:
    info = {"marscli": __version__, "python": platform.python_version(),
            "platform": platform.platform()}
    for mod in ("torch", "torchvision", "transformers", "vllm", "deepspeed", "tokenizers"):
        info[mod] = _version(mod)
    try:
        import torch

        info["cuda"] = (f"{torch.version.cuda} ({torch.cuda.device_count()} devices)"
                        if torch.cuda.is_available() else "not available")
    except Exception:
        info["cuda"] = "unknown"
    return info
