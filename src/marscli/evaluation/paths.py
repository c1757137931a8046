"""Where an eval's files lie beside its results: the summary, and the decoded images."""

from __future__ import annotations

import os
from pathlib import Path


def summary_path(results: str | Path) -> Path:
    """`runs/eval.jsonl` → `runs/eval.summary.json`."""
    p = Path(results)
    return p.with_name(p.name.removesuffix(".jsonl") + ".summary.json")


def image_cache(results: str | Path) -> Path:
    """Decoded benchmark images: one folder per results folder, shared by its shards."""
    return Path(results).parent / "eval-images"


def default_cache() -> Path:
    """Where `eval --check` without `-o` decodes images: the user's cache, not the benchmark's
    folder."""
    root = os.environ.get("MARSCLI_CACHE_DIR") or Path.home() / ".cache" / "marscli"
    return Path(root) / "eval-images"
