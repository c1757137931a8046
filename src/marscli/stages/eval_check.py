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

import sys
from pathlib import Path
from typing import IO

from marscli.agent.runner import check_images
from marscli.benchmarks import LoadContext, load_benchmark
from marscli.errors import BadInput
from marscli.evaluation.check import normalised, one_line, print_report, report
from marscli.evaluation.paths import default_cache, image_cache
from marscli.records.jsonl import dumps


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

