"""VLMEvalKit-style TSV benchmarks: HR-Bench 4K / 8K and MME-RealWorld.

One row per question, tab-separated, a header line first, fields quoted where they hold tabs
or newlines (pandas `to_csv(sep="\\t")`). Assumed columns:
- hrbench (DreamMr/HR-Bench `hr_bench_4k.tsv`, `hr_bench_8k.tsv`): `index`, `question`, `A`,
  `B`, `C`, `D`, `answer` (a letter), `category` (the FSP / FCP sub-task), `image`,
  `cycle_category` (the option rotation the row belongs to: each question appears once per
  rotation with its options cycled, as a separate row with its own `index`; 200 questions x
  4 rotations = 800 rows). `cycle_category` rides along: the official protocol averages the
  per-rotation accuracies. The benchmark is hrbench-4k / hrbench-8k from the file name.
- mme-realworld (VLMEvalKit's `MME-RealWorld.tsv`): `index`, `question`, `A`..`E`, `answer`,
  `category`, `image`; `l2-category` and other columns ride along.
`image` is base64 image bytes, or, as VLMEvalKit writes repeated images, a short value (at most
64 characters) naming the `index` of the row that holds the bytes. An `image_path` column
(paths relative to the file or `--image-dir`) may replace `image`. Options left empty are
dropped (a question with options A-C has three choices). Decoded images go to the cache
folder as `SHA256.EXT`, written once however many rows or shards use them.
"""

from __future__ import annotations

import base64
import binascii
import csv
import sys
from pathlib import Path

from marscli.benchmarks import FORMATS, guess_name
from marscli.benchmarks.common import (
    LETTERS,
    LoadContext,
    Loaded,
    cache_image,
    find_image,
    gold_letter,
    is_missing,
    jsonable,
    mcq_question,
)
from marscli.errors import BadInput
from marscli.records.schema import Prompt

REQUIRED = ("index", "question", "A", "B", "answer")
EXPECTED = {"hrbench": "index, question, A, B, C, D, answer, category, image, cycle_category",
            "mme-realworld": "index, question, A, B, C, D, E, answer, category, image"}
MAX_REF = 64  # VLMEvalKit: an image cell this short is another row's index


def _tsv_file(path: Path) -> Path:
    if not path.is_dir():
        return path
    files = sorted(path.glob("*.tsv"))
    if len(files) != 1:
        raise BadInput(f"{path}: expected one .tsv file in this folder, found {len(files)} — "
                       "point at the file itself")
    return files[0]


def _open_reader(file: Path):
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))  # base64 images are tens of MB
    fh = file.open(encoding="utf-8", newline="")
    return fh, csv.DictReader(fh, delimiter="\t")


def load(path: Path, ctx: LoadContext, fmt: str) -> Loaded:
    file = _tsv_file(path)
    src = str(file)
    name = ctx.benchmark or (guess_name(file) if fmt == "hrbench" else None) or fmt
    if name == "hrbench":  # the file name did not say 4K or 8K
        name = guess_name(file) or "hrbench"
    loaded = Loaded(name, fmt, [])
    dirs = [d for d in (ctx.image_dir, file.resolve().parent) if d is not None]
    fh, reader = _open_reader(file)
    with fh:
        header = reader.fieldnames or []
        missing = [c for c in REQUIRED if c not in header]
        if "image" not in header and "image_path" not in header:
            missing.append("image")
        if missing:
            raise BadInput(f"{src}:1: header: missing column {missing[0]!r} (columns: "
                           f"{', '.join(header[:20]) or 'none'}) — a {fmt} TSV has "
                           f"{EXPECTED.get(fmt, ', '.join(REQUIRED))}")
        option_cols = [c for c in LETTERS if c in header]
        images: dict[str, str] = {}  # index -> cached image path
        refs: list[tuple[int, Prompt, str]] = []  # rows whose image names another row
        seen: dict[str, int] = {}
        line = 1
        for row in reader:
            start, line = line + 1, reader.line_num
            loaded.rows += 1
            p, ref = _row(row, start, src, option_cols, ctx, dirs, name, images)
            if p.id in seen:
                raise BadInput(f"{src}:{start}: index: duplicate index {p.id!r} (first on line "
                               f"{seen[p.id]})")
            seen[p.id] = start
            if ref is not None:
                refs.append((start, p, ref))
            if ctx.keep(p.id):
                loaded.prompts.append((start, p))
    for start, p, ref in refs:
        if ref not in images:
            raise BadInput(f"{src}:{start}: image: {ref!r} is neither base64 image data nor the "
                           "index of a row holding an image")
        p.images = [images[ref]]
    return loaded


def _row(row: dict, line: int, src: str, option_cols: list[str], ctx: LoadContext,
         dirs: list[Path], name: str, images: dict[str, str]) -> tuple[Prompt, str | None]:
    if None in row:  # more cells than header names
        raise BadInput(f"{src}:{line}: row has {len(row) - 1 + len(row[None])} cells, the header "
                       f"{len(row) - 1} — a stray tab, or a quote left open above?")
    for col in REQUIRED:
        if row.get(col) is None:
            raise BadInput(f"{src}:{line}: {col}: missing (the row is shorter than the header)")
    rid = row["index"].strip()
    if not rid:
        raise BadInput(f"{src}:{line}: index: empty")
    choices = []
    for col in option_cols:
        if is_missing(row.get(col)):
            break
        choices.append(row[col].strip())
    if len(choices) < 2:
        raise BadInput(f"{src}:{line}: A: a question needs at least options A and B")
    letter = gold_letter(row["answer"], len(choices), f"{src}:{line}: answer")
    ref, paths = None, []
    cell = (row.get("image") or "").strip()
    if not cell and not is_missing(row.get("image_path")):
        paths = [str(find_image(row["image_path"].strip(), dirs))]
    elif len(cell) <= MAX_REF and cell:
        ref = cell
    elif cell:
        try:
            data = base64.b64decode(cell, validate=False)
        except (binascii.Error, ValueError) as e:
            raise BadInput(f"{src}:{line}: image: not base64 ({e})") from None
        paths = [str(cache_image(data, ctx.cache_dir))]
        images[rid] = paths[0]
    else:
        raise BadInput(f"{src}:{line}: image: empty")
    used = {"index", "question", "answer", "image", "image_path", "category", *LETTERS}
    extra = {k: v for k, v in row.items() if k not in used and v != "" and jsonable(v)}
    extra["benchmark"] = name
    category = row.get("category")
    p = Prompt(id=rid, question=mcq_question(row["question"], choices), images=paths,
               answer=[letter], base=dirs[-1], choices=choices,
               category=None if is_missing(category) else category.strip(), extra=extra)
    return p, ref


FORMATS.register("hrbench")(load)
FORMATS.register("mme-realworld")(load)
