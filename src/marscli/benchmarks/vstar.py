"""V* Bench: multiple choice on high-resolution images, in any container (`containers.py`).

Two published layouts, same fields:
- craigwu/vstar_bench: `test_questions.jsonl` beside the image folders; `image` a path
  ("direct_attributes/sa_4690.jpg") looked up in `--image-dir`, the file's folder, then
  `images/` beside it.
- lmms-lab/vstar-bench (what lmms-eval's `vstar_bench` task reads): parquet under `data/`
  with `image` an Image struct (`{bytes, path}`), decoded into the cache.
`text` is the question with its options, one per line ("(A) red") or inline, and in the
original an instruction line after them; `label` the gold letter; `category`
(direct_attributes / relative_position; else the image's folder); `question_id`. Rows with
explicit `options` (or `choices`) and `answer` are accepted too. The options are parsed out
and re-rendered (common.py); lmms-eval parses them the same way (`vstar_doc_to_text`).
"""

from __future__ import annotations

from pathlib import Path

from marscli.benchmarks.common import (
    LoadContext,
    Loaded,
    gold_letter,
    image_dirs,
    image_files,
    is_missing,
    mcq_prompt,
    split_options,
)
from marscli.benchmarks.containers import data_files, iter_file, unit_of, where
from marscli.benchmarks.facts import Benchmark, Layout, Paper, declare
from marscli.errors import BadInput
from marscli.records.schema import Prompt

_USED = {"question_id", "id", "text", "question", "options", "choices", "label", "answer",
         "image", "image_path", "category"}


def _get(row: dict, names: tuple[str, ...]) -> tuple[str | None, object]:
    for n in names:
        if n in row and not is_missing(row[n]):
            return n, row[n]
    return None, None


def load(path: Path, ctx: LoadContext, fmt: str = "vstar") -> Loaded:
    if path.is_dir() and (path / "test_questions.jsonl").is_file():
        path = path / "test_questions.jsonl"
    files, split = data_files(path, ctx.split)
    loaded = Loaded(ctx.benchmark or "vstar", fmt, [], unit=unit_of(files[0]), split=split)
    for file in files:
        dirs, unit = image_dirs(ctx, file, ("images",)), unit_of(file)
        for n, row in iter_file(file):
            loaded.rows += 1
            at = where(file, n, unit)
            p = _row(row, n, at, ctx, dirs, loaded.benchmark)
            loaded.add(n, p, at, ctx.keep)
    return loaded


def _row(row: dict, n: int, at: str, ctx: LoadContext, dirs: list[Path], bench: str) -> Prompt:
    _, rid = _get(row, ("question_id", "id"))
    rid = f"vstar-{n}" if rid is None else str(rid)
    qkey, text = _get(row, ("text", "question"))
    if not isinstance(text, str):
        raise BadInput(f"{at}: text: missing question text")
    options = row.get("options", row.get("choices"))
    if isinstance(options, list) and options:
        stem, choices = split_options(text)[0], [str(o) for o in options]
    else:
        stem, choices = split_options(text)
    if len(choices) < 2:
        raise BadInput(f"{at}: {qkey}: no options — expected \"(A) ...\" lines in the "
                       "question, or an `options` list")
    akey, gold = _get(row, ("label", "answer"))
    letter = gold_letter(gold, len(choices), f"{at}: {akey or 'label'}")
    ikey, image = _get(row, ("image", "image_path"))
    if image is None:
        raise BadInput(f"{at}: image: missing image")
    images = image_files(image, ctx, dirs, f"{at}: {ikey}") if ctx.keep(rid) else []
    others = {k: v for k, v in row.items() if k not in _USED}
    category = row.get("category")
    if is_missing(category) and isinstance(image, str) and len(image) < 300:
        category = str(Path(image).parent)  # the original's folders are its categories
    return mcq_prompt(rid, stem, choices, letter, images=images, base=dirs[0],
                      category=None if is_missing(category) or category == "." else str(category),
                      others=others, benchmark=bench)


declare(
    Layout("vstar", load, files=("test_questions.jsonl",),
           columns=((40, lambda cols, _s: {"text", "label"} <= cols),)),
    Benchmark("vstar", "V* Bench", multiple_choice=True, release_folder="vstar_bench",
              needle="vstar", categories="direct_attributes / relative_position",
              paper=Paper(191, mars=(92.2, 94.2), direct=(86.4, None), agent=(None, 91.1))),
)
