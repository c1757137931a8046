"""`marscli index text|images SOURCE -o INDEX [--force]`: build one search index file (SQLite),
then its sidecar; how many documents or images on stderr. An existing INDEX is replaced only
with `--force`, and never when it is one of the inputs (the corpus, an image). The indexes are
search/'s (`text_index`: FTS5 BM25; `image_index`: perceptual hashes)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

from marscli.errors import BadInput
from marscli.records.provenance import check_not_input, note_inputs, stage_inputs
from marscli.records.sidecar import write_sidecar


@stage_inputs()
def text(corpus: str, output: str, force: bool = False) -> int:
    """Index rows {id, title, text} (or Search-R1's {id, contents}) for `local:INDEX`."""
    from marscli.search.text_index import build_text_index

    return build("index text", build_text_index, corpus, output, "documents", force)


@stage_inputs()
def images(source: str, output: str, force: bool = False) -> int:
    """Index a folder of images, or JSONL rows {path, title}, for `--image-search local:INDEX`."""
    from marscli.search.image_index import build_image_index

    return build("index images", build_image_index, source, output, "images", force)


def build(stage: str, build_index: Callable[[str, str], int], source: str, output: str,
          unit: str, force: bool = False) -> int:
    """Build one index file, then its sidecar; `unit`: what the index counts."""
    if output == "-":
        raise BadInput("-o -: an index is a SQLite file, not a stream — name a file")
    note_inputs(source)  # (its images are noted as they are hashed)
    check_not_input(output)
    if Path(output).exists() and not Path(output).is_dir() and not force:
        raise BadInput(f"-o: {output}: already exists — pass --force to replace it, or pick "
                       "another file")
    t0 = time.time()
    n = build_index(source, output)
    write_sidecar(output, stage=stage, inputs=[source], stats={unit: n}, started=t0)
    print(f"indexed {n:,} {unit} into {output}", file=sys.stderr)
    return n
