"""Parquet benchmarks: MMSearch, HR-MMSearch, FVQA-test (and SimpleVQA / LiveVQA as parquet).

Read with pyarrow (the `eval` extra), imported only here, streamed in row batches (HR-MMSearch
is 2 GB of images). BENCH is a parquet file or a folder of them (`data/*.parquet`, the Hugging
Face layout; files read in name order). Image cells may be `{bytes, path}` structs (the
`datasets` Image feature), raw bytes, a path (relative to the file's folder or `--image-dir`),
or a list of these; bytes are written once to the cache folder as `SHA256.EXT`.

Assumed columns (first present wins; a required one missing is an error naming the file):
- mmsearch (CaraJ/MMSearch, `end2end` config): `sample_id`, `query`, `query_image`,
  `gt_answer` + `alternative_gt_answers` (all gold), `area` as category (news / knowledge;
  `subfield` is carried along). Rows without `query_image` are text-only queries: skipped and
  counted (the paper evaluates the 171 image queries).
- hr-mmsearch (sensenova/HR-MMSearch): `sample_id`, `query`, `query_image`, `ground_truth`,
  `category`, `difficulty` (carried along).
- verl-style rows (MMSearch-R1's FVQA release is in this form): `prompt` (chat messages),
  `images`, `reward_model.ground_truth`, `image_search_title_list` / `_thumbnail_list`:
  converted like MARS rows.
- otherwise (fvqa, simplevqa, livevqa in a flat layout): id from `sample_id|id|data_id|
  question_id|index`, question from `query|question`, image from
  `query_image|image|images|image_path`, gold from `gt_answer|ground_truth|answer|answers`
  (+ `alternative_gt_answers`), category from `category|subfield|area|data_source`. For
  simplevqa, a `language` column keeps the English rows only (SimpleVQA-en). These generic
  layouts are assumptions: check the loaded counts against the paper's sizes.
Other JSON-able columns ride along into the records unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from marscli.benchmarks import FORMATS
from marscli.benchmarks.common import (
    LoadContext,
    Loaded,
    answers_of,
    cache_image,
    find_image,
    is_missing,
    jsonable,
)
from marscli.errors import BadInput
from marscli.records.schema import Prompt, parse_prompt

BATCH_ROWS = 16


@dataclass(frozen=True)
class Profile:
    ids: tuple[str, ...] = ("sample_id", "id", "data_id", "question_id", "index")
    questions: tuple[str, ...] = ("query", "question")
    images: tuple[str, ...] = ("query_image", "image", "images", "image_path")
    answers: tuple[str, ...] = ("gt_answer", "ground_truth", "answer", "answers")
    aliases: tuple[str, ...] = ("alternative_gt_answers",)
    categories: tuple[str, ...] = ("category", "subfield", "area", "data_source")
    skip_without_image: bool = False  # MMSearch: text-only queries are not in the paper's set


PROFILES = {
    "mmsearch": Profile(ids=("sample_id",), questions=("query",), images=("query_image",),
                        answers=("gt_answer",), categories=("area", "subfield"),
                        skip_without_image=True),
    "hr-mmsearch": Profile(ids=("sample_id",), questions=("query",), images=("query_image",),
                           answers=("ground_truth",), categories=("category",)),
}
_HEAVY = ("image_search_result",)  # MMSearch's screenshot columns: not read at all


def _pyarrow():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise BadInput('reading parquet benchmarks needs pyarrow: pip install "marscli[eval]" '
                       "(or pip install pyarrow)") from None
    return pq


def parquet_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(path.glob("*.parquet")) or sorted(path.glob("data/*.parquet"))
        if not files:
            raise BadInput(f"{path}: no .parquet files in this folder")
        return files
    return [path]


def parquet_columns(path: Path) -> list[str]:
    pq = _pyarrow()
    try:
        return list(pq.read_schema(path).names)
    except Exception as e:
        raise BadInput(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from None


def iter_parquet(path: Path, columns: list[str]) -> Iterator[dict]:
    pq = _pyarrow()
    try:
        pf = pq.ParquetFile(path)
        for batch in pf.iter_batches(batch_size=BATCH_ROWS, columns=columns):
            yield from batch.to_pylist()
    except Exception as e:
        raise BadInput(f"{path}: cannot read parquet ({type(e).__name__}: {e})") from None


def _first(row: dict, names: tuple[str, ...]) -> tuple[str | None, Any]:
    for n in names:
        if n in row and not is_missing(row[n]):
            return n, row[n]
    return None, None


def _image_paths(value: Any, ctx: LoadContext, folder: Path, where: str) -> list[str]:
    """Image cell(s) → file paths: bytes decoded into the cache, paths resolved."""
    if isinstance(value, (list, tuple)):
        return [p for v in value for p in _image_paths(v, ctx, folder, where)]
    if isinstance(value, dict):
        if value.get("bytes"):
            return [str(cache_image(bytes(value["bytes"]), ctx.cache_dir))]
        if value.get("path"):
            value = value["path"]
        else:
            raise BadInput(f"{where}: image cell has neither bytes nor a path")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return [str(cache_image(bytes(value), ctx.cache_dir))]
    if isinstance(value, str):
        dirs = [d for d in (ctx.image_dir, folder) if d is not None]
        return [str(find_image(value, dirs))]
    raise BadInput(f"{where}: image cell of type {type(value).__name__} — expected bytes, "
                   "a path, or {bytes, path}")


def load(path: Path, ctx: LoadContext, fmt: str) -> Loaded:
    prof = PROFILES.get(fmt, Profile())
    loaded = Loaded(ctx.benchmark or fmt, fmt, [], unit="row")
    seen: dict[str, str] = {}
    for file in parquet_files(path):
        cols = [c for c in parquet_columns(file) if c not in _HEAVY]
        verl = "prompt" in cols and "reward_model" in cols
        if not verl:
            for kind, names in (("question", prof.questions), ("answer", prof.answers),
                                ("image", prof.images)):
                if not set(names) & set(cols):
                    raise BadInput(f"{file}: no {kind} column — expected one of "
                                   f"{', '.join(names)} (columns: {', '.join(cols)})")
        for n, row in enumerate(iter_parquet(file, cols), start=1):
            loaded.rows += 1
            where = f"{file}: row {n}"
            item = (_verl_row if verl else _flat_row)(row, n, file, ctx, prof, loaded, where)
            if item is None:
                continue
            if item.id in seen:
                raise BadInput(f"{where}: id: duplicate id {item.id!r} (first at {seen[item.id]})")
            seen[item.id] = where
            if ctx.keep(item.id):
                loaded.prompts.append((n, item))
    return loaded


def _skip(loaded: Loaded, reason: str) -> None:
    loaded.skipped[reason] = loaded.skipped.get(reason, 0) + 1


def _flat_row(row: dict, n: int, file: Path, ctx: LoadContext, prof: Profile, loaded: Loaded,
              where: str) -> Prompt | None:
    name = loaded.benchmark
    _, rid = _first(row, prof.ids)
    rid = f"{name}-{n}" if rid is None else str(rid)
    qcol, question = _first(row, prof.questions)
    if not isinstance(question, str):
        raise BadInput(f"{where}: {qcol or prof.questions[0]}: missing question text")
    _, gold = _first(row, prof.answers)
    answers = answers_of(gold)
    for alias in prof.aliases:
        answers += [a for a in answers_of(row.get(alias)) if a not in answers]
    if not answers:
        raise BadInput(f"{where}: {prof.answers[0]}: missing gold answer")
    if loaded.fmt == "simplevqa" and str(row.get("language", "EN")).upper() not in ("EN",
                                                                                   "ENGLISH"):
        _skip(loaded, "not English (SimpleVQA-en keeps the EN rows)")
        return None
    icol, image = _first(row, prof.images)
    if image is None:
        if prof.skip_without_image:
            _skip(loaded, "text-only queries (no query_image)")
            return None
        raise BadInput(f"{where}: {prof.images[0]}: missing image")
    images = _image_paths(image, ctx, file.parent, f"{where}: {icol}") if ctx.keep(rid) else []
    _, category = _first(row, prof.categories)
    used = {*prof.ids, *prof.questions, *prof.images, *prof.answers, *prof.aliases}
    extra = {k: v for k, v in row.items() if k not in used and jsonable(v)}
    extra["benchmark"] = name
    return Prompt(id=rid, question=question.strip(), images=images, answer=answers,
                  base=file.parent, category=None if category is None else str(category),
                  extra=extra)


def _verl_row(row: dict, n: int, file: Path, ctx: LoadContext, prof: Profile, loaded: Loaded,
              where: str) -> Prompt:
    """A verl/MARS-style row: images decoded, then converted like the release's rows."""
    info = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
    _, rid = _first(row, ("id", "sample_id", "data_id"))
    if rid is None:
        rid = info.get("index")
    rid = f"{loaded.benchmark}-{n}" if is_missing(rid) else str(rid)
    keep = ctx.keep(rid)
    images = row.get("images", row.get("image"))
    if is_missing(images) or images == []:
        raise BadInput(f"{where}: images: missing image")
    conv = {k: v for k, v in row.items() if k not in ("images", "image") and jsonable(v)}
    paths = _image_paths(images, ctx, file.parent, f"{where}: images") if keep else ["-"]
    thumbs = row.get("image_search_thumbnail_list")
    if isinstance(thumbs, list) and keep:  # strings stay as they are (relative to the file)
        conv["image_search_thumbnail_list"] = [
            t if isinstance(t, str) else _image_paths(t, ctx, file.parent,
                                                      f"{where}: thumbnails")[0]
            for t in thumbs]
    conv.update(id=rid, image=paths)
    p = parse_prompt(conv, str(file), n, file.parent)
    p.extra.pop("id", None)
    p.extra["benchmark"] = loaded.benchmark
    return p


for _fmt in ("mmsearch", "hr-mmsearch", "fvqa"):
    FORMATS.register(_fmt)(load)
