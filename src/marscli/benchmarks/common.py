"""What every benchmark loader shares: the load context, decoded-image caching, answers and
options as lists of strings, and how a multiple-choice question is put to the model.

Multiple-choice questions are rendered one way whatever the benchmark's own prompt:

    {stem}
    Options:
    A. {first}
    B. {second}
    Answer with the option's letter.

(the benchmarks' "answer directly" instructions would fight the agent's thinking turns).
`choices` holds the option texts without their labels; the gold answer is the letter.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from marscli.errors import BadInput
from marscli.records.schema import Prompt

LETTERS = "ABCDE"
IMAGE_EXTS = ("", ".jpg", ".jpeg", ".JPEG", ".JPG", ".png", ".PNG", ".webp")
_OPTION_LINE = re.compile(r"^\s*\(?([A-Ea-e])[.):]\s*(.+?)\s*$")
_MAGIC = ((b"\x89PNG\r\n\x1a\n", ".png"), (b"\xff\xd8\xff", ".jpg"), (b"GIF8", ".gif"),
          (b"BM", ".bmp"), (b"II*\x00", ".tif"), (b"MM\x00*", ".tif"))


@dataclass
class LoadContext:
    """Where a loader puts decoded images and finds referenced ones, and which rows it keeps.

    `keep(id)` is False for rows of other shards: a loader still validates them (so every
    shard refuses the same bad file) but decodes no image for them."""

    source: str  # the BENCH argument as given (for messages)
    cache_dir: Path  # decoded image bytes go here, named by sha256
    image_dir: Path | None = None  # --image-dir: where rows' relative image names live
    benchmark: str | None = None  # --benchmark: overrides the name a loader infers
    keep: Callable[[str], bool] = field(default=lambda _id: True)


@dataclass
class Loaded:
    benchmark: str  # the name a loader inferred for the file (rows may carry their own)
    fmt: str
    prompts: list[tuple[int, Prompt]]  # (line or row number, prompt): the kept rows only
    rows: int = 0  # rows read, kept or not
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> rows left out
    notes: list[str] = field(default_factory=list)
    unit: str = "line"  # what the numbers in `prompts` count: JSONL/TSV lines, parquet rows


def cache_image(data: bytes, cache_dir: Path) -> Path:
    """Write image bytes once as `cache_dir/SHA256.EXT` (atomic; shared by shards)."""
    digest = hashlib.sha256(data).hexdigest()
    ext = next((e for magic, e in _MAGIC if data.startswith(magic)), None)
    if ext is None:
        ext = ".webp" if data[:4] == b"RIFF" and data[8:12] == b"WEBP" else ".img"
    path = cache_dir / f"{digest}{ext}"
    if not path.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    return path


def find_image(name: str, dirs: list[Path]) -> Path:
    """A row's image name resolved against `dirs` (trying common extensions when the name has
    none); the first candidate when nothing exists, so the image check names it."""
    p = Path(name)
    if p.is_absolute():
        return p
    for d in dirs:
        for ext in IMAGE_EXTS if not p.suffix else ("",):
            cand = d / f"{name}{ext}"
            if cand.is_file():
                return cand
    return dirs[0] / name


def is_missing(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v)) or (isinstance(v, str)
                                                                    and not v.strip())


def answers_of(value: Any) -> list[str]:
    """A gold answer field (a string, a number, a list of them) as a list of strings."""
    if is_missing(value):
        return []
    if isinstance(value, (list, tuple)):
        return [a for v in value for a in answers_of(v)]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return [str(value).strip()]


def split_options(text: str) -> tuple[str, list[str]]:
    """A question with its options inline ("(A) red" or "A. red" lines) → (stem, options).
    Lines after the options (an instruction) are dropped; no options → (text, [])."""
    lines = text.splitlines()
    stem, options = [], []
    for line in lines:
        m = _OPTION_LINE.match(line)
        expected = LETTERS[len(options)] if len(options) < len(LETTERS) else None
        if m and m[1].upper() == expected:
            options.append(m[2])
        elif options:
            break  # the instruction after the options
        elif line.strip().lower() not in ("options:", "choices:"):
            stem.append(line)
    if len(options) < 2:
        return text, []
    return "\n".join(stem).strip(), options


def mcq_question(stem: str, choices: list[str]) -> str:
    opts = "\n".join(f"{LETTERS[i]}. {c}" for i, c in enumerate(choices))
    return f"{stem.strip()}\nOptions:\n{opts}\nAnswer with the option's letter."


def gold_letter(value: Any, n_options: int, where: str) -> str:
    """A gold option letter ("B", "(B)", "b") checked against the number of options."""
    s = str(value).strip().strip("()[]. ").upper() if not is_missing(value) else ""
    letters = LETTERS[:n_options]
    if len(s) != 1 or s not in letters:
        raise BadInput(f"{where}: {value!r} is not one of the options {letters[0]}-{letters[-1]}")
    return s


def jsonable(v: Any) -> bool:
    """Whether a value may ride along in records (no bytes, no NaN, nothing huge)."""
    if v is None or isinstance(v, (bool, int, str)):
        return not isinstance(v, str) or len(v) <= 10_000
    if isinstance(v, float):
        return not math.isnan(v)
    if isinstance(v, (list, tuple)):
        return len(v) <= 1000 and all(jsonable(x) for x in v)
    if isinstance(v, dict):
        return all(isinstance(k, str) and jsonable(x) for k, x in v.items())
    return False
