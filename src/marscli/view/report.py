"""One self-contained HTML page for a run (or one trajectory JSONL); `marscli report` writes it
(stages/report.py).

The page holds the curves (the `plot` PNG), a per-iteration table, and a filterable list of
trajectories: each turn's thinking, tool call, observation and answer, with the images. Nothing
is fetched at view time: no server, no CDN, no external CSS or JS; images are embedded as
base64 data URLs, downscaled to at most `image_px` on their longer side and re-encoded as JPEG.

- Each image file is embedded once (the G samples of a prompt share the input image): `<img>`
  tags carry `data-im="K"` and an inline script fills in their `src` from one JSON table.
- A crop's box is drawn over every image it descends from, with CSS (percent offsets), so the
  same embedded picture serves every trajectory; a crop of a crop is mapped back through its
  parent's box.
- At most `max_trajectories` rows are shown, split evenly over the iterations: whole prompt
  groups (the G samples side by side), evenly spaced through each file, found by a second pass
  (stdin: the first rows). Statistics use every row.
- Text is escaped with html.escape, JSON in <script> with `<\\/`, and redacted first
  (`marscli.secrets.redact`): a password in a URL, a secret query parameter or a known API key
  that an older record carries is never printed into the page.
- Filters (text, stop reason, accuracy, iteration) run in the page, and their state is kept in
  the URL fragment (`report.html#stop=max_turns&acc=wrong`), so a filtered view can be shared;
  `&open=1` expands the trajectories shown.
"""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import Any

import orjson

from marscli import __version__
from marscli.errors import RuntimeFailure
from marscli.records.provenance import note_inputs
from marscli.secrets import redact
from marscli.view.inspect import Block, blocks, describe_image, fmt_num, header, title
from marscli.view.runs import (
    Iteration,
    IterStats,
    Run,
    discover,
    iter_trajectories,
    iteration_stats,
    number,
    reward_part,
)


def esc(text: str) -> str:
    """Escaped for HTML, and without secrets (URL userinfo, secret query parameters, keys)."""
    return html.escape(redact(text))


# ---------------------------------------------------------------------------------- images


class ImageStore:
    """Resolved path → one downscaled data URL, numbered in order of first use."""

    def __init__(self, max_px: int) -> None:
        self.max_px = max_px
        self.keys: dict[str, int | None] = {}
        self.urls: dict[int, str] = {}
        self.bytes = 0

    def key(self, path: Path) -> int | None:
        p = str(path.resolve())
        if p not in self.keys:
            url = self._encode(path)
            if url is None:
                self.keys[p] = None
            else:
                k = len(self.urls)
                self.urls[k] = url
                self.keys[p] = k
                self.bytes += len(url)
        return self.keys[p]

    def _encode(self, path: Path) -> str | None:
        from PIL import Image, UnidentifiedImageError

        if not path.is_file():  # a folder, a named pipe (which would block), a device
            return None
        note_inputs(path)  # the page may not be written onto a picture it shows
        try:
            with Image.open(path) as im:
                im.draft("RGB", (self.max_px, self.max_px))
                if im.mode in ("RGBA", "LA", "P"):
                    im = im.convert("RGBA")
                    bg = Image.new("RGB", im.size, (255, 255, 255))
                    bg.paste(im, mask=im.split()[-1])
                    im = bg
                else:
                    im = im.convert("RGB")
                im.thumbnail((self.max_px, self.max_px), Image.LANCZOS)
                buf = io.BytesIO()
                im.save(buf, "JPEG", quality=80, optimize=True)
        except (OSError, UnidentifiedImageError, ValueError, Image.DecompressionBombError):
            return None
        return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _clamp_box(b: Any) -> tuple[float, float, float, float] | None:
    if not isinstance(b, list) or len(b) != 4 or any(number(v) is None for v in b):
        return None
    x1, y1, x2, y2 = (min(1000.0, max(0.0, float(v))) / 1000 for v in b)
    return min(x1, x2), min(y1, y2), max(x1, x2), max(y1, y2)


def box_in(images: list, d: int, a: int) -> tuple[float, float, float, float] | None:
    """Image d's region in image a's coordinates (fractions 0..1), if d descends from a."""
    box = (0.0, 0.0, 1.0, 1.0)
    cur = d
    for _ in range(len(images)):
        if cur == a:
            return None if d == a else box
        im = images[cur] if 0 <= cur < len(images) else None
        parent = im.get("from") if isinstance(im, dict) else None
        b = _clamp_box(im.get("bbox_2d")) if isinstance(im, dict) else None
        if (not isinstance(parent, int) or isinstance(parent, bool) or not 0 <= parent < cur
                or b is None):
            return None
        w, h = b[2] - b[0], b[3] - b[1]
        box = (b[0] + box[0] * w, b[1] + box[1] * h, b[0] + box[2] * w, b[1] + box[3] * h)
        cur = parent
    return None


# ---------------------------------------------------------------------------------- HTML pieces


def _kind(rec: dict, idx: int) -> str:
    """CSS class of an image in an observation: a search thumbnail or a crop."""
    imgs = rec.get("images") or []
    im = imgs[idx] if 0 <= idx < len(imgs) and isinstance(imgs[idx], dict) else {}
    return "thumb" if ("title" in im or "thumbnail" in im) and "from" not in im else "crop"


class Page:
    """Renders trajectories into HTML, collecting the images they use."""

    def __init__(self, store: ImageStore) -> None:
        self.store = store

    def image(self, rec: dict, base: Path, idx: int, cls: str = "") -> str:
        imgs = rec.get("images") or []
        cap = esc(describe_image(rec, idx))
        if not 0 <= idx < len(imgs) or not isinstance(imgs[idx], dict):
            return f'<figure class="im missing"><figcaption>{cap}</figcaption></figure>'
        p = Path(str(imgs[idx].get("path", "")))
        key = self.store.key(p if p.is_absolute() else base / p)
        if key is None:
            return (f'<figure class="im missing {cls}"><div class="miss">image not found</div>'
                    f"<figcaption>{cap}</figcaption></figure>")
        boxes = []
        for d in range(idx + 1, len(imgs)):
            b = box_in(imgs, d, idx)
            if b is None:
                continue
            label = imgs[d].get("label") if isinstance(imgs[d], dict) else None
            tip = esc(f"image {d}" + (f": {label}" if label else ""))
            corner = " br" if d % 2 else ""  # labels alternate corners so nested boxes show both
            boxes.append(
                f'<div class="box c{d % 6}{corner}" title="{tip}" style="left:{100 * b[0]:.2f}%;'
                f"top:{100 * b[1]:.2f}%;width:{100 * (b[2] - b[0]):.2f}%;"
                f'height:{100 * (b[3] - b[1]):.2f}%"><b>{d}</b></div>')
        return (f'<figure class="im {cls}"><div class="frame"><img data-im="{key}" alt="{cap}">'
                f'{"".join(boxes)}</div><figcaption>{cap}</figcaption></figure>')

    def observation(self, rec: dict, base: Path, b: Block) -> str:
        pieces = b.text.split("<image>")
        imgs = list(b.images or [])
        out = [esc(pieces[0])]
        for i, piece in enumerate(pieces[1:]):
            out.append(self.image(rec, base, imgs[i], _kind(rec, imgs[i]))
                       if i < len(imgs) else "[image]")
            out.append(esc(piece))
        out += [self.image(rec, base, k, _kind(rec, k)) for k in imgs[len(pieces) - 1:]]
        return "".join(out)

    def block(self, rec: dict, base: Path, b: Block) -> str:
        if b.kind == "question":
            figs = "".join(self.image(rec, base, i, "input") for i in b.images or [])
            return (f'<div class="blk question"><div class="bt">question</div>'
                    f'<div class="txt">{esc(b.text)}</div><div class="figs">{figs}</div></div>')
        if b.kind == "observation":
            state = "ok" if b.ok else "bad"
            return (f'<div class="blk obs {state}"><div class="bt">{esc(b.title)}</div>'
                    f'<div class="txt">{self.observation(rec, base, b)}</div></div>')
        return (f'<div class="blk {b.kind}"><div class="bt">{esc(b.title)}</div>'
                f'<div class="txt">{esc(b.text)}</div></div>')

    def trajectory(self, rec: dict, base: Path, iteration: str, open_: bool) -> str:
        acc = reward_part(rec, "accuracy")
        r = rec.get("reward")
        if acc is not None:
            acc_key, acc_label = ("correct", "✓") if acc > 0 else ("wrong", "✗")
            acc_label += f" {fmt_num(acc)}"
        elif isinstance(r, dict) and r.get("status") == "unscored":
            acc_key, acc_label = "unscored", "unscored"
        else:
            acc_key, acc_label = "none", "not scored"
        stop = str(rec.get("stop", "?"))
        tools = " ".join(f"{esc(str(k))}×{esc(str(v))}"
                         for k, v in (rec.get("tool_calls") or {}).items())
        summ = [f'<span class="tid">{esc(str(rec.get("id", "?")))}</span>',
                (f'<span class="badge stop-{"answer" if stop == "answer" else "other"}">'
                 f"{esc(stop)}</span>"),
                f'<span class="badge acc-{acc_key}">{esc(acc_label)}</span>',
                f'<span>reward {esc(fmt_num(reward_part(rec, "total")))}</span>']
        if "advantage" in rec:
            summ.append(f'<span>adv {esc(fmt_num(rec["advantage"], signed=True))}</span>')
        summ.append(f'<span>{esc(str(rec.get("turns", "?")))} turns</span>')
        if tools:
            summ.append(f'<span class="tools">{tools}</span>')
        summ.append(f'<span class="it">{esc(iteration)}</span>')
        rows = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>"
                       for k, v in header(rec) if k != "question")
        body = "".join(self.block(rec, base, b) for b in blocks(rec))
        return (f'<details class="traj" data-stop="{esc(stop)}" data-acc="{acc_key}" '
                f'data-iter="{esc(iteration)}"{" open" if open_ else ""}>'
                f'<summary>{" ".join(summ)}</summary>'
                f'<div class="meta"><div class="sub">{esc(title(rec))}</div>'
                f'<table class="kv">{rows}</table></div>{body}</details>')


# ---------------------------------------------------------------------------------- page


TABLE_FIRST = ("trajectories", "reward", "accuracy", "format", "unscored", "answered", "turns",
               "response_tokens", "mask_share", "format_errors")


def stats_table(stats: list[IterStats]) -> str:
    from marscli.view.plot import metric_sort

    traj_keys = {k for s in stats for k in s.traj}
    cols = [("traj", k) for k in TABLE_FIRST if k in traj_keys]
    cols += [("traj", k) for k in sorted(traj_keys - set(TABLE_FIRST))]
    cols += [("metrics", k) for k in metric_sort({k for s in stats for k in s.metrics})]
    cols += [("eval", k) for k in sorted({k for s in stats for k in s.eval})]
    if not cols:
        return ""
    head = "".join(f"<th>{esc(k)}</th>" for _, k in cols)
    body = []
    for s in stats:
        cells = "".join(f"<td>{esc(fmt_num(getattr(s, part).get(k)))}</td>" for part, k in cols)
        body.append(f"<tr><th>{esc(s.iteration.name)}</th>{cells}</tr>")
    return (f'<div class="scroll"><table class="stats"><tr><th></th>{head}</tr>'
            f'{"".join(body)}</table></div>')


def curves(run: Run, stats: list[IterStats]) -> tuple[bytes | None, str]:
    """The plot PNG for the page, or None and why not."""
    from marscli.view.plot import metrics_panels, render_png, run_panels

    if run.kind == "run" and len(stats) > 1:
        panels = run_panels(stats)
    elif run.iterations[0].metrics:
        panels = metrics_panels(run.iterations[0].metrics[0])
    else:
        return None, "one iteration and no metrics file: nothing to draw curves of"
    if not panels:
        return None, "no numeric values to plot"
    try:
        return render_png(panels, run.name), ""
    except RuntimeFailure as e:
        return None, str(e)


def quotas(n_iters: int, total: int) -> list[int]:
    """`total` rows split over iterations, the remainder going to the latest."""
    if n_iters == 0:
        return []
    q, r = divmod(total, n_iters)
    return [q + (1 if i >= n_iters - r else 0) for i in range(n_iters)]


def group_of(row: dict) -> str:
    return str(row.get("prompt_id", row.get("id")))


def pick_groups(sizes: dict[str, int], quota: int) -> set[str]:
    """Whole prompt groups, evenly spaced through the file, as many as fit in `quota` rows (the
    G samples of a prompt side by side are what explains an advantage)."""
    order = list(sizes)
    if not order or quota <= 0:
        return set()
    mean = sum(sizes.values()) / len(order)
    k = max(1, min(len(order), int(quota // mean)))
    chosen, rows = [], 0
    for i in range(k):
        g = order[(2 * i + 1) * len(order) // (2 * k)]  # the middle of each of k slices
        if chosen and rows + sizes[g] > quota:
            break
        chosen.append(g)
        rows += sizes[g]
    return set(chosen)


def _shown_rows(it: Iteration, quota: int) -> tuple[IterStats, list[dict]]:
    """The iteration's statistics and the rows to show: whole groups from a second pass over
    the file; the first `quota` rows from stdin, which cannot be read twice."""
    if it.rows == "-":
        kept: list[dict] = []
        st = iteration_stats(it, lambda r: kept.append(r) if len(kept) < quota else None)
        return st, kept
    sizes: dict[str, int] = {}

    def count(row: dict) -> None:
        sizes[group_of(row)] = sizes.get(group_of(row), 0) + 1

    st = iteration_stats(it, count)
    chosen = pick_groups(sizes, quota)
    rows = [r for r in iter_trajectories(it) if group_of(r) in chosen] if chosen else []
    return st, rows[:quota]


def build(path: str, max_trajectories: int = 200, image_px: int = 512,
          page_title: str | None = None) -> tuple[str, dict]:
    """The report's HTML and a few numbers about it."""
    run = discover(path)
    store = ImageStore(image_px)
    page = Page(store)
    cards: list[str] = []
    stats: list[IterStats] = []
    seen, stops = 0, set()
    with_rows = [it for it in run.iterations if it.rows]
    quota = dict(zip((it.name for it in with_rows), quotas(len(with_rows), max_trajectories)))
    for it in run.iterations:
        base = Path.cwd() if it.rows in (None, "-") else Path(it.rows).resolve().parent
        st, kept = _shown_rows(it, quota.get(it.name, 0))
        stats.append(st)
        seen += int(st.traj.get("trajectories", 0))
        for rec in kept:
            stops.add(str(rec.get("stop", "?")))
            cards.append(page.trajectory(rec, base, it.name, open_=not cards))
    png, why = curves(run, stats)
    name = page_title or run.name
    iters = [it.name for it in with_rows]
    html_text = _page(name, path, run, stats, png, why, cards, seen, sorted(stops), iters, store)
    return html_text, {"trajectories": seen, "shown": len(cards), "images": len(store.urls),
                       "iterations": len(run.iterations), "curves": png is not None}


def _page(name: str, path: str, run: Run, stats: list[IterStats], png: bytes | None, why: str,
          cards: list[str], seen: int, stops: list[str], iters: list[str],
          store: ImageStore) -> str:
    if png is not None:
        src = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
        curves_html = f'<img class="curves" src="{src}" alt="training curves">'
    else:
        curves_html = f'<p class="note">No curves: {esc(why)}.</p>'
    stop_opts = "".join(f'<option value="{esc(s)}">{esc(s)}</option>' for s in stops)
    iter_sel = ""
    if len(iters) > 1:
        opts = "".join(f'<option value="{esc(i)}">{esc(i)}</option>' for i in iters)
        iter_sel = (f'<label>iteration <select id="f-iter"><option value="">all</option>'
                    f"{opts}</select></label>")
    images_json = orjson.dumps({str(k): v for k, v in store.urls.items()}).decode()
    images_json = images_json.replace("</", "<\\/")
    shown = (f"{len(cards):,} of {seen:,} trajectories"
             + (" (whole prompt groups, spread evenly through each iteration)"
                if len(cards) < seen else ""))
    kinds = {"run": "run folder", "iteration": "iteration folder",
             "trajectories": "trajectory file"}
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{esc(name)} — marscli report</title>
<style>{CSS}</style></head>
<body>
<header><h1>{esc(name)}</h1>
<p class="sub">{esc(kinds[run.kind])} <code>{esc(path)}</code> · \
{len(run.iterations)} iteration(s) ·
{esc(shown)} · marscli {esc(__version__)}</p></header>
<section id="curves"><h2>Curves</h2>{curves_html}</section>
<section id="iterations"><h2>Iterations</h2>{stats_table(stats)}</section>
<section id="trajectories"><h2>Trajectories</h2>
<div class="filters">
<input id="f-text" type="search" placeholder="filter by text (id, question, thinking, answer…)">
<label>stop <select id="f-stop"><option value="">all</option>{stop_opts}</select></label>
<label>accuracy <select id="f-acc"><option value="">all</option>
<option value="correct">&gt; 0</option><option value="wrong">= 0</option>
<option value="unscored">unscored</option><option value="none">not scored</option></select></label>
{iter_sel}
<button type="button" id="f-open">expand all</button>
<button type="button" id="f-close">collapse all</button>
<span id="f-count">{len(cards):,} shown</span></div>
<div id="list">
{"".join(cards) if cards else '<p class="note">No trajectories.</p>'}
</div></section>
<script type="application/json" id="mc-images">{images_json}</script>
<script>{JS}</script>
</body></html>
"""


# The page's style and script ship as package data beside this module, read byte for byte.


def _asset(name: str) -> str:
    return (Path(__file__).parent / name).read_text(encoding="utf-8")


CSS = _asset("report.css")

JS = _asset("report.js")

