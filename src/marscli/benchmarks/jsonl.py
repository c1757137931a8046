"""JSONL benchmarks with an image folder: V* Bench and InfoSeek (and SimpleVQA / LiveVQA).

BENCH is the JSONL file, or a folder holding it. Image names in rows are looked up in
`--image-dir`, then the file's folder, then `images/` beside it (extensions .jpg, .jpeg,
.JPEG, .png, .webp tried when the name has none).

Assumed fields:
- vstar (craigwu/vstar_bench `test_questions.jsonl`): `image` (e.g.
  "direct_attributes/sa_4690.jpg"), `text` (the question with "(A) ..." option lines and an
  instruction line), `label` (the gold letter), `category` (direct_attributes /
  relative_position), `question_id`. Rows with explicit `options` (or `choices`) and
  `answer` are accepted too. The options are parsed out and re-rendered (common.py).
- infoseek (the official `infoseek_val.jsonl`): `data_id`, `image_id` (an OVEN image name,
  e.g. oven_05050169 → oven_05050169.jpg), `question`, `answer` (list), `answer_eval` (strings,
  or for numerical questions `[{"wikidata": v, "range": [lo, hi]}]`), `data_split`
  (val_unseen_question / val_unseen_entity). `question_type` (String / Numerical / Time) is
  read from the row, or from the sibling `*_qtype.jsonl` file the release ships
  (`{data_id, question_type}`); it is the item's category. `answer_eval`, `data_split` and
  `question_type` ride along for the official protocol.
- simplevqa, livevqa (JSONL; their layouts are assumptions): id from `data_id|id|
  question_id|sample_id`, question from `question|query`, image from `image|image_path|
  image_id|images`, gold from `answer|answers|gt_answer|ground_truth`, category from
  `category|original_category|topic`. SimpleVQA rows with a non-English `language` are
  skipped (SimpleVQA-en). A `.parquet` BENCH goes to the parquet reader.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from marscli.benchmarks import FORMATS
from marscli.benchmarks.common import (
    LoadContext,
    Loaded,
    answers_of,
    find_image,
    gold_letter,
    is_missing,
    jsonable,
    mcq_question,
    split_options,
)
from marscli.errors import BadInput
from marscli.records.jsonl import read_rows
from marscli.records.schema import Prompt

_DEFAULT_FILES = {"vstar": ("test_questions.jsonl",),
                  "infoseek": ("infoseek_val.jsonl", "infoseek_test.jsonl")}


def _jsonl_file(path: Path, fmt: str) -> Path:
    if not path.is_dir():
        return path
    for name in _DEFAULT_FILES.get(fmt, ()):
        if (path / name).is_file():
            return path / name
    files = [f for f in sorted(path.glob("*.jsonl")) if "qtype" not in f.name]
    if len(files) != 1:
        raise BadInput(f"{path}: expected one JSONL file in this folder, found "
                       f"{len(files)} — point at the file itself")
    return files[0]


def _image_dirs(file: Path, ctx: LoadContext) -> list[Path]:
    folder = file.resolve().parent
    return [d for d in (ctx.image_dir, folder, folder / "images") if d is not None]


def _get(row: dict, names: tuple[str, ...]) -> tuple[str | None, Any]:
    for n in names:
        if n in row and not is_missing(row[n]):
            return n, row[n]
    return None, None


def _add(loaded: Loaded, seen: dict, line: int, src: str, p: Prompt, ctx: LoadContext) -> None:
    if p.id in seen:
        raise BadInput(f"{src}:{line}: id: duplicate id {p.id!r} (first on line {seen[p.id]})")
    seen[p.id] = line
    if ctx.keep(p.id):
        loaded.prompts.append((line, p))


@FORMATS.register("vstar")
def load_vstar(path: Path, ctx: LoadContext, fmt: str = "vstar") -> Loaded:
    file = _jsonl_file(path, fmt)
    src, dirs = str(file), _image_dirs(file, ctx)
    loaded, seen = Loaded(ctx.benchmark or "vstar", fmt, []), {}
    for line, row in read_rows(src):
        loaded.rows += 1
        _, rid = _get(row, ("question_id", "id"))
        rid = f"vstar-{line}" if rid is None else str(rid)
        qkey, text = _get(row, ("text", "question"))
        if not isinstance(text, str):
            raise BadInput(f"{src}:{line}: text: missing question text")
        options = row.get("options", row.get("choices"))
        if isinstance(options, list) and options:
            stem, choices = split_options(text)[0], [str(o) for o in options]
        else:
            stem, choices = split_options(text)
        if len(choices) < 2:
            raise BadInput(f"{src}:{line}: {qkey}: no options — expected \"(A) ...\" lines in "
                           "the question, or an `options` list")
        akey, gold = _get(row, ("label", "answer"))
        letter = gold_letter(gold, len(choices), f"{src}:{line}: {akey or 'label'}")
        _, image = _get(row, ("image", "image_path"))
        if not isinstance(image, str):
            raise BadInput(f"{src}:{line}: image: missing image path")
        used = {"question_id", "id", "text", "question", "options", "choices", "label",
                "answer", "image", "image_path", "category"}
        extra = {k: v for k, v in row.items() if k not in used and jsonable(v)}
        extra["benchmark"] = loaded.benchmark
        category = row.get("category") or str(Path(image).parent) or None
        p = Prompt(id=rid, question=mcq_question(stem, choices), images=[
            str(find_image(image, dirs))], answer=[letter], base=dirs[0], choices=choices,
            category=None if category in (None, ".") else str(category), extra=extra)
        _add(loaded, seen, line, src, p, ctx)
    return loaded


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


@FORMATS.register("infoseek")
def load_infoseek(path: Path, ctx: LoadContext, fmt: str = "infoseek") -> Loaded:
    file = _jsonl_file(path, fmt)
    src, dirs = str(file), _image_dirs(file, ctx)
    qtypes = _qtypes(file)
    loaded, seen = Loaded(ctx.benchmark or "infoseek", fmt, []), {}
    for line, row in read_rows(src):
        loaded.rows += 1
        _, rid = _get(row, ("data_id", "id"))
        if rid is None:
            raise BadInput(f"{src}:{line}: data_id: missing required field")
        rid = str(rid)
        question = row.get("question")
        if not isinstance(question, str) or not question.strip():
            raise BadInput(f"{src}:{line}: question: missing question text")
        answers = answers_of(row.get("answer"))
        answer_eval = row.get("answer_eval")
        if not answers and isinstance(answer_eval, list):
            answers = [a for a in answer_eval if isinstance(a, str)]
        if not answers:
            raise BadInput(f"{src}:{line}: answer: missing gold answer")
        _, image = _get(row, ("image_path", "image", "image_id"))
        if not isinstance(image, str):
            raise BadInput(f"{src}:{line}: image_id: missing image name")
        qtype = row.get("question_type") or qtypes.get(rid)
        used = {"data_id", "id", "question", "answer", "image_path", "image", "image_id"}
        extra = {k: v for k, v in row.items() if k not in used and jsonable(v)}
        extra.update(benchmark=loaded.benchmark, image_id=row.get("image_id"))
        if qtype:
            extra["question_type"] = str(qtype)
        category = str(qtype).lower() if qtype else row.get("data_split")
        p = Prompt(id=rid, question=question.strip(), images=[str(find_image(image, dirs))],
                   answer=answers, base=dirs[0], category=category, extra=extra)
        _add(loaded, seen, line, src, p, ctx)
    if not qtypes and not any(p.extra.get("question_type") for _, p in loaded.prompts):
        loaded.notes.append("no question_type (row field or *_qtype.jsonl file): numerical "
                            "questions are recognised by their answer_eval ranges only")
    return loaded


def _load_generic(path: Path, ctx: LoadContext, fmt: str) -> Loaded:
    if path.suffix == ".parquet" or (path.is_dir() and (list(path.glob("*.parquet"))
                                                        or list(path.glob("data/*.parquet")))):
        from marscli.benchmarks.parquet import load as load_parquet

        return load_parquet(path, ctx, fmt)
    file = _jsonl_file(path, fmt)
    src, dirs = str(file), _image_dirs(file, ctx)
    loaded, seen = Loaded(ctx.benchmark or fmt, fmt, []), {}
    id_keys = ("data_id", "id", "question_id", "sample_id")
    q_keys, i_keys = ("question", "query"), ("image", "image_path", "image_id", "images")
    a_keys = ("answer", "answers", "gt_answer", "ground_truth")
    c_keys = ("category", "original_category", "topic")
    for line, row in read_rows(src):
        loaded.rows += 1
        if fmt == "simplevqa" and str(row.get("language", "EN")).upper() not in ("EN", "ENGLISH"):
            loaded.skipped["not English (SimpleVQA-en keeps the EN rows)"] = \
                loaded.skipped.get("not English (SimpleVQA-en keeps the EN rows)", 0) + 1
            continue
        _, rid = _get(row, id_keys)
        rid = f"{fmt}-{line}" if rid is None else str(rid)
        _, question = _get(row, q_keys)
        if not isinstance(question, str):
            raise BadInput(f"{src}:{line}: question: missing question text")
        _, gold = _get(row, a_keys)
        answers = answers_of(gold)
        if not answers:
            raise BadInput(f"{src}:{line}: answer: missing gold answer")
        _, image = _get(row, i_keys)
        images = image if isinstance(image, list) else [image]
        if not images or not all(isinstance(i, str) for i in images):
            raise BadInput(f"{src}:{line}: image: missing image path")
        _, category = _get(row, c_keys)
        used = {*id_keys, *q_keys, *i_keys, *a_keys, *c_keys}
        extra = {k: v for k, v in row.items() if k not in used and jsonable(v)}
        extra["benchmark"] = loaded.benchmark
        p = Prompt(id=rid, question=question.strip(), images=[str(find_image(i, dirs))
                                                             for i in images],
                   answer=answers, base=dirs[0],
                   category=None if category is None else str(category), extra=extra)
        _add(loaded, seen, line, src, p, ctx)
    return loaded


FORMATS.register("simplevqa")(_load_generic)
FORMATS.register("livevqa")(_load_generic)
