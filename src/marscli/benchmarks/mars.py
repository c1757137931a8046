"""`--format mars`: the release's evaluation folders, and any marscli/MARS prompt JSONL.

The release ships each benchmark as `data/eval/NAME/data.jsonl` plus its images (test_all.json
names ten of them: mmsearch_end2end_only_image, hr_mmsearch, vstar_bench, hr_bench_4k,
hr_bench_8k, mat_search, infoseek, fvqa_test, simplevqa_en, livevqa_research_preview). Rows are
MARS-style (`prompt` chat messages, `image`, `reward_model.ground_truth`, precomputed
`image_search_title_list` / `image_search_thumbnail_list`) and `records.parse_prompt` converts
them; marscli's own rows (`{id, image, question, answer, choices?, category?}`) work too.
Image paths are relative to the file's folder (`--image-dir` overrides). Any container
(`containers.py`) holds them: JSONL, a JSON array, parquet.

The benchmark name is, in order: the row's `benchmark` field, `--benchmark`, the release folder
name (`hr_bench_8k` → hrbench-8k), the file or folder name. Multiple-choice benchmarks whose
rows carry no `choices` (the release's V* and HR-Bench rows put the options in the question
text) get them parsed from the question's "(A) ..." / "A. ..." lines when it has them; the
question itself is left as the release wrote it.
"""

from __future__ import annotations

from pathlib import Path

from marscli.benchmarks.common import LoadContext, Loaded, split_options
from marscli.benchmarks.containers import data_files, iter_file, unit_of, where
from marscli.benchmarks.facts import Layout, benchmark_info, declare, guess_name
from marscli.records.schema import parse_prompt


def load(path: Path, ctx: LoadContext, fmt: str = "mars") -> Loaded:
    if path.is_dir() and (path / "data.jsonl").is_file():
        path = path / "data.jsonl"
    files, split = data_files(path, ctx.split)
    name = ctx.benchmark or guess_name(files[0]) or files[0].resolve().parent.name
    loaded = Loaded(name, fmt, [], unit=unit_of(files[0]), split=split)
    for file in files:
        base = ctx.image_dir.resolve() if ctx.image_dir else file.resolve().parent
        unit = unit_of(file)
        for n, row in iter_file(file):
            loaded.rows += 1
            p = parse_prompt(row, str(file), n, base)
            bench = row.get("benchmark") if isinstance(row.get("benchmark"), str) else name
            p.extra["benchmark"] = bench
            if p.choices is None and benchmark_info(bench).multiple_choice:
                _, options = split_options(p.question)
                p.choices = options or None
            loaded.add(n, p, where(file, n, unit), ctx.keep)
    return loaded


declare(Layout(
    "mars", load, folder_files=("data.jsonl",),
    # MARS / verl rows, marscli's own rows: before every other layout's columns
    columns=((0, lambda cols, suffix: suffix in (".jsonl", ".json")
              and ("prompt" in cols or "v" in cols)),)))
