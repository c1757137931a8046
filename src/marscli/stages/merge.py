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
- Merges the shards of one job only, all compared before anything is written (`agree`): what
  each shard's sidecar and settings file say made it (stage, the settings of
  `runner.sample_settings`: policy and weights, engine, sampling, seed, limits, tools...; the
  sha256 of the input file) must be the same, and their `i/N` must be N shards of one count,
  each once, none missing. A difference is one line naming the two shards, the field and the
  two values, exit 2. What legitimately differs between shards: the shard itself, the server
  each generated through (the Makefile's shard i uses server i mod SERVERS), output paths,
  wall time, batch size and device (not settings). `--allow-partial` also merges a job with
  shards missing, and the sidecar names them (`missing_shards`, `complete: false`). A shard
  whose files say nothing (an older marscli) is compared on nothing.
- The sidecar lists each shard's records, sha256 (of the bytes merged) and whether it was
  complete, and the settings the shards agree on.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

from marscli.errors import BadInput
from marscli.records.jsonl import get_field, iter_rows
from marscli.records.outputs import AtomicJsonl
from marscli.records.provenance import current_inputs, stage_inputs
from marscli.records.shards import (
    agree,
    agreed,
    is_companion,
    made_of,
    missing_shards,
    same_file,
    unfinished,
)
from marscli.records.sidecar import write_sidecar


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
        if out != "-" and same_file(path, out):
            raise BadInput(f"{path}: is the output being written ({out}) — an output cannot be "
                           "one of the inputs: pick another output")
    partial = unfinished(shards, allow_partial)
    made = [made_of(p) for p in shards]
    agree(made)
    missing = missing_shards(made, allow_partial)
    seen: dict[str, str] = {}
    counts: dict[str, int] = {}
    torn: dict[str, int] = {}

    def drop(path: str) -> Callable[[int, bytes], None] | None:
        if path not in partial:
            return None  # a finished shard with a torn line is bad input, as ever
        return lambda line, raw: torn.__setitem__(path, line)

    if out != "-":  # a kill from here on must not leave files that call the old OUT done
        for done in (f"{out}.meta.json", out.removesuffix(".jsonl") + ".summary.json"):
            Path(done).unlink(missing_ok=True)
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
             "missing_shards": missing, "complete": not (partial or missing),
             "torn_dropped": len(torn), "skipped": skipped}
    config = {"allow_partial": allow_partial, **agreed(made)}
    write_sidecar(out, stage="merge", seed=(config.get("settings") or {}).get("seed"),
                  config=config, inputs=shards, stats=stats, started=started)
    return stats


def main(out: str, shards: list[str], allow_partial: bool = False) -> dict:
    """`merge`, then one line on stderr."""
    stats = merge(out, shards, allow_partial)
    skipped = (f" (skipped {len(stats['skipped'])} sidecar or media names)"
               if stats["skipped"] else "")
    partial = (f"; {len(stats['partial'])} of them unfinished (--allow-partial)"
               if stats["partial"] else "")
    if stats["missing_shards"]:
        partial += f"; shard {', '.join(stats['missing_shards'])} missing (--allow-partial)"
    print(f"merged {stats['records']:,} records from {len(stats['shards'])} shard(s) into "
          f"{out}{skipped}{partial}", file=sys.stderr)
    return stats
