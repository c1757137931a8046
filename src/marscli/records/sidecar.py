"""The sidecar `OUT.meta.json`, a stage's last file: what the output was made from.

`write_sidecar(OUT, ...)` writes it atomically: the stage, its command line, marscli's version,
seed and (redacted) config, the inputs' sha256 as they were read (`provenance.Inputs.sha256`),
wall time and statistics. Skipped when OUT is stdout; either way it ends the stage's memory of
its inputs.
"""

from __future__ import annotations

import sys
import time

import orjson

from marscli import __version__
from marscli.records.jsonl import SCHEMA_VERSION
from marscli.records.outputs import AtomicFile
from marscli.records.provenance import current_inputs
from marscli.secrets import redact


def write_sidecar(out: str, *, stage: str, seed: int | None = None, config: dict | None = None,
                  inputs: list[str] | tuple[str, ...] = (), stats: dict | None = None,
                  started: float | None = None) -> None:
    """Write `OUT.meta.json`: provenance and statistics, the inputs' hashes as they were read.
    Skipped when OUT is stdout. Ends the stage's memory of its inputs."""
    read = current_inputs()
    if out == "-":
        read.forget()
        return
    hashes = {p: read.sha256(p) for p in inputs}
    meta = {
        "v": SCHEMA_VERSION,
        "stage": stage,
        "command": sys.argv,
        "marscli": __version__,
        "seed": seed,
        "config": config or {},
        "inputs": {p: h for p, h in hashes.items() if h is not None},
        "wall_s": round(time.time() - started, 3) if started else None,
        "stats": stats or {},
    }
    try:
        with AtomicFile(f"{out}.meta.json") as fh:
            fh.write(orjson.dumps(redact(meta),
                                  option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
    finally:
        read.forget()
