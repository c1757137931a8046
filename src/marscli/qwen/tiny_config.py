"""`marscli tiny-model`'s options, each declared once, and the defaults the factory shares
(qwen/tiny.py). Light: the CLI imports it for --help."""

from __future__ import annotations

from dataclasses import dataclass

from marscli.options import option

TINY_MIN_PIXELS = 65_536  # 256 x 256: 64 merged tokens
TINY_MAX_PIXELS = 200_704  # 448 x 448: 196 merged tokens
# HF's initializer_range for Qwen3-VL, sized for its 4096-wide model. The tiny model's widths
# are 64-128: 0.08 (about 1/sqrt(width)) left the seeing plateau about 3x sooner (docs/demo.md).
INIT_STD = 0.02


@dataclass
class TinyConfig:
    seed: int = option(0, "Seed of the random weights.")
    text_files: list[str] | None = option(
        None, "Extra tokenizer training text (text or JSONL: string values); repeatable. Pass "
              "the task's corpus and prompts.", decls=("--text",), metavar="FILE")
    size: str | None = option(
        None, "tiny (about 1 M parameters with --vocab tiny), small (demo) or micro (the default "
              "with --vocab qwen: text hidden 64).")
    vocab: str = option(
        "tiny", "tiny (a small BPE trained here) or qwen (the real Qwen3-VL vocabulary and chat "
                "template; needs the qwen extra).")
    force: bool = option(False, "Replace a non-empty OUT.")
    min_pixels: int = option(
        TINY_MIN_PIXELS, "Processor floor: images are upscaled to at least this many pixels.")
    max_pixels: int = option(
        TINY_MAX_PIXELS, "Processor cap: 200,704 (448x448) gives at most 196 image tokens.")
    init_std: float = option(
        INIT_STD, "Standard deviation of the random weights (Qwen3-VL's initializer_range). "
                  "0.08 left the seeing plateau 3x sooner than 0.02 (docs/demo.md).")
