"""The toy world's run summary (`marscli summary`, the demo's table): per-iteration test
accuracy, zoom hit rate and tool use of runs, averaged over RL seeds; `RUN/summary.json` for each
run, the tables and the PNG of accuracy ± 95% CI.

Seed s of run RUN lives in RUN (s = 0) or RUN-seed<s> (the Makefile's layout). Iteration 0 is
the cold-start SFT model. Per iteration and seed: the greedy test accuracy of checkpoint k, its
zoom hit rate (zoom calls whose box holds the whole logo, toy world only) and zoom calls per
question, and, from the training rollouts sampled from checkpoint k (iter-k/), their accuracy,
the share of them that zoom, their zoom hit rate, the share of them whose zoom finds the logo,
the pooled std of the group-normalised advantages and the share of flat groups (all rewards
equal). An iteration that was not evaluated (EVAL_EVERY) still has its rollout columns. Across
seeds: the mean and the half-width of its 95% confidence interval (Student's t; none for one
seed).

Per question kind (the records' `category`: perception, knowledge, both), of the test split and
of the rollouts alike: accuracy, the share of trajectories that call each tool, and `found`, the
share whose tools reach the target (see `found`): a second table, `kinds` in summary.json, and
a second row of panels in the plot.

It reads the toy world's ground truth (`toy.logo_box`, `toy.entity`, the question kinds), hence
its place in toy/ (above view/).
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import orjson
from rich.table import Table

from marscli.agent.protocol import ToolCall, parse_turn
from marscli.records.jsonl import iter_rows
from marscli.records.outputs import AtomicFile
from marscli.toy.hits import hit_rate, zoom_hits
from marscli.toy.prompts import KINDS  # the toy world's order; other categories follow

ZOOM = "image_zoom_in_tool"
SHORT = {ZOOM: "zoom", "text_search_tool": "text", "image_search_tool": "image"}
# Student's t at 0.975 by degrees of freedom (1..10); the normal 1.96 beyond
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)
KEYS = ("test_accuracy", "zoom_hit_rate", "zoom_calls", "rollout_accuracy", "rollout_zoom_share",
        "rollout_zoom_hit_rate", "rollout_found", "pooled_std", "flat_groups")
KIND_TOOL = {"perception": "zoom", "knowledge": "text", "both": "image"}  # the kind's own tool
TOOLS = ("zoom", "text", "image")
KIND_KEYS = tuple(f"{src}_{key}" for src in ("test", "rollout")
                  for key in ("accuracy", *TOOLS, "found"))


def seed_run(run: Path, s: int) -> Path:
    return run if s == 0 else run.with_name(f"{run.name}-seed{s}")


def records(path: Path) -> list[dict]:
    """A JSONL file's rows, [] when there is none (an iteration not evaluated); a bad line, or
    a file a live stage is still writing, is marscli's BadInput naming it."""
    if not path.is_file():
        return []
    return [row for _, row in iter_rows(str(path))]


def pct(x: float | None) -> float | None:
    return None if x is None else round(100 * x, 2)


def by_kind(rows: list[dict], missing: str | None = None) -> dict[str, list[dict]]:
    """Rows grouped by their category (the toy world's question kind); a row without one goes
    under `missing`, or is left out when that is None."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        if kind := r.get("category") or missing:
            groups[kind].append(r)
    return groups


def by_category(rows: list[dict]) -> dict[str, dict]:
    """Per question category: accuracy % and tool calls per trajectory (the paper's claim is
    that perception questions zoom and knowledge questions search)."""
    out = {}
    for c, rs in sorted(by_kind(rows, missing="-").items()):
        tools: dict[str, float] = defaultdict(float)
        for r in rs:
            for name, n in (r.get("tool_calls") or {}).items():
                tools[SHORT.get(name, name)] += n / len(rs)
        scored = [r["score"]["accuracy"] for r in rs if (r.get("score") or {}).get("accuracy")
                  is not None]
        out[c] = {"accuracy": pct(sum(scored) / len(scored)) if scored else None,
                  "items": len(rs), "tool_calls": {t: round(v, 3) for t, v in tools.items()}}
    return out


def iteration(run: Path, k: int) -> dict | None:
    """Checkpoint k's row: its test-split evaluation (None where it was not evaluated) and the
    rollouts sampled from it; None when it has neither."""
    path = run / "eval" / f"ckpt-{k}.summary.json"
    out: dict = {"iter": k, "test_accuracy": None, "items": None, "mean_turns": None,
                 "tool_calls": {}, "categories": {}, "by_category": {}, "zoom_hit_rate": None,
                 "zoom_calls": None, "rollout_reward": rollout_reward(run, k)}
    it, evals = run / f"iter-{k}", []
    if path.is_file():
        (bench,) = orjson.loads(path.read_bytes())["benchmarks"].values()  # one benchmark
        evals = records(run / "eval" / f"ckpt-{k}.jsonl")
        tools = {name: u["mean"] for name, u in bench["tool_use"].items()}
        out.update(test_accuracy=bench["accuracy"], items=bench["items"],
                   mean_turns=bench["mean_turns"], tool_calls=tools,
                   categories={c: v["accuracy"] for c, v in bench["categories"].items()},
                   by_category=by_category(evals),
                   zoom_hit_rate=pct(hit_rate(evals, run / "eval")),
                   zoom_calls=tools.get(ZOOM, 0.0))
    rollouts = records(it / "rollouts.jsonl")
    out.update(rollout_stats(it, rollouts, out["rollout_reward"]))
    if out["test_accuracy"] is None and out["rollout_accuracy"] is None:
        return None
    out["kinds"] = kinds(evals, run / "eval", rollouts, records(it / "scored.jsonl"), it)
    return out


def rollout_reward(run: Path, k: int) -> dict | None:
    meta = run / f"iter-{k}" / "scored.jsonl.meta.json"
    if not meta.is_file():
        return None
    st = orjson.loads(meta.read_bytes())["stats"]
    return {"accuracy": st["accuracy_mean"], "format": st["format_mean"], "rows": st["rows"]}


def rollout_stats(it: Path, rollouts: list[dict], rr: dict | None) -> dict:
    """The training rollouts of checkpoint k (in `it`, iter-k/); `rr`: their reward stats."""
    zooming = sum(1 for r in rollouts if (r.get("tool_calls") or {}).get(ZOOM))
    found = sum(1 for r in rollouts if zoom_hits(r, it)[1])
    out = {"rollout_accuracy": pct(rr["accuracy"]) if rr else None,
           "rollout_zoom_share": pct(zooming / len(rollouts)) if rollouts else None,
           "rollout_zoom_hit_rate": pct(hit_rate(rollouts, it)),
           # where to look and when, in one number: the rollouts with a zoom on the logo
           "rollout_found": pct(found / len(rollouts)) if rollouts else None,
           "pooled_std": None, "flat_groups": None}
    meta = it / "advantages.jsonl.meta.json"
    if meta.is_file():
        st = orjson.loads(meta.read_bytes())["stats"]
        out["pooled_std"] = st.get("pooled_std")
        out["flat_groups"] = pct(st["zero_std_groups"] / st["groups"]) if st["groups"] else None
    return out


def tool_calls(record: dict) -> list[tuple[str, dict]]:
    """(short tool name, arguments) of a trajectory's tool calls, in order: each model turn
    parsed as the agent parses it, so a malformed call (a format error, never run) is no call."""
    acts = (parse_turn(s.get("text") or "") for s in record.get("segments") or []
            if s.get("role") == "model")
    return [(SHORT.get(a.name, a.name), a.arguments) for a in acts if isinstance(a, ToolCall)]


def found(record: dict, kind: str, calls: list[tuple[str, dict]], base: Path) -> bool | None:
    """Whether the trajectory's tools reach the target; None without the world's ground truth.
    perception: a zoom whose box holds the logo. knowledge: a text search naming the company
    (`toy.entity`). both: the chain, an image search (it names the company) and then such a
    text search; a text search before any image search only guessed the name."""
    toy = record.get("toy") or {}
    if kind == "perception":
        return zoom_hits(record, base)[1] > 0 if "logo_box" in toy else None
    if kind not in ("knowledge", "both") or not toy.get("entity"):
        return None
    seen_image = kind == "knowledge"  # knowledge questions name the company: no chain needed
    for name, args in calls:
        seen_image |= name == "image"
        query = args.get("query")
        if (name == "text" and seen_image and isinstance(query, str)
                and toy["entity"].lower() in query.lower()):
            return True
    return False


def share(flags: list[bool]) -> float | None:
    return pct(sum(flags) / len(flags)) if flags else None


def kind_order(kind: str) -> tuple[int, str]:
    return (KINDS.index(kind) if kind in KINDS else len(KINDS), kind)


def use_stats(rows: list[dict], base: Path, src: str) -> dict[str, dict]:
    """Per kind: the share % of trajectories calling each tool at least once, and found %."""
    out = {}
    for kind, rs in by_kind(rows).items():
        calls = [tool_calls(r) for r in rs]
        st = {f"{src}_{t}": share([any(n == t for n, _ in c) for c in calls]) for t in TOOLS}
        hits = [f for r, c in zip(rs, calls, strict=True)
                if (f := found(r, kind, c, base)) is not None]
        out[kind] = {**st, f"{src}_found": share(hits), f"{src}_items": len(rs)}
    return out


def accuracy(rows: list[dict], field: str, src: str) -> dict[str, dict]:
    """Per kind: accuracy % of the rows scored in `field` (eval's `score`, reward's `reward`;
    an unscored row has no accuracy and is left out)."""
    out = {}
    for kind, rs in by_kind(rows).items():
        accs = [a for r in rs if (a := (r.get(field) or {}).get("accuracy")) is not None]
        out[kind] = {f"{src}_accuracy": pct(sum(accs) / len(accs)) if accs else None}
    return out


def kinds(evals: list[dict], eval_dir: Path, rollouts: list[dict], scored: list[dict],
          it: Path) -> dict[str, dict]:
    """Per kind, one seed's KIND_KEYS (None where not measured) and the item counts: the test
    split from the eval records, the rollouts from rollouts.jsonl, their accuracy from
    scored.jsonl (the same rows with `reward`)."""
    merged: dict[str, dict] = defaultdict(dict)
    for part in (accuracy(evals, "score", "test"), use_stats(evals, eval_dir, "test"),
                 use_stats(rollouts, it, "rollout"), accuracy(scored, "reward", "rollout")):
        for kind, st in part.items():
            merged[kind].update(st)
    return {kind: {key: merged[kind].get(key) for key in
                   (*KIND_KEYS, "test_items", "rollout_items")}
            for kind in sorted(merged, key=kind_order)}


def mean_ci(values: list[float | None]) -> tuple[float | None, float | None]:
    """Mean and the 95% CI half-width (Student's t) of the values that are there."""
    xs = [v for v in values if v is not None]
    if not xs:
        return None, None
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return round(m, 3), None
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))
    t = T975[len(xs) - 2] if len(xs) - 1 <= len(T975) else 1.96
    return round(m, 3), round(t * sd / math.sqrt(len(xs)), 3)


def aggregate(per_seed: dict[int, dict[int, dict]], iters: int) -> list[dict]:
    """One row per iteration evaluated in some seed: seed 0's fields (the committed demo), the
    mean and CI of KEYS over seeds, and every seed's values of KEYS."""
    rows = []
    for k in range(iters + 1):
        seeds = {s: its[k] for s, its in per_seed.items() if k in its}
        if not seeds:
            continue
        row = dict(seeds.get(0) or next(iter(seeds.values())))
        for key in KEYS:
            row[key], row[f"{key}_ci95"] = mean_ci([r.get(key) for r in seeds.values()])
        row["seeds"] = len(seeds)
        row["per_seed"] = [{"seed": s, **{key: r.get(key) for key in KEYS}}
                           for s, r in sorted(seeds.items())]
        row["kinds"] = aggregate_kinds(seeds)
        rows.append(row)
    return rows


def aggregate_kinds(seeds: dict[int, dict]) -> dict[str, dict]:
    """Per kind: the mean and CI of KIND_KEYS over the seeds, and every seed's values."""
    out = {}
    for kind in sorted({kd for r in seeds.values() for kd in r["kinds"]}, key=kind_order):
        per_seed = {s: r["kinds"][kind] for s, r in sorted(seeds.items()) if kind in r["kinds"]}
        agg: dict = {}
        for key in KIND_KEYS:
            agg[key], agg[f"{key}_ci95"] = mean_ci([v[key] for v in per_seed.values()])
        out[kind] = {**agg, "per_seed": [{"seed": s, **v} for s, v in per_seed.items()]}
    return out


def category_cell(c: str, acc: float, counts: dict | None) -> str:
    """`knowledge 20.0 (image 1.0 text 1.0)`: accuracy and tool calls per question."""
    calls = " ".join(f"{t} {n:.1f}" for t, n in (counts or {}).get("tool_calls", {}).items())
    return f"{c} {acc:.1f}" + (f" ({calls})" if calls else "")


def fmt(m: float | None, ci: float | None = None, digits: int = 1) -> str:
    if m is None:
        return "-"
    return f"{m:.{digits}f}" + (f" ± {ci:.{digits}f}" if ci is not None else "")


def table(summaries: dict[Path, list[dict]], n_seeds: int) -> Table:
    t = Table(title=f"by iteration (0: the SFT model), mean ± 95% CI over {n_seeds} RL seed(s); "
                    "zoom: zoom calls per test question; turns, image, text: seed 0's; rollout "
                    "columns: the training samples of that checkpoint",
              title_justify="left")
    # A per-category column only where some run has more than one category (a perception-only
    # toy world has one, equal to the overall accuracy) and no records with one (then the
    # table by kind has them, and more).
    every = [r for rows in summaries.values() for r in rows]
    by_cat = any(len(r["categories"]) > 1 for r in every) and not any(r["kinds"] for r in every)
    cols = ("run", "iter", "test acc %", *(("per seed",) if n_seeds > 1 else ()), "zoom hit %",
            "zoom", "turns", "image", "text", *(("by category",) if by_cat else ()),
            "rollout acc %", "rollout zoom %", "rollout hit %", "rollout found %",
            "pooled std", "flat %")
    for col in cols:
        t.add_column(col, justify="left" if col in ("run", "by category", "per seed")
                     else "right")
    for run, rows in summaries.items():
        for r in rows:
            tools = {SHORT.get(k, k): v for k, v in r["tool_calls"].items()}
            cats = " ".join(category_cell(c, a, r["by_category"].get(c))
                            for c, a in r["categories"].items() if a is not None)
            seeds = " ".join(fmt(p["test_accuracy"]) for p in r["per_seed"])
            evaluated = r["test_accuracy"] is not None
            t.add_row(run.name, str(r["iter"]), fmt(r["test_accuracy"], r["test_accuracy_ci95"]),
                      *((seeds,) if n_seeds > 1 else ()),
                      fmt(r["zoom_hit_rate"], r["zoom_hit_rate_ci95"]),
                      fmt(r["zoom_calls"], digits=2), fmt(r["mean_turns"], digits=2),
                      *(fmt(tools.get(x, 0) if evaluated else None, digits=2)
                        for x in ("image", "text")),
                      *((cats,) if by_cat else ()),
                      fmt(r["rollout_accuracy"]), fmt(r["rollout_zoom_share"]),
                      fmt(r["rollout_zoom_hit_rate"]), fmt(r["rollout_found"]),
                      fmt(r["pooled_std"], digits=3), fmt(r["flat_groups"], digits=0))
        if rows:
            t.add_section()
    return t


def kind_table(summaries: dict[Path, list[dict]], n_seeds: int) -> Table:
    t = Table(title=f"by question kind, mean ± 95% CI over {n_seeds} RL seed(s): accuracy %, "
                    "share % of trajectories calling each tool, found %: perception a zoom on "
                    "the logo, knowledge a text search naming the company, both an image search "
                    "then such a text search",
              title_justify="left")
    for col in ("run", "iter", "kind", *(f"{src} {key} %" for src in ("test", "rollout")
                                          for key in ("acc", *TOOLS, "found"))):
        t.add_column(col, justify="left" if col in ("run", "kind") else "right")
    for run, rows in summaries.items():
        for r in rows:
            for kind, st in r["kinds"].items():
                t.add_row(run.name, str(r["iter"]), kind,
                          *(fmt(st[key], st[f"{key}_ci95"]) for key in KIND_KEYS))
        if any(r["kinds"] for r in rows):
            t.add_section()
    return t


def errorbars(ax, pts: list[tuple[int, dict]], key: str, style: str, colour: str,
              label: str | None = None) -> None:
    """One series, `key` ± `key_ci95`, of (iteration, row) points, those with a value."""
    xye = [(k, d[key], d[f"{key}_ci95"] or 0.0) for k, d in pts if d.get(key) is not None]
    if xye:
        x, y, e = zip(*xye, strict=True)
        ax.errorbar(x, y, yerr=e, capsize=3, marker="o", linestyle=style, color=colour,
                    label=label)


def plot(summaries: dict[Path, list[dict]], out: Path, n_seeds: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # (panel, key, line style): the zoom hit rate of the test split (greedy; none while the
    # greedy policy does not zoom) and of the training rollouts, dashed, in one panel.
    series = ((0, "test_accuracy", "-"), (1, "zoom_hit_rate", "-"),
              (1, "rollout_zoom_hit_rate", "--"), (2, "rollout_zoom_share", "-"),
              (2, "rollout_found", "--"))
    titles = ("test accuracy %", "zoom hit rate % (test; rollouts dashed)",
              "rollouts that zoom % (dashed: that find the logo)")
    # A second row, one panel per question kind: its test accuracy, and the rollouts that find
    # its target (dashed) and that call its own tool (dotted): whether each kind learns its tool.
    present = sorted({kd for rows in summaries.values() for r in rows for kd in r["kinds"]},
                   key=kind_order)
    n_rows, cols = 1 + bool(present), max(3, len(present))
    fig, grid = plt.subplots(n_rows, cols, figsize=(14 * cols / 3, 3.6 * n_rows), dpi=100,
                             squeeze=False)
    for i, (run, rows) in enumerate(summaries.items()):
        for panel, key, style in series:
            errorbars(grid[0][panel], [(r["iter"], r) for r in rows], key, style, f"C{i}",
                      run.name if panel == 0 else None)
        for j, kind in enumerate(present):
            pts = [(r["iter"], r["kinds"][kind]) for r in rows if kind in r["kinds"]]
            tool = KIND_TOOL.get(kind)
            for key, style in (("test_accuracy", "-"), ("rollout_found", "--"),
                               *([(f"rollout_{tool}", ":")] if tool else [])):
                errorbars(grid[1][j], pts, key, style, f"C{i}")
    for j, title in enumerate(titles):
        grid[0][j].set_title(title, fontsize=9)
    for j, kind in enumerate(present):
        tool = KIND_TOOL.get(kind)
        grid[1][j].set_title(f"{kind}: test accuracy %\n(dashed: rollouts that find it"
                             + (f"; dotted: that call {tool})" if tool else ")"), fontsize=9)
    for ax in grid.flat:
        ax.set_xlabel("RL iteration (0: SFT)")
        ax.grid(alpha=0.3)
    for ax in [*grid[0][len(titles):], *(grid[1][len(present):] if present else [])]:
        ax.set_axis_off()  # a row's panels beyond its series (more kinds than 3, or fewer)
    grid[0][0].legend(fontsize=8)
    fig.suptitle(f"mean ± 95% CI over {n_seeds} RL seed(s)", fontsize=9)
    fig.tight_layout()
    with AtomicFile(out, "wb") as fh:
        fig.savefig(fh, format="png")
    plt.close(fig)


def summarize(run: Path, iters: int, seeds: int) -> list[dict]:
    """`run`'s rows over its `seeds` RL seeds (`aggregate`), also written to RUN/summary.json."""
    per_seed = {s: {k: r for k in range(iters + 1) if (r := iteration(seed_run(run, s), k))}
                for s in range(seeds)}
    rows = aggregate(per_seed, iters)
    with AtomicFile(run / "summary.json") as fh:
        fh.write(orjson.dumps({"v": 2, "run": str(run), "seeds": seeds, "iterations": rows},
                              option=orjson.OPT_INDENT_2))
    return rows
