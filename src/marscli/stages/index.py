"""`marscli index text|images SOURCE -o INDEX`: build one search index file (SQLite), then its
sidecar; how many documents or images on stderr. The indexes are search/'s (`text_index`: FTS5
BM25; `image_index`: perceptual hashes)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from marscli.errors import BadInput
from marscli.records.provenance import stage_inputs, write_sidecar


@stage_inputs()
def text(corpus: str, output: str) -> int:
    """Index rows {id, title, text} (or Search-R1's {id, contents}) for `local:INDEX`."""
    from marscli.search.text_index import build_text_index

    return build("index text", build_text_index, corpus, output, "documents")


@stage_inputs()
def images(source: str, output: str) -> int:
    """Index a folder of images, or JSONL rows {path, title}, for `--image-search local:INDEX`."""
    from marscli.search.image_index import build_image_index

    return build("index images", build_image_index, source, output, "images")


def build(stage: str, build_index: Callable[[str, str], int], source: str, output: str,
          unit: str) -> int:
    """Build one index file, then its sidecar; `unit`: what the index counts."""
    if output == "-":
        raise BadInput("-o -: an index is a SQLite file, not a stream — name a file")
    t0 = time.time()
    n = build_index(source, output)
    write_sidecar(output, stage=stage, inputs=[source], stats={unit: n}, started=t0)
    print(f"indexed {n:,} {unit} into {output}", file=sys.stderr)
    return n
