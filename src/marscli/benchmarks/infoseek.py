"""InfoSeek (the official `infoseek_val.jsonl`, or the same fields in any container) with the
OVEN images.

Fields: `data_id`, `image_id` (an OVEN image name without extension, e.g. oven_05050169),
`question`, `answer` (list), `answer_eval` (strings, or for numerical questions
`[{"wikidata": v, "range": [lo, hi]}]`), `data_split` (val_unseen_question /
val_unseen_entity). `question_type` (String / Numerical / Time) is read from the row, or from
the sibling `*_qtype.jsonl` file the release ships (`{data_id, question_type}`); it is the
item's category. `answer_eval`, `data_split` and `question_type` ride along for the official
protocol.

Images: OVEN ships them sharded by the first two digits of the id
(`oven_images/01/oven_01963180.jpg`), extensions varying (.jpg, .JPEG, .png ...). A name is
looked up in `--image-dir`, the file's folder, `oven_images/` and `images/` beside it, each
directly and in its two-digit shard folder, with every common extension.
"""

from __future__ import annotations

import re
from pathlib import Path

from marscli.benchmarks.common import (
    LoadContext,
    Loaded,
    answers_of,
    image_dirs,
    image_files,
    is_missing,
    jsonable,
)
from marscli.benchmarks.containers import data_files, iter_file, unit_of, where
from marscli.benchmarks.facts import Benchmark, Layout, Paper, declare
from marscli.errors import BadInput
from marscli.records.jsonl import read_rows
from marscli.records.schema import Prompt

_DEFAULT_FILES = ("infoseek_val.jsonl", "infoseek_test.jsonl")
_OVEN = re.compile(r"oven_(\d{2})")
_USED = {"data_id", "id", "question", "answer", "image_path", "image", "image_id"}


def oven_shard(name: str) -> str | None:
    """`oven_01963180` → `01`, the folder OVEN keeps it in."""
    m = _OVEN.match(Path(name).name)
    return None if m is None else m[1]


def _qtypes(file: Path) -> dict[str, str]:
    """`infoseek_val_qtype.jsonl` beside `infoseek_val.jsonl`: data_id -> question_type."""
    cands = [file.with_name(f"{file.stem}_qtype.jsonl"), *sorted(file.parent.glob("*qtype*.jsonl"))]
    for q in cands:
        if q.is_file() and q != file:
            out = {}
            for line, row in read_rows(str(q)):
                if "data_id" not in row or "question_type" not in row:
                    raise BadInput(f"{q}:{line}: expected {{data_id, question_type}}")
                out[str(row["data_id"])] = str(row["question_type"])
            return out
    return {}


def load(path: Path, ctx: LoadContext, fmt: str = "infoseek") -> Loaded:
    if path.is_dir():
        named = [path / n for n in _DEFAULT_FILES if (path / n).is_file()]
        path = named[0] if named and ctx.split is None else path
    files, split = data_files(path, ctx.split)
    loaded = Loaded(ctx.benchmark or "infoseek", fmt, [], unit=unit_of(files[0]), split=split)
    qtypes: dict[str, str] = {}
    for file in files:
        qtypes.update(_qtypes(file))
        dirs, unit = image_dirs(ctx, file, ("oven_images", "images")), unit_of(file)
        for n, row in iter_file(file):
            loaded.rows += 1
            at = where(file, n, unit)
            loaded.add(n, _row(row, at, ctx, dirs, qtypes, loaded.benchmark), at, ctx.keep)
    if not qtypes and not any(p.extra.get("question_type") for _, p in loaded.prompts):
        loaded.notes.append("no question_type (row field or *_qtype.jsonl file): numerical "
                            "questions are recognised by their answer_eval ranges only")
    return loaded


def _row(row: dict, at: str, ctx: LoadContext, dirs: list[Path], qtypes: dict[str, str],
         bench: str) -> Prompt:
    rid = next((row[k] for k in ("data_id", "id") if not is_missing(row.get(k))), None)
    if rid is None:
        raise BadInput(f"{at}: data_id: missing required field")
    rid = str(rid)
    question = row.get("question")
    if not isinstance(question, str) or not question.strip():
        raise BadInput(f"{at}: question: missing question text")
    answers = answers_of(row.get("answer"))
    answer_eval = row.get("answer_eval")
    if not answers and isinstance(answer_eval, list):
        answers = [a for a in answer_eval if isinstance(a, str)]
    if not answers:
        raise BadInput(f"{at}: answer: missing gold answer")
    key = next((k for k in ("image_path", "image", "image_id") if not is_missing(row.get(k))),
               None)
    if key is None:
        raise BadInput(f"{at}: image_id: missing image name")
    image = row[key]
    shard = oven_shard(image) if isinstance(image, str) else None
    images = image_files(image, ctx, dirs, f"{at}: {key}", shard) if ctx.keep(rid) else []
    qtype = row.get("question_type") or qtypes.get(rid)
    extra = {k: v for k, v in row.items() if k not in _USED and jsonable(v)}
    extra.update(benchmark=bench, image_id=row.get("image_id"))
    if qtype:
        extra["question_type"] = str(qtype)
    category = str(qtype).lower() if qtype else row.get("data_split")
    return Prompt(id=rid, question=question.strip(), images=images, answer=answers,
                  base=dirs[0], category=category, extra=extra)


declare(
    Layout("infoseek", load, columns=((60, lambda cols, _s: "image_id" in cols and bool(
        cols & {"answer_eval", "data_split"})),)),
    Benchmark("infoseek", "InfoSeek", official="infoseek", release_folder="infoseek",
              needle="infoseek", categories="question type: string / numerical / time",
              paper=Paper(2000, mars=(61.70, 65.25), direct=(23.15, 28.95),
                          agent=(46.15, 49.85))),
)
