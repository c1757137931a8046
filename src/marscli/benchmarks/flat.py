"""One open question per row, in named columns: MMSearch, HR-MMSearch, FVQA, SimpleVQA,
LiveVQA, MAT-Search — in any container (`containers.py`: parquet, JSONL, a JSON array, TSV,
or a folder of them, one split only).

Image cells may be `{bytes, path}` structs (the `datasets` Image feature), raw bytes, a
base64 string (SimpleVQA), or a path — relative to `--image-dir`, the file's folder or the
benchmark's own image folder, or an absolute path of the authors' (LiveVQA), then looked up
by its file name; bytes are written once to the cache folder as `SHA256.EXT`.

Columns per format (first present wins; a required one missing is an error naming the file);
docs/evaluation.md has the table of where each layout comes from:
- mmsearch (CaraJ/MMSearch `end2end.parquet`): `sample_id`, `query`, `query_image`,
  `gt_answer` + `alternative_gt_answers` (all gold), `area` as category (news / knowledge;
  `subfield` rides along). Rows without `query_image` are text-only queries: skipped and
  counted (the paper evaluates the 171 image queries). The screenshot columns
  (`image_search_result`) are never read.
- hr-mmsearch (sensenova/HR-MMSearch): `sample_id`, `query`, `query_image`, `ground_truth`,
  `category`, `difficulty` (rides along).
- fvqa (lmms-lab/FVQA `fvqa_test.parquet` beside `fvqa_train.parquet`: the test split unless
  `--split`): verl-style rows (`prompt` chat messages, `images`, `reward_model.ground_truth`,
  `extra_info.index`, `image_search_title_list` / `_thumbnail_list`), converted like MARS rows;
  flat rows are read with the generic columns below.
- simplevqa (m-a-p/SimpleVQA, HF parquet): `data_id`, `image` (base64 in the release's own
  files, an Image struct in the HF parquet), `question`, `answer`, `original_category`
  (category), `language` (rows not EN are skipped and counted: SimpleVQA-en), and
  `image_description`, `source`, `atomic_question`, `atomic_fact`, `vqa_category` ride along.
- livevqa (the research preview's `qa.json`, a JSON array; images in `image/` beside it):
  `query_image` (the authors' absolute paths: found by file name), the question from
  `query|question`, gold from `gt_answer|answer|answers`, category from `topic|category`.
- mat-search (MAT `MAT-Search.json`, a JSON array; images in `MAT-Search-image/` beside it, as
  the benchmark's own evaluation script joins them): `id`, `question`, `answer` (a string),
  `image_path`.
- otherwise: id from `sample_id|id|data_id|question_id|index`, question from
  `query|question`, image from `query_image|image|images|image_path`, gold from
  `gt_answer|ground_truth|answer|answers` (+ `alternative_gt_answers`), category from
  `category|original_category|topic|subfield|area|data_source`.
Other JSON-able columns ride along into the records unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from marscli.benchmarks.common import (
    LoadContext,
    Loaded,
    answers_of,
    clip,
    image_dirs,
    image_files,
    is_missing,
    jsonable,
)
from marscli.benchmarks.containers import columns_of, data_files, iter_file, unit_of, where
from marscli.benchmarks.facts import Benchmark, Layout, Paper, declare
from marscli.errors import BadInput
from marscli.records.schema import Prompt, parse_prompt


@dataclass(frozen=True)
class Profile:
    ids: tuple[str, ...] = ("sample_id", "id", "data_id", "question_id", "index")
    questions: tuple[str, ...] = ("query", "question")
    images: tuple[str, ...] = ("query_image", "image", "images", "image_path")
    answers: tuple[str, ...] = ("gt_answer", "ground_truth", "answer", "answers")
    aliases: tuple[str, ...] = ("alternative_gt_answers",)
    categories: tuple[str, ...] = ("category", "original_category", "topic", "subfield", "area",
                                   "data_source")
    image_dirs: tuple[str, ...] = ("images", "image")  # folders beside the file
    skip_without_image: bool = False  # MMSearch: text-only queries are not in the paper's set
    english_only: bool = False  # SimpleVQA-en: rows whose `language` is not EN are skipped


PROFILES = {
    "mmsearch": Profile(ids=("sample_id",), questions=("query",), images=("query_image",),
                        answers=("gt_answer",), categories=("area", "subfield"),
                        skip_without_image=True),
    "hr-mmsearch": Profile(ids=("sample_id",), questions=("query",), images=("query_image",),
                           answers=("ground_truth",), categories=("category",)),
    "simplevqa": Profile(ids=("data_id", "id", "index"), questions=("question",),
                         images=("image", "image_path"), answers=("answer", "answers"),
                         categories=("original_category", "category", "vqa_category"),
                         english_only=True),
    "livevqa": Profile(ids=("id", "sample_id", "data_id", "question_id", "index"),
                       questions=("query", "question"), images=("query_image", "image",
                                                                  "image_path", "images"),
                       answers=("gt_answer", "answer", "answers", "ground_truth"),
                       categories=("topic", "category", "source")),
    "mat-search": Profile(ids=("id",), questions=("question",), images=("image_path", "image"),
                          answers=("answer",), categories=("category",),
                          image_dirs=("MAT-Search-image", "images")),
}
_HEAVY = ("image_search_result",)  # MMSearch's screenshot columns: not read at all


def _first(row: dict, names: tuple[str, ...]) -> tuple[str | None, Any]:
    for n in names:
        if n in row and not is_missing(row[n]):
            return n, row[n]
    return None, None


def load(path: Path, ctx: LoadContext, fmt: str) -> Loaded:
    prof = PROFILES.get(fmt, Profile())
    files, split = data_files(path, ctx.split)
    loaded = Loaded(ctx.benchmark or fmt, fmt, [], unit=unit_of(files[0]), split=split)
    for file in files:
        cols = [c for c in columns_of(file) if c not in _HEAVY]
        verl = "prompt" in cols and "reward_model" in cols
        if not verl:
            for kind, names in (("question", prof.questions), ("answer", prof.answers),
                                ("image", prof.images)):
                if not set(names) & set(cols):
                    raise BadInput(f"{file}: no {kind} column — expected one of "
                                   f"{', '.join(names)} (columns: {clip(', '.join(cols), 120)})")
        dirs = image_dirs(ctx, file, prof.image_dirs)
        unit = unit_of(file)
        columns = cols if file.suffix.lower() == ".parquet" else None
        for n, row in iter_file(file, columns):
            loaded.rows += 1
            at = where(file, n, unit)
            row = {k: v for k, v in row.items() if k not in _HEAVY}
            item = (_verl_row if verl else _flat_row)(row, n, file, ctx, prof, loaded, at, dirs)
            if item is not None:
                loaded.add(n, item, at, ctx.keep)
    return loaded


def _flat_row(row: dict, n: int, file: Path, ctx: LoadContext, prof: Profile, loaded: Loaded,
              at: str, dirs: list[Path]) -> Prompt | None:
    name = loaded.benchmark
    _, rid = _first(row, prof.ids)
    rid = f"{name}-{n}" if rid is None else str(rid)
    qcol, question = _first(row, prof.questions)
    if not isinstance(question, str):
        raise BadInput(f"{at}: {qcol or prof.questions[0]}: missing question text")
    _, gold = _first(row, prof.answers)
    answers = answers_of(gold)
    for alias in prof.aliases:
        answers += [a for a in answers_of(row.get(alias)) if a not in answers]
    if not answers:
        raise BadInput(f"{at}: {prof.answers[0]}: missing gold answer")
    if prof.english_only and str(row.get("language", "EN")).upper() not in ("EN", "ENGLISH"):
        loaded.skip("not English (SimpleVQA-en keeps the EN rows)")
        return None
    icol, image = _first(row, prof.images)
    if image is None or image == []:
        if prof.skip_without_image:
            loaded.skip("text-only queries (no query_image)")
            return None
        raise BadInput(f"{at}: {prof.images[0]}: missing image")
    images = image_files(image, ctx, dirs, f"{at}: {icol}") if ctx.keep(rid) else []
    _, category = _first(row, prof.categories)
    used = {*prof.ids, *prof.questions, *prof.images, *prof.answers, *prof.aliases}
    extra = {k: v for k, v in row.items() if k not in used and jsonable(v)}
    extra["benchmark"] = name
    return Prompt(id=rid, question=question.strip(), images=images, answer=answers,
                  base=dirs[0], category=None if category is None else str(category),
                  extra=extra)


def _verl_row(row: dict, n: int, file: Path, ctx: LoadContext, prof: Profile, loaded: Loaded,
              at: str, dirs: list[Path]) -> Prompt:
    """A verl/MARS-style row: images decoded, then converted like the release's rows."""
    info = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
    _, rid = _first(row, ("id", "sample_id", "data_id", "index"))
    if rid is None:
        rid = info.get("index")
    rid = f"{loaded.benchmark}-{n}" if is_missing(rid) else str(rid)
    keep = ctx.keep(rid)
    images = row.get("images", row.get("image"))
    if is_missing(images) or images == []:
        raise BadInput(f"{at}: images: missing image")
    conv = {k: v for k, v in row.items() if k not in ("images", "image") and jsonable(v)}
    paths = image_files(images, ctx, dirs, f"{at}: images") if keep else ["-"]
    thumbs = row.get("image_search_thumbnail_list")
    if isinstance(thumbs, list) and keep:  # strings stay as they are (relative to the file)
        conv["image_search_thumbnail_list"] = [
            t if isinstance(t, str) else image_files(t, ctx, dirs, f"{at}: thumbnails")[0]
            for t in thumbs]
    conv.update(id=rid, image=paths)
    p = parse_prompt(conv, str(file), n, file.resolve().parent)
    p.extra.pop("id", None)
    p.extra["benchmark"] = loaded.benchmark
    return p


# Columns only MMSearch's end2end file has: LiveVQA's rows share its `query` + `gt_answer`.
_MMSEARCH_OWN = {"sample_id", "alternative_gt_answers", "area", "subfield"}

declare(
    # MAT-Search's and LiveVQA's file names come before the columns: LiveVQA's look like
    # MMSearch's; the column rules' ranks interleave with the other modules' (docs/evaluation.md)
    Layout("mmsearch", load, columns=((50, lambda cols, _s: {"query", "gt_answer"} <= cols and (
        bool(cols & _MMSEARCH_OWN) or "query_image" not in cols)),)),
    Layout("hr-mmsearch", load,
           columns=((30, lambda cols, _s: {"query", "ground_truth"} <= cols),)),
    Layout("fvqa", load),
    Layout("simplevqa", load, columns=((70, lambda cols, _s: bool(
        cols & {"atomic_fact", "atomic_question", "vqa_category"})),)),
    Layout("mat-search", load, files=("MAT-Search.json",)),
    Layout("livevqa", load, files=("qa.json",),
           columns=((80, lambda cols, _s: "query_image" in cols and "prompt" not in cols),)),
    Benchmark("mmsearch", "MMSearch", official="token_f1",
              release_folder="mmsearch_end2end_only_image", needle="mmsearch",
              categories="area: news / knowledge",
              paper=Paper(171, mars=(67.84, 74.27), direct=(11.70, 16.96), agent=(47.37, 49.12))),
    Benchmark("hr-mmsearch", "HR-MMSearch", release_folder="hr_mmsearch", needle="hrmmsearch",
              categories="category",
              paper=Paper(305, mars=(41.64, 54.43), direct=(12.13, 19.02), agent=(27.87, 34.43))),
    Benchmark("fvqa", "FVQA-test", release_folder="fvqa_test", needle="fvqa",
              categories="the rows' own category, if any",
              paper=Paper(1800, mars=(67.11, 72.61), direct=(24.22, 32.17),
                          agent=(53.61, 54.28))),
    Benchmark("simplevqa", "SimpleVQA-en", release_folder="simplevqa_en", needle="simplevqa",
              categories="original_category",
              paper=Paper(1013, mars=(70.19, 74.14), direct=(42.94, 45.90),
                          agent=(62.29, 64.17))),
    Benchmark("livevqa", "LiveVQA", release_folder="livevqa_research_preview",
              needle="livevqa", categories="topic",
              paper=Paper(3602, mars=(56.22, 60.83), direct=(23.18, 31.59),
                          agent=(39.37, 42.87))),
    Benchmark("mat-search", "MAT-Search", release_folder="mat_search", needle="matsearch",
              categories="the rows' own category, if any",
              paper=Paper(150, mars=(84.67, 86.67), direct=(67.33, 72.67), agent=(84.00, 82.00))),
)
