"""`marscli merge OUT SHARD...`: join the shards of a rollout or eval array job.

- Refuses duplicate ids (two shards that overlap would double-count samples), keeps the shards'
  order, writes OUT atomically with a sidecar, and removes nothing: delete the shards yourself
  once you are happy with OUT.
- Skips what a shard's glob also matches but is not a shard (`merge OUT OUT.shard-*`, as
  stages/rollout.sh and eval.sh document): the sidecars `*.meta.json`, rollout's and eval's
  `*.settings.json`, eval's `*.summary.json`, `*.lock` files, `*.tmp-PID` leftovers and
  folders (a shard's `.media/`). The skipped names are in the sidecar's stats.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

from marscli.errors import BadInput
from marscli.records.jsonl import get_field, iter_rows
from marscli.records.outputs import AtomicJsonl
from marscli.records.provenance import stage_inputs, write_sidecar

COMPANIONS = (".meta.json", ".settings.json", ".summary.json", ".lock")  # beside a data file
_TMP = re.compile(r"\.tmp-\d+$")


def is_companion(path: str) -> bool:
    """A sidecar, lock, temporary or media folder beside a shard, not a shard itself."""
    return path.endswith(COMPANIONS) or bool(_TMP.search(path)) or Path(path).is_dir()


@stage_inputs()
def merge(out: str, shards: list[str]) -> dict:
    """Join `shards` (companions skipped) into `out`; return the sidecar statistics."""
    started = time.time()
    skipped = [s for s in shards if is_companion(s)]
    shards = [s for s in shards if not is_companion(s)]
    if not shards:
        raise BadInput("merge: give at least one shard file"
                       + (f" ({len(skipped)} sidecar or media names skipped)" if skipped else ""))
    seen: dict[str, str] = {}
    per_shard = {}
    with AtomicJsonl(out) as w:
        for path in shards:
            n = 0
            for line, row in iter_rows(path):
                rid = get_field(row, "id", str, path, line)
                if rid in seen:
                    raise BadInput(f"{path}:{line}: id: duplicate id {rid!r} (also in {seen[rid]})")
                seen[rid] = f"{path}:{line}"
                w.write(row)
                n += 1
            per_shard[path] = n
    stats = {"records": len(seen), "shards": per_shard, "skipped": skipped}
    write_sidecar(out, stage="merge", inputs=shards, stats=stats, started=started)
    return stats


def main(out: str, shards: list[str]) -> dict:
    """`merge`, then one line on stderr."""
    stats = merge(out, shards)
    skipped = (f" (skipped {len(stats['skipped'])} sidecar or media names)"
               if stats["skipped"] else "")
    print(f"merged {stats['records']:,} records from {len(stats['shards'])} shard(s) into "
          f"{out}{skipped}", file=sys.stderr)
    return stats
