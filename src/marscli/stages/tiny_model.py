"""`marscli tiny-model OUT`: a tiny, randomly initialised Qwen3-VL checkpoint for tests and CPU
demos (the factory and how the model departs from a released one: marscli.qwen.tiny), with its
`OUT.meta.json` sidecar and a line on stderr."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from marscli.errors import BadInput
from marscli.qwen.tiny import (
    DEFAULT_SIZE,
    VOCABS,
    build_tiny_model,
    check_init_std,
    count_parameters,
    read_texts,
)
from marscli.qwen.tiny_config import INIT_STD, TINY_MAX_PIXELS, TINY_MIN_PIXELS
from marscli.records.provenance import check_no_input_inside, note_inputs, stage_inputs
from marscli.records.sidecar import write_sidecar


@stage_inputs()
def main(out: str, seed: int = 0, text_files: Iterable[str] | None = (), size: str | None = None,
         force: bool = False, min_pixels: int = TINY_MIN_PIXELS,
         max_pixels: int = TINY_MAX_PIXELS, vocab: str = "tiny",
         init_std: float = INIT_STD) -> Path:
    """`marscli tiny-model`: build, write `OUT.meta.json` beside the folder, report on stderr."""
    import sys
    import time

    started = time.time()
    text_files = list(text_files or ())
    if vocab not in VOCABS:  # before any file is read
        raise BadInput(f"--vocab: unknown vocabulary {vocab!r} — choose one of: "
                       f"{', '.join(VOCABS)}")
    size = size or DEFAULT_SIZE[vocab]
    check_init_std(init_std)
    note_inputs(*text_files)  # read as text: --force may not replace a folder holding one
    check_no_input_inside(out)
    path = build_tiny_model(out, seed=seed, texts=read_texts(text_files), size=size, force=force,
                            min_pixels=min_pixels, max_pixels=max_pixels, vocab=vocab,
                            init_std=init_std)
    n_params = count_parameters(path)
    with open(path / "config.json") as fh:
        vocab_size = json.load(fh)["text_config"]["vocab_size"]
    mb = sum(f.stat().st_size for f in path.iterdir()) / 1e6
    write_sidecar(str(path), stage="tiny-model", seed=seed,
                  config={"size": size, "vocab": vocab, "text_files": text_files,
                          "min_pixels": min_pixels, "max_pixels": max_pixels,
                          "init_std": init_std},
                  inputs=text_files,
                  stats={"parameters": n_params, "vocab_size": vocab_size, "mb": mb},
                  started=started)
    print(f"{path}: {size} Qwen3-VL, {n_params:,} parameters, vocab {vocab_size}, {mb:.1f} MB, "
          f"{time.time() - started:.1f} s", file=sys.stderr)
    return path
