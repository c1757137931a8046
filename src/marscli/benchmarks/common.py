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

import base64
import binascii
import hashlib
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from marscli.errors import BadInput
from marscli.records.mcq import LETTERS, split_options
from marscli.records.outputs import tmp_path
from marscli.records.schema import Prompt

IMAGE_EXTS = ("", ".jpg", ".jpeg", ".JPEG", ".JPG", ".png", ".PNG", ".webp", ".gif", ".bmp")
MAX_NAME = 255  # a string image cell longer than a file name can be is base64 image data
_B64 = re.compile(r"[A-Za-z0-9+/]+={0,2}")
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
    split: str | None = None  # --split: which split of a folder holding several (else test)
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
    split: str | None = None  # the split the rows come from, when the files name one
    where: dict[str, str] = field(default_factory=dict)  # id -> where its row is (FILE:LINE)

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

    def add(self, n: int, p: Prompt, where: str, keep: Callable[[str], bool]) -> None:
        """A row read at `where`: refused when its id was seen or it has no gold answer, kept
        when `keep` says so."""
        if p.id in self.where:
            raise BadInput(f"{where}: id: duplicate id {clip(p.id)!r} (first at "
                           f"{self.where[p.id]})")
        # every layout passes here: an item without gold would be scored 0 and counted
        if not any(isinstance(a, str) and a.strip() for a in p.answer):
            raise BadInput(f"{where}: answer: missing gold answer — an eval item is scored "
                           "against it; fill it in or drop the row")
        self.where[p.id] = where
        if keep(p.id):
            self.prompts.append((n, p))


def cache_image(data: bytes, cache_dir: Path) -> Path:
    """Write image bytes once as `cache_dir/SHA256.EXT` (atomic; shared by shards)."""
    digest = hashlib.sha256(data).hexdigest()
    path = cache_dir / f"{digest}{_image_ext(data)}"
    if not path.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = tmp_path(path)
        tmp.write_bytes(data)
        tmp.replace(path)
    return path


def find_image(name: str, dirs: list[Path], shard: str | None = None) -> Path:
    """A row's image name resolved against `dirs` (trying common extensions when the name has
    none, and the subfolder `shard` of each: OVEN's `01/oven_01963180.jpg`). An absolute path
    that does not exist here (the authors' own, as in LiveVQA's qa.json) is looked up by its
    file name. The first candidate when nothing exists, so the image check names it."""
    p = Path(name)
    if p.is_absolute():
        if p.exists() or not dirs:
            return p
        name, p = p.name, Path(p.name)
    for d in dirs:
        for sub in (d, d / shard) if shard else (d,):
            for ext in IMAGE_EXTS if not p.suffix else ("",):
                cand = sub / f"{name}{ext}"
                if cand.is_file():
                    return cand
    return dirs[0] / name


def image_dirs(ctx: LoadContext, file: Path, subs: tuple[str, ...] = ()) -> list[Path]:
    """Where a row's image names are looked up, in order: `--image-dir`, the data file's
    folder, then the benchmark's own image folders beside it (absolute paths)."""
    folder = file.resolve().parent
    first = [ctx.image_dir.resolve()] if ctx.image_dir is not None else []
    return [*first, folder, *(folder / s for s in subs)]


def clip(value: object, n: int = 60) -> str:
    """A value for an error message: never a base64 blob, at most `n` characters."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return f"<{len(value)} bytes>"
    s = value if isinstance(value, str) else repr(value)
    return s if len(s) <= n else f"{s[:n - 20]}... ({len(s)} characters)"


def image_files(value: Any, ctx: LoadContext, dirs: list[Path], where: str,
                shard: str | None = None) -> list[str]:
    """An image cell → file paths: bytes and base64 strings (SimpleVQA, HR-Bench,
    MME-RealWorld) decoded into the cache, `{bytes, path}` structs (the `datasets` Image
    feature), names resolved against `dirs`; a list of these gives several."""
    if isinstance(value, (list, tuple)):
        return [p for v in value for p in image_files(v, ctx, dirs, where, shard)]
    if isinstance(value, dict):
        if value.get("bytes"):
            return [str(cache_image(bytes(value["bytes"]), ctx.cache_dir))]
        if not value.get("path"):
            raise BadInput(f"{where}: image cell has neither bytes nor a path")
        value = value["path"]
    if isinstance(value, (bytes, bytearray, memoryview)):
        return [str(cache_image(bytes(value), ctx.cache_dir))]
    if isinstance(value, str):
        data = _base64_image(value, where)
        if data is not None:
            return [str(cache_image(data, ctx.cache_dir))]
        name = value.strip()
        if any(len(part) > MAX_NAME for part in Path(name).parts):
            raise BadInput(f"{where}: a {len(name)}-character value that is neither a file "
                           "name nor base64 image data")
        return [str(find_image(name, dirs, shard))]
    raise BadInput(f"{where}: image cell of type {type(value).__name__} — expected bytes, "
                   "base64, a path, or {bytes, path}")


def _base64_image(value: str, where: str) -> bytes | None:
    """Image bytes when `value` is base64 (or a `data:` URL), None when it is a file name:
    base64 is a value in base64's alphabet only that is longer than a file name can be, or
    shorter and decoding to an image's magic bytes."""
    v = value.strip()
    if v.startswith("data:") and ";base64," in v[:100]:
        v = v.split(",", 1)[1]
    elif len(v) < 16 or not _B64.fullmatch(v):
        return None
    try:
        data = base64.b64decode(v, validate=False)
    except (binascii.Error, ValueError):
        raise BadInput(f"{where}: a {len(v)}-character value that is neither a file name "
                       "nor base64 image data") from None
    if len(v) <= MAX_NAME and _image_ext(data) == ".img":
        return None  # a name that happens to be written in base64's alphabet
    return data


def _image_ext(data: bytes) -> str:
    ext = next((e for magic, e in _MAGIC if data.startswith(magic)), None)
    if ext is None:
        ext = ".webp" if data[:4] == b"RIFF" and data[8:12] == b"WEBP" else ".img"
    return ext


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


def mcq_question(stem: str, choices: list[str]) -> str:
    opts = "\n".join(f"{LETTERS[i]}. {c}" for i, c in enumerate(choices))
    return f"{stem.strip()}\nOptions:\n{opts}\nAnswer with the option's letter."


def mcq_prompt(rid: str, stem: str, choices: list[str], letter: str, *, images: list[str],
               base: Path, category: str | None, others: dict, benchmark: str) -> Prompt:
    """A multiple-choice row as every loader puts it to the model: the question rendered with
    its options (`mcq_question`, so each layout of an item gives the same prompt), the gold
    letter as the answer, and in `extra` the row's `others` (its fields no column of the
    prompt holds) that can ride along in records, with the benchmark's name."""
    extra = {k: v for k, v in others.items() if jsonable(v)}
    extra["benchmark"] = benchmark
    return Prompt(id=rid, question=mcq_question(stem, choices), images=images, answer=[letter],
                  base=base, choices=choices, category=category, extra=extra)


def gold_letter(value: Any, n_options: int, where: str) -> str:
    """A gold option letter ("B", "(B)", "b") checked against the number of options."""
    s = str(value).strip().strip("()[]. ").upper() if not is_missing(value) else ""
    letters = LETTERS[:n_options]
    if len(s) != 1 or s not in letters:
        raise BadInput(f"{where}: {clip(value)!r} is not one of the options "
                       f"{letters[0]}-{letters[-1]}")
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


__all__ = ["LETTERS", "LoadContext", "Loaded", "answers_of", "cache_image", "clip", "find_image",
           "gold_letter", "image_dirs", "image_files", "is_missing", "jsonable", "mcq_prompt",
           "mcq_question", "split_options"]
