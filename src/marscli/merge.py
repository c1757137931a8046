"""`marscli merge OUT SHARD...`: join the shards of a rollout or eval array job.

Refuses duplicate ids (two shards that overlap would double-count samples), keeps the shards'
order, writes OUT atomically with a sidecar, and removes nothing: delete the shards yourself
once you are happy with OUT.
"""

from __future__ import annotations

import time

from marscli.errors import BadInput
from marscli.jsonl import AtomicJsonl, get_field, iter_rows, write_sidecar


def merge(out: str, shards: list[str]) -> dict:
    if not shards:
        raise BadInput("merge: give at least one shard file")
    started = time.time()
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
    stats = {"records": len(seen), "shards": per_shard}
    write_sidecar(out, stage="merge", inputs=shards, stats=stats, started=started)
    return stats
