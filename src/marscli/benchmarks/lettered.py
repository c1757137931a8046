"""Multiple choice with lettered option columns: HR-Bench 4K / 8K and MME-RealWorld, in any
container (`containers.py`): VLMEvalKit's TSV, the Hugging Face parquet files lmms-eval
reads, JSONL or a JSON array.

Columns:
- hrbench (DreamMr/HR-Bench `hr_bench_4k.tsv` / `hr_bench_8k.tsv`, and its parquet
  `hrbench_version_split` config that lmms-eval's `hrbench4k` / `hrbench8k` tasks read):
  `index`, `question`, `A`..`D`, `answer` (a letter), `category` (single / cross: the FSP /
  FCP sub-task), `image`, `cycle_category` (the option rotation the row belongs to: each
  question appears once per rotation with its options cycled, as a separate row with its own
  `index`; 200 questions x 4 rotations = 800 rows). `cycle_category` rides along: the
  official protocol averages the per-rotation accuracies (lmms-eval's
  `hrbench_aggregate_results` does the same). The benchmark is hrbench-4k / hrbench-8k from
  the file name.
- mme-realworld: VLMEvalKit's `MME-RealWorld.tsv` / `-CN.tsv` as `MMERealWorld.load_data`
  writes them: `A`..`E` (each option without its "(A) ") beside `multi-choice options`
  holding the text its prompt shows ("The choices are listed below:\n(A) ...\n(B) ...",
  or the Chinese heading), and its LOCALIZE form (`*_local.tsv`: every cell quoted, `image`
  replaced by an absolute `image_path`). Or the Hugging Face files lmms-eval reads
  (yifanzhang114/MME-RealWorld-Lmms-eval and -lite-lmms-eval): no letter columns, the
  options in `multi-choice options` — a list, or a Python list literal in a text cell (read
  with `ast.literal_eval`, never evaluated) — of "(A) text" strings; the image in `bytes`
  (base64). The `A`..`E` cells are the choices where a row fills them (the text column must
  then list as many); the question is rendered as every multiple-choice one is
  (`common.mcq_question`), so each layout of an item gives the same prompt. `category`
  ("Perception/Monitoring", ...) and `l2-category` as lmms-eval reads them.
The image cell is base64 image bytes, an Image struct, or, as VLMEvalKit writes repeated
images, a short value (at most 64 characters) naming the `index` of the row that holds the
bytes. An `image_path` column (absolute, or relative to `--image-dir` or the file's folder)
may replace it; a path that names no file is refused at load.
Options left empty at the end are dropped (a question with options A-C has three choices);
one left empty before a filled one is refused (the later ones would take the wrong letters).
Decoded images go to the cache folder as `SHA256.EXT`, written once however many rows use them.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

from marscli.benchmarks.common import (
    LETTERS,
    LoadContext,
    Loaded,
    clip,
    gold_letter,
    image_dirs,
    image_files,
    is_missing,
    mcq_prompt,
)
from marscli.benchmarks.containers import columns_of, data_files, iter_file, unit_of, where
from marscli.benchmarks.facts import Benchmark, Layout, Paper, declare, guess_name
from marscli.errors import BadInput
from marscli.records.schema import Prompt

OPTIONS_COL = "multi-choice options"
IMAGE_COLS = ("image", "bytes", "image_path")
EXPECTED = {"hrbench": "index, question, A, B, C, D, answer, category, image, cycle_category",
            "mme-realworld": "index, question, A..E (or multi-choice options), answer, "
                             "category, image (or bytes, image_path)"}
MAX_REF = 64  # VLMEvalKit: an image cell this short is another row's index
_LABEL = re.compile(r"^\s*\(?([A-Ea-e])[).:]\s*")
_TEXT_LABEL = re.compile(r"(?:^|\n)\(([A-E])\) ?")  # VLMEvalKit's "(A) text" lines


def _check_header(file: Path, cols: list[str], fmt: str) -> None:
    need = ["index", "question", "answer"]
    if OPTIONS_COL not in cols:
        need += ["A", "B"]
    missing = [c for c in need if c not in cols]
    if not set(IMAGE_COLS) & set(cols):
        missing.append("image")
    if missing:
        at = f"{file}:1: header" if file.suffix.lower() in (".tsv", ".csv") else f"{file}"
        raise BadInput(f"{at}: missing column {missing[0]!r} (columns: "
                       f"{clip(', '.join(cols[:20]), 120) or 'none'}) — a {fmt} file has "
                       f"{EXPECTED.get(fmt, ', '.join(need))}")


def load(path: Path, ctx: LoadContext, fmt: str) -> Loaded:
    files, split = data_files(path, ctx.split)
    name = ctx.benchmark or (guess_name(files[0]) if fmt == "hrbench" else None) or fmt
    if name == "hrbench":  # the file name did not say 4K or 8K: the folder may
        name = guess_name(path) or "hrbench"
    loaded = Loaded(name, fmt, [], unit=unit_of(files[0]), split=split)
    for file in files:
        cols = columns_of(file)
        _check_header(file, cols, fmt)
        dirs, unit = image_dirs(ctx, file), unit_of(file)
        images: dict[str, str] = {}  # index -> cached image path
        refs: list[tuple[str, Prompt, str]] = []  # rows whose image names another row
        for n, row in iter_file(file):
            loaded.rows += 1
            at = where(file, n, unit)
            p, ref = _row(row, at, ctx, dirs, name, images)
            if ref is not None:
                refs.append((at, p, ref))
            loaded.add(n, p, at, ctx.keep)
        for at, p, ref in refs:
            if ref not in images:
                raise BadInput(f"{at}: image: {clip(ref)!r} is neither base64 image data nor "
                               "the index of a row holding an image")
            p.images = [images[ref]]
    return loaded


def _text(v: Any) -> str:
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    return "" if is_missing(v) else str(v).strip()


def _options(row: dict, at: str) -> list[str]:
    """The option texts, without their labels: the A..E columns where a row fills them (the
    choices, as VLMEvalKit scores them), else `multi-choice options`. Where both are given,
    the text column (what the official prompt shows) must list as many options."""
    lettered = _lettered(row, at)
    raw = row.get(OPTIONS_COL)
    if is_missing(raw):
        return lettered
    listed = _listed(raw, at)
    if lettered and len(listed) != len(lettered):
        raise BadInput(f"{at}: {OPTIONS_COL}: lists {len(listed)} options, columns "
                       f"A..{LETTERS[len(lettered) - 1]} hold {len(lettered)} — the row's "
                       "options disagree; fix one or the other")
    return lettered or listed


def _lettered(row: dict, at: str) -> list[str]:
    """The A..E cells up to the last filled one; an empty one before a filled one is refused
    (the options after it would be relabelled, and the gold letter point elsewhere)."""
    cells = [_text(row.get(col)) for col in LETTERS]
    n = max((i + 1 for i, c in enumerate(cells) if c), default=0)
    gap = next((i for i in range(n) if not cells[i]), None)
    if gap is not None:
        raise BadInput(f"{at}: {LETTERS[gap]}: empty while {LETTERS[n - 1]} is not — the "
                       "options after it would take the wrong letters")
    return cells[:n]


def _listed(raw: Any, at: str) -> list[str]:
    """`multi-choice options` as a list of "(A) text" strings: a list, a Python list literal
    (the Hugging Face files; `ast.literal_eval`, never evaluated), or VLMEvalKit's text
    ("The choices are listed below:\n(A) ...\n(B) ...")."""
    if isinstance(raw, str) and not raw.strip().startswith("["):
        return _from_text(raw, at)
    if isinstance(raw, str):
        try:
            raw = ast.literal_eval(raw.strip())
        except (ValueError, SyntaxError):
            raise BadInput(f"{at}: {OPTIONS_COL}: not a list literal "
                           f"({clip(raw)!r})") from None
    if not isinstance(raw, (list, tuple)) or not all(isinstance(o, str) for o in raw):
        raise BadInput(f"{at}: {OPTIONS_COL}: expected a list of strings")
    return [_LABEL.sub("", o, count=1).strip() for o in raw if o.strip()]


def _from_text(raw: str, at: str) -> list[str]:
    """The options of VLMEvalKit's text column: a line "(A) ..." starts each, in letter order,
    after a heading line (English or Chinese); an option may run over several lines."""
    parts = _TEXT_LABEL.split(raw)  # [heading, "A", text, "B", text, ...]
    letters, texts = parts[1::2], [t.strip() for t in parts[2::2]]
    if len(letters) < 2 or letters != list(LETTERS[:len(letters)]):
        raise BadInput(f"{at}: {OPTIONS_COL}: not a list literal nor \"(A) ...\" lines "
                       f"({clip(raw, 40)!r}) — give the options as either")
    return texts


def _local_images(cell: Any, ctx: LoadContext, dirs: list[Path], at: str) -> list[str]:
    """An `image_path` cell (VLMEvalKit's LOCALIZE writes absolute paths; a relative one is
    looked up in `--image-dir`, then the file's folder) → existing files. A missing one is
    named as the row gives it, not as the last place it was looked for."""
    paths = image_files(cell, ctx, dirs, f"{at}: image_path")
    for given, found in zip(cell if isinstance(cell, (list, tuple)) else [cell], paths):
        if not Path(found).is_file():
            name, where = Path(str(given).strip()).name, ", ".join(str(d) for d in dirs)
            raise BadInput(f"{at}: image_path: no such file {str(given).strip()} (nor "
                           f"{clip(name, 30)} in {where}) — pass --image-dir")
    return paths


def _row(row: dict, at: str, ctx: LoadContext, dirs: list[Path], name: str,
         images: dict[str, str]) -> tuple[Prompt, str | None]:
    if None in row:  # a TSV row with more cells than header names
        raise BadInput(f"{at}: row has {len(row) - 1 + len(row[None])} cells, the header "
                       f"{len(row) - 1} — a stray tab, or a quote left open above?")
    for col in ("index", "question", "answer"):
        if row.get(col) is None:
            raise BadInput(f"{at}: {col}: missing (the row is shorter than the header)")
    rid = _text(row["index"])
    if not rid:
        raise BadInput(f"{at}: index: empty")
    choices = _options(row, at)
    if len(choices) < 2:
        raise BadInput(f"{at}: A: a question needs at least options A and B")
    letter = gold_letter(row["answer"], len(choices), f"{at}: answer")
    ref, paths = None, []
    key = next((c for c in IMAGE_COLS if not is_missing(row.get(c))), None)
    cell = row.get(key) if key else None
    if key is None:
        raise BadInput(f"{at}: image: empty")
    if key != "image_path" and isinstance(cell, str) and len(cell.strip()) <= MAX_REF:
        ref = cell.strip()
    elif key == "image_path":
        paths = _local_images(cell, ctx, dirs, at) if ctx.keep(rid) else []
    else:
        paths = image_files(cell, ctx, dirs, f"{at}: {key}")
        images[rid] = paths[0]
    used = {"index", "question", "answer", OPTIONS_COL, "category", *IMAGE_COLS, *LETTERS}
    others = {k: v for k, v in row.items() if k not in used and v != "" and k is not None}
    category = row.get("category")
    p = mcq_prompt(rid, _text(row["question"]), choices, letter, images=paths, base=dirs[0],
                   category=None if is_missing(category) else _text(category), others=others,
                   benchmark=name)
    return p, ref


_ROTATED = {"multiple_choice": True, "official": "rotations", "fmt": "hrbench",
            "categories": "single / cross (the FSP / FCP sub-tasks)"}

declare(
    Layout("hrbench", load, columns=((20, lambda cols, _s: "cycle_category" in cols),)),
    Layout("mme-realworld", load, columns=(
        (10, lambda cols, _s: OPTIONS_COL in cols),
        (90, lambda cols, suffix: suffix in (".tsv", ".csv") and "E" in cols))),
    Benchmark("hrbench-4k", "HR-Bench 4K", release_folder="hr_bench_4k", needle="hrbench4k",
              paper=Paper(800, mars=(83.1, 90.2), direct=(78.9, None), agent=(None, 84.6)),
              **_ROTATED),
    Benchmark("hrbench-8k", "HR-Bench 8K", release_folder="hr_bench_8k", needle="hrbench8k",
              paper=Paper(800, mars=(78.4, 86.6), direct=(74.6, None), agent=(None, 81.6)),
              **_ROTATED),
    Benchmark("hrbench", "HR-Bench", needle="hrbench", **_ROTATED),  # 4K or 8K not said
    # The release has no MME-RealWorld config and its extractor stops at D; E is added here.
    Benchmark("mme-realworld", "MME-RealWorld", multiple_choice=True, letters="ABCDE",
              release_folder="mme_realworld", needle="mmerealworld",
              categories="task: Perception/..., Reasoning/...",
              paper=Paper(None, mars=(67.9, 72.7), direct=(61.9, None), agent=(None, None))),
)
