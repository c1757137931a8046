"""`marscli report` and `marscli plot` on a run folder made by the real agent loop
(helpers.make_run, conftest's `run_dir`): the HTML opens in headless Chromium and shows the list
and the images, references nothing outside itself, escapes the text; the PNG has the panels it
should."""

from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from helpers import METRIC_KEYS, marscli

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (Debian: apt-get install -y chromium)")


def cli(*args: str) -> subprocess.CompletedProcess:
    return marscli(*args, timeout=300)


@pytest.fixture(scope="module")
def report_html(run_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("out") / "report.html"
    res = cli("report", str(run_dir), "-o", str(out))
    assert res.returncode == 0, res.stderr
    assert "wrote" in res.stderr and "8 of 8 trajectories" in res.stderr
    return out


def chromium(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--no-first-run", f"--user-data-dir={tmp / 'profile'}", *args],
        capture_output=True, text=True, timeout=180, check=False)


def test_report_is_self_contained(report_html):
    html = report_html.read_text()
    assert "http://" not in html and "https://" not in html  # no CDN, no external anything
    assert not re.search(r"<link\b|@import|<script[^>]+src=|<iframe", html)
    # every <img> src is a data URL (or filled in from the embedded table)
    assert all(s.startswith("data:image/") for s in re.findall(r'<img[^>]*\ssrc="([^"]*)"', html))
    table = json.loads(re.search(r'<script type="application/json" id="mc-images">(.*?)</script>',
                                 html, re.DOTALL).group(1))
    # 1 scene (shared by all samples) + 1 thumbnail per search (2) + 2 crops per zoom (4 A runs)
    assert len(table) == 1 + 2 + 4 * 2
    assert all(u.startswith("data:image/jpeg;base64,") for u in table.values())
    assert len(re.findall(r'<details class="traj"', html)) == 8
    assert html.count("data-im=") >= 8
    assert '<img class="curves" src="data:image/png;base64,' in html


def test_embedded_images_are_downscaled(report_html):
    import base64

    html = report_html.read_text()
    table = json.loads(re.search(r'id="mc-images">(.*?)</script>', html, re.DOTALL).group(1))
    sizes = [Image.open(io.BytesIO(base64.b64decode(u.split(",", 1)[1]))).size
             for u in table.values()]
    assert max(max(s) for s in sizes) == 512  # the 1600x1200 scene → 512x384
    assert (512, 384) in sizes


def test_crop_boxes_are_drawn_on_the_input_image(report_html):
    """Crop 1 = [500..1000]² of image 0; crop 2 = [0,0,500,250] of crop 1, i.e. the region
    x 0.5..0.75, y 0.5..0.625 of image 0 (mapped back through the parent's box)."""
    from marscli.view.report import box_in

    imgs = [{"path": "a"}, {"path": "b", "from": 0, "bbox_2d": [500, 500, 1000, 1000]},
            {"path": "c", "from": 1, "bbox_2d": [0, 0, 500, 250]}, {"path": "t", "title": "x"}]
    assert box_in(imgs, 2, 0) == (0.5, 0.5, 0.75, 0.625)
    assert box_in(imgs, 2, 1) == (0.0, 0.0, 0.5, 0.25)
    assert box_in(imgs, 3, 0) is None and box_in(imgs, 0, 0) is None
    html = report_html.read_text()
    assert 'style="left:50.00%;top:50.00%;width:25.00%;height:12.50%"><b>2</b>' in html
    assert 'style="left:50.00%;top:50.00%;width:50.00%;height:50.00%"><b>1</b>' in html


@needs_chromium
def test_report_renders_in_headless_chromium(report_html, tmp_path):
    shot = tmp_path / "shot.png"
    res = chromium(tmp_path, f"--screenshot={shot}", "--window-size=1280,2000",
                   report_html.as_uri())
    assert shot.is_file(), res.stderr[-2000:]
    im = Image.open(shot).convert("RGB")
    assert im.size == (1280, 2000)
    px = np.asarray(im).reshape(-1, 3).astype(int)
    assert len(np.unique(px, axis=0)) > 200  # text, curves, badges, pictures: far from blank
    assert (px != 255).any(axis=1).mean() > 0.1
    # the input image is on screen: the scene's red quadrant and green block, JPEG-tolerant
    r, g, b = px.T
    red = int(((r > 170) & (g < 70) & (b < 70)).sum())
    green = int(((g > 170) & (r < 70) & (b < 70)).sum())
    assert red > 5_000 and green > 1_000, (red, green)


@needs_chromium
def test_report_filters_run_in_the_page(report_html, tmp_path):
    """The fragment presets the filters: only the 4 trajectories with accuracy 0 stay visible,
    and the script has filled in every image from the embedded table."""
    res = chromium(tmp_path, "--dump-dom", report_html.as_uri() + "#acc=wrong")
    dom = res.stdout
    assert '<span id="f-count">4 of 8 shown</span>' in dom, res.stderr[-2000:]
    cards = re.findall(r'<details class="traj"[^>]*>', dom)
    assert len(cards) == 8
    shown = [c for c in cards if " hidden" not in c]
    assert len(shown) == 4 and all('data-acc="wrong"' in c for c in shown)
    imgs = re.findall(r"<img [^>]*>", dom)
    assert imgs and all('src="data:image/' in t for t in imgs)
    res = chromium(tmp_path, "--dump-dom", report_html.as_uri() + "#stop=max_turns&iter=iter-0")
    assert '<span id="f-count">1 of 8 shown</span>' in res.stdout


def test_report_of_one_trajectory_file_escapes_text(run_dir, tmp_path):
    from marscli.stages.report import main as report

    rows = [json.loads(x) for x in (run_dir / "iter-1/scored.jsonl").read_text().splitlines()]
    rows[0]["question"] = "<script>alert('q')</script> & <b>bold</b>"
    rows[0]["segments"][1]["text"] = ("<thinking><img src=x onerror=alert(1)></thinking>"
                                      "<answer>a</answer>")
    rows[1]["images"][0]["path"] = "no/such/picture.png"
    f = tmp_path / "iter-1" / "traj.jsonl"
    f.parent.mkdir()
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "scene.png").write_bytes((run_dir / "scene.png").read_bytes())
    shutil.copytree(run_dir / "iter-1/rollouts.jsonl.media", f.parent / "rollouts.jsonl.media")
    out = tmp_path / "one.html"
    info = report(str(f), str(out))
    assert info == {"trajectories": 4, "shown": 4, "images": info["images"], "iterations": 1,
                    "curves": False, "bytes": out.stat().st_size}
    html = out.read_text()
    assert "<script>alert" not in html and "<img src=x" not in html and "<b>bold" not in html
    assert "&lt;script&gt;alert(&#x27;q&#x27;)&lt;/script&gt; &amp; &lt;b&gt;bold&lt;/b&gt;" in html
    assert "&lt;img src=x onerror=alert(1)&gt;" in html
    assert "image not found" in html and "no/such/picture.png" in html
    assert "No curves:" in html and 'id="f-iter"' not in html
    assert 'data-acc="unscored"' in html


def test_report_limits_trajectories_to_whole_groups(run_dir, tmp_path):
    from marscli.view.report import build, pick_groups

    assert pick_groups({"a": 2, "b": 2, "c": 2, "d": 2}, 4) == {"b", "d"}
    assert pick_groups({"a": 2, "b": 2, "c": 2}, 100) == {"a", "b", "c"}
    assert pick_groups({"a": 8}, 3) == {"a"}  # a group bigger than the quota: cut by the caller
    assert pick_groups({"a": 2}, 0) == set()
    html, info = build(str(run_dir), max_trajectories=4)
    assert info["shown"] == 4 and info["trajectories"] == 8
    cards = re.findall(r'<details class="traj"[^>]*>', html)
    assert len(cards) == 4 and sum('data-iter="iter-0"' in c for c in cards) == 2
    # a whole group per iteration: both samples of one prompt
    ids = re.findall(r'<span class="tid">([^<]*)</span>', html)
    assert sorted(ids) == ["q2#0", "q2#0", "q2#1", "q2#1"]
    html, info = build(str(run_dir), max_trajectories=0)
    assert info["shown"] == 0 and "No trajectories." in html


def test_report_without_matplotlib_still_works(run_dir, monkeypatch):
    import sys

    from marscli.view.report import build

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib → ImportError
    html, info = build(str(run_dir), max_trajectories=2)
    assert info["curves"] is False and "marscli[viz]" in html


# ---------------------------------------------------------------------------------- run stats


def test_discover_orders_iterations_by_number(tmp_path):
    from marscli.view.runs import discover

    for k in (10, 2, 1):
        d = tmp_path / f"iter-{k}"
        d.mkdir()
        (d / "metrics.jsonl").write_text('{"step": 0, "loss": 1.0}\n')
    (tmp_path / "iter-3").mkdir()  # nothing in it: left out
    (tmp_path / "notes").mkdir()
    run = discover(str(tmp_path))
    assert run.kind == "run" and [it.index for it in run.iterations] == [1, 2, 10]
    one = discover(str(tmp_path / "iter-2"))
    assert one.kind == "iteration" and one.iterations[0].index == 2


def test_iteration_statistics_by_hand(run_dir):
    from marscli.view.runs import discover, iteration_stats

    run = discover(str(run_dir))
    assert [it.name for it in run.iterations] == ["iter-0", "iter-1"]
    it0, it1 = run.iterations
    assert Path(it0.rows).name == "scored.jsonl" and Path(it0.advantages).name == "advantages.jsonl"
    assert Path(it1.metrics[0]).parent.name == "ckpt"
    s0, s1 = iteration_stats(it0), iteration_stats(it1)
    # iter-0: q1#0 A 1.5, q1#1 B 0.5 (wrong, clean), q2#0 C 0, q2#1 A 0.5 (wrong, clean)
    assert s0.traj["reward"] == pytest.approx(0.625) and s0.traj["accuracy"] == 0.25
    assert s0.traj["turns"] == 2.75 and s0.traj["answered"] == 0.75
    assert s0.traj["tool_calls.image_zoom_in_tool"] == 1.0  # 2 trajectories × 2 zooms / 4
    assert s0.traj["tool_calls.image_search_tool"] == 0.25
    assert s0.traj["zero_std_groups"] == 0.0 and s0.traj["unscored"] == 0.0
    assert s0.traj["advantage_abs"] == pytest.approx((0.5 + 0.5 + 0.25 + 0.25) / 4)
    # iter-1: q1 A, A (1.5, 1.5: equal); q2#0 B 0.5; q2#1 unscored
    assert s1.traj["reward"] == pytest.approx(3.5 / 3) and s1.traj["unscored"] == 0.25
    assert s1.traj["zero_std_groups"] == 1.0  # q2 has one scored row: not a group
    assert s0.metrics["loss"] == pytest.approx(0.105) and s1.metrics["loss"] == pytest.approx(0.155)
    assert "step" not in s0.metrics


# ---------------------------------------------------------------------------------- plot


def png_size(path: Path) -> tuple[int, int]:
    im = Image.open(path)
    im.load()
    return im.size


def test_plot_of_a_run(run_dir, tmp_path):
    from marscli.view.plot import figure_size, panels_for

    _, panels = panels_for(str(run_dir))
    titles = [p.title for p in panels]
    assert titles == ["mean reward", "accuracy", "format reward", "turns", "response tokens",
                      "tool calls / trajectory", "groups with equal rewards",
                      "loss", "pg_loss", "kl", "clip_frac", "grad_norm", "lr"]
    tools = panels[5].series
    assert sorted(tools) == ["image_search_tool", "image_zoom_in_tool"]
    assert tools["image_zoom_in_tool"] == ([0.0, 1.0], [1.0, 1.0])
    out = tmp_path / "curves.png"
    res = cli("plot", str(run_dir), "-o", str(out))
    assert res.returncode == 0, res.stderr
    assert "wrote 13 panels" in res.stderr
    assert png_size(out) == figure_size(13) == (1440, 1000)  # 4 columns × 4 rows
    px = np.asarray(Image.open(out).convert("RGB")).reshape(-1, 3)
    assert len(np.unique(px, axis=0)) > 50 and out.stat().st_size > 20_000
    assert [p.name for p in tmp_path.iterdir()] == ["curves.png"]  # no temp file left


def test_plot_of_a_metrics_file(run_dir, tmp_path):
    out = tmp_path / "m.png"
    res = cli("plot", str(run_dir / "iter-0/metrics.jsonl"), "-o", str(out))
    assert res.returncode == 0, res.stderr
    assert f"wrote {len(METRIC_KEYS)} panels" in res.stderr
    assert png_size(out) == (1440, 500)  # 6 panels: 4 columns × 2 rows

    from marscli.view.plot import metrics_panels

    panels = metrics_panels(str(run_dir / "iter-0/metrics.jsonl"))
    assert [p.title for p in panels] == ["loss", "pg_loss", "kl", "clip_frac", "grad_norm", "lr"]
    assert panels[0].series["loss"] == ([0.0, 1.0], [0.1, 0.11])


def test_plot_groups_the_rollout_correction_metrics(tmp_path):
    from marscli.view.plot import metrics_panels

    rows = [{"step": 1, "loss": 0.1, "logprob_mismatch": 0.02, "rollout_kl": 1e-4,
             "rollout_is_mean": 1.0, "rollout_is_min": 0.5, "rollout_is_max": 3.0,
             "rollout_is_seq_mean": 1.0, "rollout_is_seq_min": 0.9, "rollout_is_seq_max": 1.1,
             "rollout_masked_frac": 0.0, "rollout_masked_seq_frac": 0.0,
             "rollout_truncated_frac": 0.01},
            {"step": 2, "loss": 0.2, "logprob_mismatch": None, "rollout_kl": 2e-4,
             "rollout_is_mean": 1.0, "rollout_is_min": 0.4, "rollout_is_max": 2.5,
             "rollout_is_seq_mean": 1.0, "rollout_is_seq_min": 0.9, "rollout_is_seq_max": 1.2,
             "rollout_masked_frac": 0.0, "rollout_masked_seq_frac": 0.0,
             "rollout_truncated_frac": 0.02}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    panels = metrics_panels(str(path))
    assert [p.title for p in panels] == [
        "loss", "logprob_mismatch", "rollout_kl", "rollout IS weight, token",
        "rollout IS weight, sequence", "rollout: share without loss / truncated"]
    assert panels[1].series["logprob_mismatch"] == ([1.0], [0.02])  # null: no point
    assert sorted(panels[3].series) == ["is_max", "is_mean", "is_min"]
    assert panels[3].series["is_max"] == ([1.0, 2.0], [3.0, 2.5])
    assert sorted(panels[5].series) == ["masked_frac", "masked_seq_frac", "truncated_frac"]
    path.write_text(json.dumps({"step": 1, "loss": 0.1, "logprob_mismatch": None}) + "\n")
    assert [p.title for p in metrics_panels(str(path))] == ["loss"]  # never present: no panel


def test_plot_bad_inputs(run_dir, tmp_path):
    res = cli("plot", str(run_dir / "iter-0/scored.jsonl"), "-o", str(tmp_path / "x.png"))
    assert res.returncode == 2 and "holds trajectory rows" in res.stderr
    res = cli("plot", str(tmp_path / "nowhere"), "-o", str(tmp_path / "x.png"))
    assert res.returncode == 2 and "no such file or folder" in res.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    res = cli("report", str(empty), "-o", str(tmp_path / "x.html"))
    assert res.returncode == 2 and res.stderr.startswith("error: ") and "iter-K" in res.stderr
    assert not (tmp_path / "x.png").exists() and not (tmp_path / "x.html").exists()


@pytest.mark.parametrize("opts, message", [
    ({"max_trajectories": -1}, "--max-trajectories: -1 is out of range — must be >= 0"),
    ({"image_px": 8}, "--image-px: 8 is out of range — must be >= 16 and <= 8192"),
])
def test_report_options_are_checked_by_the_stage(tmp_path, opts, message):
    from marscli.errors import BadInput
    from marscli.stages.report import main

    with pytest.raises(BadInput, match=f"^{message}$"):
        main(str(tmp_path / "nowhere"), str(tmp_path / "x.html"), **opts)
    res = cli("report", str(tmp_path / "nowhere"), "-o", str(tmp_path / "x.html"),
              *(f"--{k.replace('_', '-')}={v}" for k, v in opts.items()))
    assert res.returncode == 2 and res.stderr == f"error: {message}\n"
    assert not list(tmp_path.iterdir())
