"""Run folders: find the iterations and their files, and reduce each iteration to numbers.

Shared by `plot` and `report`. A run folder is `RUN/iter-K/` folders (sorted by K as a number,
never by modification time), each holding some of:

- `rollouts.jsonl`, `scored.jsonl`, `advantages.jsonl`: the same trajectories at three stages.
  Statistics come from the most complete file that still holds every trajectory: `scored`, else
  `advantages` (which `--filter-zero-std` may have thinned), else `rollouts`; the advantage of
  each row is joined in by id from `advantages.jsonl` when that file is there.
- `metrics.jsonl` (or `*metrics*.jsonl`, here or one folder down, e.g. in the checkpoint folder
  `update --out` wrote): one line per optimiser step; each numeric key is averaged over the
  iteration's steps.
- `*.summary.json` (here or one folder down): eval summaries; numeric values are kept as
  `SUMMARY_NAME.KEY`.

A folder without `iter-K` children that holds those files is one iteration; a single
trajectory JSONL is one iteration too. Everything here streams rows: nothing holds a whole file.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from marscli.errors import BadInput
from marscli.records.jsonl import iter_rows
from marscli.records.provenance import note_inputs

TRAJ_FILES = ("scored.jsonl", "advantages.jsonl", "rollouts.jsonl")  # stats preference order
_ITER = re.compile(r"^iter-(\d+)$")


@dataclass
class Iteration:
    name: str  # folder name (iter-3) or file stem
    index: int | None  # K of iter-K; None for a folder or file that is not named so
    rows: str | None = None  # the trajectory file statistics and the report read
    advantages: str | None = None  # joined into `rows` by id when it is another file
    metrics: list[str] = field(default_factory=list)
    summaries: list[str] = field(default_factory=list)


@dataclass
class Run:
    name: str
    path: str
    kind: str  # "run" (iter-K folders), "iteration" (one folder), "trajectories" (one file)
    iterations: list[Iteration]


def _metrics_files(folder: Path) -> list[str]:
    found = sorted(folder.glob("*metrics*.jsonl")) or sorted(folder.glob("*/*metrics*.jsonl"))
    return [str(p) for p in found if p.is_file()]


def _summaries(folder: Path) -> list[str]:
    found = sorted(folder.glob("*.summary.json")) + sorted(folder.glob("*/*.summary.json"))
    return [str(p) for p in found if p.is_file()]


def _iteration(folder: Path, name: str, index: int | None) -> Iteration:
    it = Iteration(name=name, index=index, metrics=_metrics_files(folder),
                   summaries=_summaries(folder))
    present = [folder / f for f in TRAJ_FILES if (folder / f).is_file()]
    if present:
        it.rows = str(present[0])
        adv = folder / "advantages.jsonl"
        if adv.is_file() and adv != present[0]:
            it.advantages = str(adv)
    return it


def _has_data(it: Iteration) -> bool:
    return bool(it.rows or it.metrics or it.summaries)


def discover(path: str) -> Run:
    """What PATH is: a run folder, one iteration's folder, or one trajectory JSONL."""
    if path == "-":
        return Run("stdin", path, "trajectories", [Iteration("stdin", None, rows="-")])
    p = Path(path)
    if not p.exists():
        raise BadInput(f"{path}: no such file or folder")
    if p.is_file():
        return Run(p.stem, path, "trajectories", [Iteration(p.stem, None, rows=path)])
    iters = []
    for child in p.iterdir():
        m = _ITER.match(child.name)
        if m and child.is_dir():
            iters.append(_iteration(child, child.name, int(m.group(1))))
    iters.sort(key=lambda it: it.index)
    iters = [it for it in iters if _has_data(it)]
    if iters:
        return Run(p.resolve().name, path, "run", iters)
    m = _ITER.match(p.resolve().name)
    single = _iteration(p, p.resolve().name, int(m.group(1)) if m else None)
    if _has_data(single):
        return Run(p.resolve().name, path, "iteration", [single])
    raise BadInput(f"{path}: no iter-K folders with {', '.join(TRAJ_FILES)} or metrics.jsonl "
                   "in it — pass a run folder (RUN/iter-0/scored.jsonl ...) or a JSONL file")


def is_trajectory_file(path: str) -> bool:
    """Whether a JSONL file holds trajectory rows (its first row has `segments`)."""
    for _, row in iter_rows(path):
        return "segments" in row
    return False


# ------------------------------------------------------------------------------ per trajectory


def count_tokens(tokens: list[int]) -> int:
    """Tokens in a compact list: -n stands for n image placeholders."""
    return sum(-t if t < 0 else 1 for t in tokens)


def token_counts(rec: dict) -> dict[str, Any]:
    """Tokens by segment role, and the share under the loss mask (model tokens / all)."""
    out = {"prompt": 0, "model": 0, "tool": 0}
    for s in rec.get("segments") or []:
        if isinstance(s, dict) and s.get("role") in out:
            out[s["role"]] += count_tokens(s.get("tokens") or [])
    out["total"] = out["prompt"] + out["model"] + out["tool"]
    out["mask_share"] = out["model"] / out["total"] if out["total"] else 0.0
    return out


def number(x: Any) -> float | None:
    """x as a float if it is a real number (not a bool, not NaN), else None."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return None if math.isnan(x) else float(x)


def reward_part(rec: dict, key: str) -> float | None:
    r = rec.get("reward")
    return number(r.get(key)) if isinstance(r, dict) else None


# ------------------------------------------------------------------------------ per iteration


class _Mean:
    def __init__(self) -> None:
        self.sum, self.n = 0.0, 0

    def add(self, x: float | None) -> None:
        if x is not None:
            self.sum += x
            self.n += 1

    def value(self) -> float | None:
        return self.sum / self.n if self.n else None


class TrajStats:
    """Running means over an iteration's trajectories (one `add` per row)."""

    def __init__(self) -> None:
        self.n = 0
        self.means: dict[str, _Mean] = defaultdict(_Mean)
        self.tools: dict[str, float] = defaultdict(float)
        self.unscored = 0
        self.groups: dict[str, list[float]] = defaultdict(list)

    def add(self, rec: dict) -> None:
        self.n += 1
        m = self.means
        for key in ("total", "accuracy", "format"):
            m["reward" if key == "total" else key].add(reward_part(rec, key))
        if isinstance(rec.get("reward"), dict) and rec["reward"].get("status") == "unscored":
            self.unscored += 1
        m["turns"].add(number(rec.get("turns")))
        m["response_tokens"].add(number(rec.get("response_tokens")))
        m["format_errors"].add(number(rec.get("format_errors")))
        m["answered"].add(1.0 if rec.get("stop") == "answer" else 0.0)
        if (tc := token_counts(rec))["total"]:
            m["mask_share"].add(tc["mask_share"])
        m["advantage_abs"].add(None if (a := number(rec.get("advantage"))) is None else abs(a))
        for name, k in (rec.get("tool_calls") or {}).items():
            self.tools[str(name)] += number(k) or 0.0
        total = reward_part(rec, "total")
        if total is not None:
            self.groups[str(rec.get("prompt_id", rec.get("id")))].append(total)

    def result(self) -> dict[str, float]:
        out: dict[str, float] = {"trajectories": float(self.n)}
        for k, v in self.means.items():
            if (val := v.value()) is not None:
                out[k] = val
        if self.n:
            for name, k in sorted(self.tools.items()):
                out[f"tool_calls.{name}"] = k / self.n
            out["unscored"] = self.unscored / self.n
        multi = [g for g in self.groups.values() if len(g) > 1]
        if multi:  # groups whose rewards are all equal: no learning signal under GRPO-style norms
            out["zero_std_groups"] = sum(max(g) == min(g) for g in multi) / len(multi)
        return out


def advantage_index(path: str) -> dict[str, dict]:
    """id → the advantage fields of an advantages file (small: numbers only)."""
    out = {}
    for _, row in iter_rows(path):
        if "id" in row:
            out[str(row["id"])] = {k: row[k] for k in ("advantage", "group", "minibatch")
                                   if k in row}
    return out


def iter_trajectories(it: Iteration) -> Iterator[dict]:
    """The iteration's trajectory rows, advantages joined in by id."""
    if it.rows is None:
        return
    adv = advantage_index(it.advantages) if it.advantages else {}
    for _, row in iter_rows(it.rows):
        extra = adv.get(str(row.get("id")))
        if extra:
            row = {**row, **{k: v for k, v in extra.items() if k not in row}}
        yield row


def metrics_means(paths: list[str]) -> dict[str, float]:
    """Each numeric key's mean over all steps of the files (step itself excluded)."""
    means: dict[str, _Mean] = defaultdict(_Mean)
    for p in paths:
        for _, row in iter_rows(p):
            for k, v in flatten(row).items():
                if k not in ("v", "step"):
                    means[k].add(number(v))
    return {k: v for k, m in means.items() if (v := m.value()) is not None}


def flatten(obj: dict, prefix: str = "", depth: int = 2) -> dict[str, Any]:
    """`{"a": {"b": 1}}` → `{"a.b": 1}`, down to `depth` levels."""
    out: dict[str, Any] = {}
    for k, v in obj.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and depth > 1:
            out.update(flatten(v, f"{key}.", depth - 1))
        else:
            out[key] = v
    return out


def summary_values(paths: list[str]) -> dict[str, float]:
    out = {}
    for p in paths:
        name = Path(p).name.removesuffix(".summary.json")
        note_inputs(p)  # read whole, not through the records readers
        try:
            obj = orjson.loads(Path(p).read_bytes())
        except orjson.JSONDecodeError as e:
            raise BadInput(f"{p}: not valid JSON: {e}") from None
        if isinstance(obj, dict):
            for k, v in flatten(obj).items():
                if (x := number(v)) is not None and k != "v":
                    out[f"{name}.{k}"] = x
    return out


@dataclass
class IterStats:
    iteration: Iteration
    traj: dict[str, float]
    metrics: dict[str, float]
    eval: dict[str, float]


def iteration_stats(it: Iteration, keep: Callable[[dict], None] | None = None) -> IterStats:
    """Reduce one iteration to numbers; `keep(row)` sees every trajectory on the way (the report
    picks the rows it shows from the same single pass)."""
    ts = TrajStats()
    for row in iter_trajectories(it):
        ts.add(row)
        if keep is not None:
            keep(row)
    return IterStats(it, ts.result() if ts.n else {}, metrics_means(it.metrics),
                     summary_values(it.summaries))
