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

import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from marscli.errors import BadInput, RuntimeFailure
from marscli.records.jsonl import get_field, iter_rows
from marscli.records.outputs import AtomicJsonl, live_writer
from marscli.records.provenance import current_inputs, stage_inputs, write_sidecar

COMPANIONS = (".meta.json", ".settings.json", ".summary.json", ".lock")  # beside a data file
_TMP = re.compile(r"\.tmp-\d+$")
# Settings that differ between the shards of one job: the shard (checked on its own) and the
# server each shard generated through (SERVE_URLS: shard i uses server i mod their count).
PER_SHARD = frozenset({"shard", "base_url"})
NOT_ONE_JOB = ("not shards of one job: merge the shards of one run (re-run a stray shard with "
               "the job's settings)")


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


@dataclass
class Made:
    """What a shard's files say made it (None: not said): its sidecar's stage and inputs'
    hashes, its settings file's settings, and its `i/N`."""

    path: str
    stage: str | None
    inputs: dict[str, str] | None
    settings: dict[str, Any] | None
    shard: tuple[int, int] | None


def _json_dict(path: str, key: str | None = None) -> dict | None:
    """The object in a JSON file (or its `key`), None when absent or not one: a shard's files
    that say nothing are compared on nothing (hand-made shards, an older marscli)."""
    try:
        data = orjson.loads(Path(path).read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None
    if key is not None:
        data = data.get(key) if isinstance(data, dict) else None
    return data if isinstance(data, dict) and data else None


def made_of(path: str) -> Made:
    """`Made` from `PATH.meta.json` (absent for an unfinished shard) and `PATH.settings.json`
    (rollout and eval write it before their first record)."""
    from marscli.agent.runner import parse_shard

    meta = _json_dict(f"{path}.meta.json") or {}
    settings = _json_dict(f"{path}.settings.json", "settings")
    spec = (settings or {}).get("shard") or (meta.get("config") or {}).get("shard")
    try:
        shard = parse_shard(spec) if isinstance(spec, str) else None
    except BadInput:
        shard = None
    inputs = meta.get("inputs")
    stage = meta.get("stage") if isinstance(meta.get("stage"), str) else None
    if stage is None and settings is not None:  # unfinished: its settings tell (eval's: mode)
        stage = "eval" if "mode" in settings else "rollout" if "n" in settings else None
    return Made(path, stage, inputs if isinstance(inputs, dict) and inputs else None, settings,
                shard)


def _differs(a: Made, b: Made, field: str, va: Any, vb: Any) -> BadInput:
    return BadInput(f"{b.path}: {field}: {vb} here, {va} in {a.path} — {NOT_ONE_JOB}")


def _policy(settings: dict) -> str:
    weights = settings.get("weights")
    return f"{settings.get('policy')} (sha256 {weights[:12]})" if weights else \
        str(settings.get("policy"))


def _compare_settings(a: Made, b: Made) -> None:
    """BadInput on the first setting of `b` that is not `a`'s. The policy's path may differ
    where its weights are the same (a moved run folder), as a resume allows."""
    sa, sb = a.settings or {}, b.settings or {}
    for key in ["weights", *sa, *(k for k in sb if k not in sa)]:
        va, vb = sa.get(key), sb.get(key)
        if key in PER_SHARD or va == vb:
            continue
        if key == "policy" and sa.get("weights") and sa.get("weights") == sb.get("weights"):
            continue
        if key == "weights":
            if not (va and vb):  # a hub id or served model on one side: the names tell
                continue
            key, va, vb = "policy", _policy(sa), _policy(sb)
        raise _differs(a, b, key, va, vb)


def _compare_inputs(a: Made, b: Made) -> None:
    """BadInput when `b` read other input files than `a` (by content: each shard reads the
    whole prompts or benchmark file and keeps its share)."""
    ia, ib = list((a.inputs or {}).items()), list((b.inputs or {}).items())
    for (pa, ha), (pb, hb) in zip(ia, ib, strict=False):
        if ha != hb:
            raise _differs(a, b, "input", f"{pa} (sha256 {ha[:12]})", f"{pb} (sha256 {hb[:12]})")
    if len(ia) != len(ib):
        raise _differs(a, b, "inputs", len(ia), len(ib))


def agree(made: list[Made]) -> None:
    """Refuse (BadInput, one line) shards that do not say the same about what made them:
    stage, then settings, then inputs, each shard against the first that says it."""
    for field, compare in (("stage", None), ("settings", _compare_settings),
                           ("inputs", _compare_inputs)):
        known = [m for m in made if getattr(m, field) is not None]
        for m in known[1:]:
            if compare is not None:
                compare(known[0], m)
            elif m.stage != known[0].stage:
                raise _differs(known[0], m, "stage", known[0].stage, m.stage)


def missing_shards(made: list[Made], allow_partial: bool) -> list[str]:
    """The `i/N` of the job's shards not given (allowed with `allow_partial`); BadInput for
    shards of different counts or one shard given twice. A shard that does not say which it
    is may be any one missing."""
    known = [m for m in made if m.shard is not None]
    if not known:
        return []
    first, seen = known[0], {}
    n = first.shard[1]
    for m in known:
        i, count = m.shard
        if count != n:
            raise _differs(first, m, "shard", "/".join(map(str, first.shard)), f"{i}/{count}")
        if i in seen:
            raise BadInput(f"{m.path}: shard: {i}/{n}, as {seen[i]} — the same shard given "
                           "twice: give each shard once")
        seen[i] = m.path
    missing = [f"{i}/{n}" for i in range(n) if i not in seen]
    if len(missing) <= len(made) - len(known):  # the shards that do not say may be those
        return []
    if not allow_partial:
        raise BadInput(f"merge: {len(made)} of the {n} shards given, none is shard "
                       f"{', '.join(missing)} (of {first.path}'s job) — give every shard "
                       "(OUT.shard-*), or add --allow-partial to merge what is there")
    return missing


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


def agreed(made: list[Made]) -> dict:
    """What the shards agree on (`agree`), for the sidecar: the stage that wrote them, their
    count and their settings (less what differs per shard)."""
    first = {f: next((getattr(m, f) for m in made if getattr(m, f) is not None), None)
             for f in ("stage", "settings", "shard")}
    settings = first["settings"]
    return {"of_stage": first["stage"], "shard_count": first["shard"] and first["shard"][1],
            "settings": settings and {k: v for k, v in settings.items() if k not in PER_SHARD}}


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
