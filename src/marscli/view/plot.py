"""`marscli plot`: training curves as one PNG (matplotlib, Agg, imported only here).

- A run folder: one point per iteration (x = K of `iter-K`): mean reward, accuracy, format,
  turns, response tokens, tool calls per trajectory (one line per tool), the share of groups
  whose rewards are all equal, then every numeric key of the iteration's metrics (averaged over
  its steps: clip_frac, kl, grad_norm, ...) and of its eval summaries.
- A metrics JSONL (update or sft): every numeric key against `step` (or the line number).
Metrics that belong together (update's rollout-correction weights: mean, min, max; the shares of
tokens masked and truncated) share a panel (`METRIC_GROUPS`); a key that is null on every line
(`logprob_mismatch` without engine log-probs) gets none.

Panels are built as plain data first (`run_panels`, `metrics_panels`), so tests and `report`
see exactly what is drawn. The figure is 4 panels wide, 360x250 px per panel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from marscli.errors import BadInput, RuntimeFailure
from marscli.records.jsonl import iter_rows
from marscli.records.outputs import AtomicFile
from marscli.records.provenance import stage_inputs
from marscli.view.runs import (
    IterStats,
    discover,
    flatten,
    is_trajectory_file,
    iteration_stats,
    number,
)

NCOLS, PANEL_W, PANEL_H, DPI = 4, 3.6, 2.5, 100
# the metrics keys worth seeing first; any other numeric key follows, sorted
METRIC_ORDER = ("loss", "pg_loss", "kl", "kl_old", "clip_frac", "ratio_mean", "grad_norm",
                "entropy", "lr", "logprob_mismatch", "rollout_kl", "rollout_is_mean",
                "rollout_is_seq_mean", "rollout_masked_frac", "tokens_per_s", "seconds")
# metrics drawn as the series of one panel (update's rollout correction), at the place of the
# first of them in METRIC_ORDER; a panel shows only the series present
METRIC_GROUPS = {
    "rollout IS weight, token": ("rollout_is_mean", "rollout_is_min", "rollout_is_max"),
    "rollout IS weight, sequence": ("rollout_is_seq_mean", "rollout_is_seq_min",
                                    "rollout_is_seq_max"),
    "rollout: share without loss / truncated": ("rollout_masked_frac", "rollout_masked_seq_frac",
                                                "rollout_truncated_frac"),
}
TRAJ_PANELS = (("reward", "mean reward"), ("accuracy", "accuracy"), ("format", "format reward"),
               ("turns", "turns"), ("response_tokens", "response tokens"))


@dataclass
class Panel:
    title: str
    xlabel: str
    series: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)


def metric_sort(keys: set[str]) -> list[str]:
    first = [k for k in METRIC_ORDER if k in keys]
    return first + sorted(keys - set(first))


def metric_panels(keys: set[str], series, xlabel: str) -> list[Panel]:
    """One panel per metric key in `metric_sort` order, the keys of a METRIC_GROUPS entry
    together in one; `series(key)` gives a key's (xs, ys)."""
    group_of = {k: title for title, ks in METRIC_GROUPS.items() for k in ks}
    panels, done = [], set()
    for k in metric_sort(keys):
        title = group_of.get(k)
        if title is None:
            panels.append(Panel(k, xlabel, {k: series(k)}))
        elif title not in done:
            done.add(title)
            panels.append(Panel(title, xlabel, {g.removeprefix("rollout_"): series(g)
                                                for g in METRIC_GROUPS[title] if g in keys}))
    return panels


def _series(stats: list[IterStats], part: str, key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for i, s in enumerate(stats):
        v = getattr(s, part).get(key)
        if v is not None:
            xs.append(float(s.iteration.index if s.iteration.index is not None else i))
            ys.append(v)
    return xs, ys


def run_panels(stats: list[IterStats]) -> list[Panel]:
    """Per-iteration panels; a panel with no data in any iteration is left out."""
    x = "iteration"
    panels = [Panel(title, x, {key: _series(stats, "traj", key)}) for key, title in TRAJ_PANELS]
    tools = sorted({k for s in stats for k in s.traj if k.startswith("tool_calls.")})
    panels.append(Panel("tool calls / trajectory", x,
                        {k.removeprefix("tool_calls."): _series(stats, "traj", k) for k in tools}))
    panels.append(Panel("groups with equal rewards", x,
                        {"zero_std_groups": _series(stats, "traj", "zero_std_groups")}))
    panels += metric_panels({k for s in stats for k in s.metrics},
                            lambda k: _series(stats, "metrics", k), x)
    for k in sorted({k for s in stats for k in s.eval}):
        panels.append(Panel(f"eval {k}", x, {k: _series(stats, "eval", k)}))
    return [p for p in panels if any(xs for xs, _ in p.series.values())]


def metrics_panels(path: str) -> list[Panel]:
    """One panel per numeric key of a metrics JSONL, against `step` (or the line number)."""
    cols: dict[str, tuple[list[float], list[float]]] = {}
    for n, (_, row) in enumerate(iter_rows(path), start=1):
        flat = flatten(row)
        x = number(flat.get("step"))
        x = float(n) if x is None else x
        for k, v in flat.items():
            if k in ("v", "step") or (y := number(v)) is None:
                continue
            xs, ys = cols.setdefault(k, ([], []))
            xs.append(x)
            ys.append(y)
    return metric_panels(set(cols), cols.__getitem__, "step")


def panels_for(path: str) -> tuple[str, list[Panel]]:
    """(title, panels) for a run folder, an iteration folder or a metrics JSONL."""
    p = Path(path)
    if path != "-" and p.is_file():
        if is_trajectory_file(path):
            raise BadInput(f"{path}: holds trajectory rows — plot takes a metrics JSONL or a run "
                           "folder (RUN/iter-K/...); see `marscli report` or `inspect` for "
                           "trajectories")
        return p.name, metrics_panels(path)
    if path == "-":
        return "stdin", metrics_panels(path)
    run = discover(path)
    return run.name, run_panels([iteration_stats(it) for it in run.iterations])


def figure_size(n_panels: int) -> tuple[int, int]:
    """The PNG's size in pixels for n panels."""
    cols = min(NCOLS, max(n_panels, 1))
    rows = max(1, math.ceil(n_panels / NCOLS))
    return round(cols * PANEL_W * DPI), round(rows * PANEL_H * DPI)


def render_png(panels: list[Panel], title: str = "") -> bytes:
    """The panels as one PNG (bytes)."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeFailure("plotting needs matplotlib — pip install 'marscli[viz]'") from None
    matplotlib.use("Agg", force=True)
    import io

    from matplotlib.figure import Figure

    if not panels:
        raise BadInput("nothing to plot — no numeric values found")
    cols = min(NCOLS, len(panels))
    rows = math.ceil(len(panels) / NCOLS)
    fig = Figure(figsize=(cols * PANEL_W, rows * PANEL_H), dpi=DPI, layout="constrained")
    if title:
        fig.suptitle(title, fontsize=11)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, panel in zip(axes, panels):
        for label, (xs, ys) in panel.series.items():
            ax.plot(xs, ys, marker="o" if len(xs) <= 50 else None, markersize=3, linewidth=1.4,
                    label=label)
        ax.set_title(panel.title, fontsize=10)
        ax.set_xlabel(panel.xlabel, fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if len(panel.series) > 1:
            ax.legend(fontsize=7)
        if panel.xlabel == "iteration":
            ax.xaxis.get_major_locator().set_params(integer=True)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    return buf.getvalue()


@stage_inputs()
def plot(path: str, output: str, title: str | None = None) -> int:
    """Write the curves of `path` to `output` (PNG, atomically; `-`: stdout); returns panels."""
    name, panels = panels_for(path)
    png = render_png(panels, name if title is None else title)
    if output == "-":
        import sys

        sys.stdout.buffer.write(png)
        sys.stdout.buffer.flush()
    else:
        with AtomicFile(output) as fh:
            fh.write(png)
    return len(panels)
