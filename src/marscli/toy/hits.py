"""Zoom hit rate: the share of a toy trajectory's zoom calls whose box holds the whole logo.

A crop's `bbox_2d` (in its record's `images`) is in Qwen3-VL's 0..1000 coordinates of the
image it was cut from (`from`), so a zoom into a crop is mapped back through its chain of crops
to the scene first. The logo's box is the world's ground truth (`toy.logo_box`, pixels of a
`toy.size`-pixel scene). Where MARS learns where to look, this is what moves.
"""

from __future__ import annotations

from pathlib import Path

Box = tuple[float, float, float, float]
SCENE: Box = (0.0, 0.0, 1000.0, 1000.0)


def _in_scene(images: list[dict], j: int, seen: frozenset[int] = frozenset()) -> Box:
    """Image j's region of the scene (image 0), in the scene's 0..1000 coordinates."""
    im = images[j]
    if j == 0 or "bbox_2d" not in im or j in seen:
        return SCENE
    px0, py0, px1, py1 = _in_scene(images, int(im.get("from", 0)), seen | {j})
    x0, y0, x1, y1 = (float(v) for v in im["bbox_2d"])
    w, h = (px1 - px0) / 1000, (py1 - py0) / 1000
    return px0 + x0 * w, py0 + y0 * h, px0 + x1 * w, py0 + y1 * h


def scene_side(record: dict, base: Path | None) -> int | None:
    """The scene's side in pixels: `toy.size`, or (a world written before it was recorded) the
    width of the scene file, relative to `base` (the record file's folder)."""
    toy, images = record.get("toy") or {}, record.get("images") or []
    if "size" in toy:
        return int(toy["size"])
    if base is None or not images or not (base / images[0].get("path", "")).is_file():
        return None
    from PIL import Image

    with Image.open(base / images[0]["path"]) as im:  # reads the header only
        return im.width


def zoom_hits(record: dict, base: Path | None = None) -> tuple[int, int]:
    """(zoom calls, hits) of one trajectory record of the toy world; (0, 0) without a zoom or
    without the world's ground truth."""
    toy, images = record.get("toy") or {}, record.get("images") or []
    side = scene_side(record, base) if "logo_box" in toy else None
    if side is None:
        return 0, 0
    s = 1000 / side
    lx0, ly0, lx1, ly1 = (v * s for v in toy["logo_box"])
    calls = hits = 0
    for j in range(1, len(images)):
        if "bbox_2d" not in images[j]:
            continue
        x0, y0, x1, y1 = _in_scene(images, j)
        calls += 1
        hits += x0 <= lx0 and y0 <= ly0 and x1 >= lx1 and y1 >= ly1
    return calls, hits


def hit_rate(records: list[dict], base: Path | None = None) -> float | None:
    """Hits over zoom calls across `records`; None when there was no zoom call."""
    calls = hits = 0
    for r in records:
        c, h = zoom_hits(r, base)
        calls, hits = calls + c, hits + h
    return hits / calls if calls else None
