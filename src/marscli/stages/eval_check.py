"""`marscli eval BENCH --check`: a benchmark as evaluation would read it, with no model.

The benchmark is loaded by the same loader `eval` uses (`--format`, `--split`,
`--image-dir`, `--benchmark`), every image is resolved and opened (base64 and parquet bytes
decoded into the cache as evaluation would: `eval-images/` beside `-o RESULTS` when given,
else `$MARSCLI_CACHE_DIR/eval-images` or `~/.cache/marscli/eval-images`), and the normalised
rows go to stdout as JSONL in marscli's prompt form — `v`, `id`, `question`, `answer` (a
list), `choices`, `category`, `image` (absolute paths), `benchmark`, `split` and
`image_search` where present — so `eval --check > rows.jsonl` is itself a prompt file. A
summary goes to stderr (rows, kept, skipped by reason, multiple choice, categories, split).

The first unreadable row (a missing gold answer included), missing image or image the
processor refuses (aspect ratio over 200:1) exits 2 with one line naming the file, the row and
the field, at most 200 characters (`error: ` included; long paths shortened to `.../NAME`
first): never a base64 blob, never a traceback. Nothing goes to stdout then.
"""

from __future__ import annotations

import os
import re
import sys
from collections import Counter
from pathlib import Path
from typing import IO

from marscli.agent.runner import check_images
from marscli.benchmarks import LoadContext, Loaded, load_benchmark
from marscli.errors import BadInput
from marscli.records.jsonl import dumps
from marscli.records.schema import Prompt
from marscli.stages.eval import image_cache

MAX_ERROR = 200 - len("error: ")  # the CLI prints `error: MESSAGE` on one line
# a path in a message: anything with a slash up to a space, a colon (FILE:LINE) or a quote
_PATH = re.compile(r"[^\s:'\"()\[\],]*/[^\s:'\"()\[\],]+")


def default_cache() -> Path:
    root = os.environ.get("MARSCLI_CACHE_DIR") or Path.home() / ".cache" / "marscli"
    return Path(root) / "eval-images"


def one_line(msg: str, limit: int = MAX_ERROR) -> str:
    """`msg` on one line of at most `limit` characters. Long paths go first (the longest
    becomes `.../NAME`, keeping the file's name), so the row and field after a path stay;
    only then is the tail cut."""
    msg = " ".join(msg.split())
    while len(msg) > limit:
        paths = [m for m in _PATH.finditer(msg) if _short_path(m[0]) != m[0]]
        if not paths:
            break
        m = max(paths, key=lambda m: len(m[0]))
        msg = msg[:m.start()] + _short_path(m[0]) + msg[m.end():]
    return msg if len(msg) <= limit else msg[:limit - 3] + "..."


def _short_path(path: str) -> str:
    folder, _, name = path.rstrip("/").rpartition("/")
    return ".../" + name if folder and len(path) > len(name) + 4 else path


def normalised(p: Prompt) -> dict:
    """A loaded row in marscli's prompt form, image paths absolute."""
    paths = [str(x.resolve()) for x in p.image_paths()]
    row = {"v": 1, "id": p.id, "question": p.question, "answer": p.answer,
           "choices": p.choices, "category": p.category,
           "image": paths[0] if len(paths) == 1 else paths,
           "benchmark": p.extra.get("benchmark")}
    if p.extra.get("split"):
        row["split"] = p.extra["split"]
    if p.image_search:
        row["image_search"] = p.image_search
    return row


def report(loaded: Loaded) -> dict:
    prompts = [p for _, p in loaded.prompts]
    cats = Counter(p.category or "-" for p in prompts)
    return {"benchmark": loaded.benchmark, "format": loaded.fmt, "split": loaded.split,
            "rows": loaded.rows, "kept": len(prompts), "skipped": dict(loaded.skipped),
            "multiple_choice": sum(bool(p.choices) for p in prompts),
            "categories": dict(sorted(cats.items())), "notes": list(loaded.notes)}


def print_report(rep: dict, err: IO[str]) -> None:
    skipped = ", ".join(f"{v} {k}" for k, v in rep["skipped"].items()) or "none"
    cats = ", ".join(f"{k} {v}" for k, v in rep["categories"].items())
    print(f"check: {rep['benchmark']} ({rep['format']} format, split "
          f"{rep['split'] or '-'}): {rep['rows']} rows, {rep['kept']} kept, skipped: "
          f"{skipped}", file=err)
    print(f"check: {rep['multiple_choice']} multiple-choice; categories: {cats or '-'}",
          file=err)
    for note in rep["notes"]:
        print(f"note: {note}", file=err)


def run_check(bench: str, *, fmt: str = "auto", benchmark: str | None = None,
              image_dir: str | None = None, split: str | None = None,
              output: str | None = None, out: IO[bytes] | None = None,
              err: IO[str] | None = None) -> dict:
    """Load and check BENCH, print its normalised rows (module docstring); return the
    summary."""
    cache = image_cache(output) if output else default_cache()
    ctx = LoadContext(source=bench, cache_dir=cache, benchmark=benchmark, split=split,
                      image_dir=Path(image_dir) if image_dir else None)
    try:
        loaded = load_benchmark(bench, fmt, ctx)
        if not loaded.rows:
            raise BadInput(f"{bench}: no rows")
        check_images(bench, loaded.prompts, loaded.unit, loaded.where)
    except BadInput as e:
        raise BadInput(one_line(str(e))) from None
    if loaded.split:
        for _, p in loaded.prompts:
            p.extra["split"] = loaded.split
    stream = out or sys.stdout.buffer
    for _, p in loaded.prompts:
        stream.write(dumps(normalised(p)))
    stream.flush()
    rep = report(loaded)
    print_report(rep, err or sys.stderr)
    return rep
