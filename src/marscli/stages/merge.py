"""`marscli merge OUT SHARD...`: join the shards of a rollout or eval array job.

- Refuses duplicate ids (two shards that overlap would double-count samples), keeps the shards'
  order, writes OUT atomically with a sidecar, and removes nothing: delete the shards yourself
  once you are happy with OUT.
- Skips what a shard's glob also matches but is not a shard (`merge OUT OUT.shard-*`, as
  stages/rollout.sh and eval.sh document): the sidecars `*.meta.json`, rollout's and eval's
  `*.settings.json`, eval's `*.summary.json`, `*.lock` files, `*.tmp-PID` leftovers and
  folders (a shard's `.media/`). The skipped names are in the sidecar's stats.
- Merges finished shards only, all checked before anything is written: a shard whose writer
  still holds its lock is refused (exit 1: wait for it), and so is one without its sidecar
  `SHARD.meta.json` (its writer was killed or failed: exit 1), since make takes OUT for the
  whole iteration. `--allow-partial` merges such a finished-or-dead shard knowingly, its torn
  last line (from a kill) dropped, and the sidecar names it under `partial`.
- The sidecar lists each shard's records, sha256 (of the bytes merged) and whether it was
  complete.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

from marscli.errors import BadInput, RuntimeFailure
from marscli.records.jsonl import get_field, iter_rows
from marscli.records.outputs import AtomicJsonl, live_writer
from marscli.records.provenance import current_inputs, stage_inputs, write_sidecar

COMPANIONS = (".meta.json", ".settings.json", ".summary.json", ".lock")  # beside a data file
_TMP = re.compile(r"\.tmp-\d+$")


def is_companion(path: str) -> bool:
    """A sidecar, lock, temporary or media folder beside a shard, not a shard itself."""
    return path.endswith(COMPANIONS) or bool(_TMP.search(path)) or Path(path).is_dir()


def _same(a: str, b: str) -> bool:
    """The same file (a link included), or the same name."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return Path(a).resolve() == Path(b).resolve()


def unfinished(shards: list[str], allow_partial: bool) -> list[str]:
    """The shards without their sidecar (allowed with `allow_partial`); RuntimeFailure naming
    the first shard still being written, or (without `allow_partial`) the first without its
    sidecar."""
    partial = []
    for path in shards:
        pid = live_writer(path)
        if pid is not None:
            raise RuntimeFailure(f"{path}: still being written (pid {pid} holds its lock) — wait "
                                 "for that shard's job to end, then merge")
        if Path(path).is_file() and not Path(f"{path}.meta.json").is_file():
            partial.append(path)
    if partial and not allow_partial:
        more = f" (and {len(partial) - 1} more)" if len(partial) > 1 else ""
        raise RuntimeFailure(f"{partial[0]}: no sidecar {Path(partial[0]).name}.meta.json{more} "
                             "— its job was killed or failed before it finished: re-run that "
                             "shard, or add --allow-partial to merge what is there")
    return partial


@stage_inputs()
def merge(out: str, shards: list[str], allow_partial: bool = False) -> dict:
    """Join `shards` (companions skipped) into `out`; return the sidecar statistics. Every
    shard must be finished (`unfinished`), unless `allow_partial`."""
    started = time.time()
    skipped = [s for s in shards if is_companion(s)]
    shards = [s for s in shards if not is_companion(s)]
    if not shards:
        raise BadInput("merge: give at least one shard file"
                       + (f" ({len(skipped)} sidecar or media names skipped)" if skipped else ""))
    for path in shards:  # before the shards' own checks: this one is the user's to fix
        if out != "-" and _same(path, out):
            raise BadInput(f"{path}: is the output being written ({out}) — an output cannot be "
                           "one of the inputs: pick another output")
    partial = unfinished(shards, allow_partial)
    seen: dict[str, str] = {}
    counts: dict[str, int] = {}
    torn: dict[str, int] = {}

    def drop(path: str) -> Callable[[int, bytes], None] | None:
        if path not in partial:
            return None  # a finished shard with a torn line is bad input, as ever
        return lambda line, raw: torn.__setitem__(path, line)

    with AtomicJsonl(out) as w:
        for path in shards:
            n = 0
            for line, row in iter_rows(path, on_torn=drop(path)):
                rid = get_field(row, "id", str, path, line)
                if rid in seen:
                    raise BadInput(f"{path}:{line}: id: duplicate id {rid!r} (also in {seen[rid]})")
                seen[rid] = f"{path}:{line}"
                w.write(row)
                n += 1
            counts[path] = n
    read = current_inputs()
    per_shard = {p: {"records": counts[p], "sha256": read.sha256(p), "complete": p not in partial}
                 for p in shards}
    for path, line in torn.items():
        print(f"warning: {path}:{line}: dropped a torn last record (its writer was killed)",
              file=sys.stderr)
    stats = {"records": len(seen), "shards": per_shard, "partial": partial,
             "torn_dropped": len(torn), "skipped": skipped}
    write_sidecar(out, stage="merge", config={"allow_partial": allow_partial}, inputs=shards,
                  stats=stats, started=started)
    return stats


def main(out: str, shards: list[str], allow_partial: bool = False) -> dict:
    """`merge`, then one line on stderr."""
    stats = merge(out, shards, allow_partial)
    skipped = (f" (skipped {len(stats['skipped'])} sidecar or media names)"
               if stats["skipped"] else "")
    partial = (f"; {len(stats['partial'])} of them unfinished (--allow-partial)"
               if stats["partial"] else "")
    print(f"merged {stats['records']:,} records from {len(stats['shards'])} shard(s) into "
          f"{out}{skipped}{partial}", file=sys.stderr)
    return stats
