"""The shards of an array job (rollout's, eval's): which ids a shard holds (`--shard i/N`: the
ids whose stable hash is i, so the N shards of a Slurm array together give exactly the ids of
one run, whatever the row order); and, before `marscli merge` joins them, which
files are shards and which their companions, whether each is finished, and whether what made
each (`made_of`: its sidecar and settings file) says they are the shards
of one job, each once (stages/merge.py's docstring says the rules)."""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from marscli.errors import BadInput, RuntimeFailure
from marscli.records.locks import live_writer

COMPANIONS = (".meta.json", ".settings.json", ".summary.json", ".lock")  # beside a data file
_TMP = re.compile(r"\.tmp-\d+$")
# Settings that differ between the shards of one job: the shard (checked on its own) and the
# server each shard generated through (SERVE_URLS: shard i uses server i mod their count).
PER_SHARD = frozenset({"shard", "base_url"})
NOT_ONE_JOB = ("not shards of one job: merge the shards of one run (re-run a stray shard with "
               "the job's settings)")


def parse_shard(spec: str | None, option: str = "--shard") -> tuple[int, int]:
    """`"i/N"` → (i, N), shards numbered 0..N-1 (`$SLURM_ARRAY_TASK_ID/N` with `--array
    0-(N-1)`); None → (0, 1), everything."""
    if spec is None:
        return 0, 1
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", spec)
    if not m:
        raise BadInput(f"{option}: {spec!r} is not i/N — e.g. 0/4 (shards are numbered 0..N-1)")
    i, n = int(m[1]), int(m[2])
    if n < 1:
        raise BadInput(f"{option}: {spec}: N must be at least 1")
    if i >= n:
        raise BadInput(f"{option}: {spec}: shard {i} is out of range — the shards of {n} are "
                       f"numbered 0..{n - 1}")
    return i, n


def shard_of(prompt_id: str, n: int) -> int:
    """The shard of a prompt id: a stable hash (not Python's `hash`, which is salted per run)."""
    return int.from_bytes(hashlib.sha256(prompt_id.encode()).digest()[:8], "big") % n


def in_shard(prompt_id: str, shard: tuple[int, int]) -> bool:
    return shard_of(prompt_id, shard[1]) == shard[0]


def is_companion(path: str) -> bool:
    """A sidecar, lock, temporary or media folder beside a shard, not a shard itself."""
    return path.endswith(COMPANIONS) or bool(_TMP.search(path)) or Path(path).is_dir()


def same_file(a: str, b: str) -> bool:
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


def agreed(made: list[Made]) -> dict:
    """What the shards agree on (`agree`), for the sidecar: the stage that wrote them, their
    count and their settings (less what differs per shard)."""
    first = {f: next((getattr(m, f) for m in made if getattr(m, f) is not None), None)
             for f in ("stage", "settings", "shard")}
    settings = first["settings"]
    return {"of_stage": first["stage"], "shard_count": first["shard"] and first["shard"][1],
            "settings": settings and {k: v for k, v in settings.items() if k not in PER_SHARD}}


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
