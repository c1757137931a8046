"""`marscli env`: versions for bug reports.

- Each import is tried, never required: a missing or broken package is reported as such.
- Imports run quietly: what a package logs or warns while importing (DeepSpeed logs "Setting
  accelerator to CPU" to stdout) is dropped, so stdout holds the `name: version` lines only.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import platform
import warnings
from collections.abc import Iterator

from marscli import __version__


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """No log record below ERROR and no warning while importing (restored afterwards)."""
    before = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(before)


def _version(mod: str) -> str:
    try:
        with _quiet():
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
