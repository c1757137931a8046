"""Logos and cluttered scenes, drawn with Pillow and numpy only (no fonts, nothing downloaded).

A logo is a square plate (white or black) with a saturated shape in its upper part and the
company's initial in a built-in 5x7 pixel font below it. A scene is a muted gradient with muted
clutter (boxes, ellipses, lines, polygons) and ONE logo drawn small inside one cell of a
`grid` x `grid` partition, with at least a tenth of a cell of margin. The zoom box the expert
uses is that cell, so the box a model must predict takes one of `grid` values per coordinate
(multiples of 1000 / grid): a dial for how hard localisation is for a tiny model.

Drawing is aliased on purpose: logo colours stay exact, so tests find them by pixel value, and
the clutter's muted palette (saturation at most 0.35) never comes near them.
"""

from __future__ import annotations

import colorsys
import random

import numpy as np
from PIL import Image, ImageDraw

from marscli.toy.entities import COLOURS, PLATES, Logo

# 5x7 glyphs of the logo letters (the capital initials entities.ONSETS can give).
GLYPHS: dict[str, tuple[str, ...]] = {
    "B": ("####.", "#...#", "#...#", "####.", "#...#", "#...#", "####."),
    "D": ("####.", "#...#", "#...#", "#...#", "#...#", "#...#", "####."),
    "F": ("#####", "#....", "#....", "####.", "#....", "#....", "#...."),
    "G": (".###.", "#...#", "#....", "#.###", "#...#", "#...#", ".###."),
    "K": ("#...#", "#..#.", "#.#..", "##...", "#.#..", "#..#.", "#...#"),
    "L": ("#....", "#....", "#....", "#....", "#....", "#....", "#####"),
    "M": ("#...#", "##.##", "#.#.#", "#.#.#", "#...#", "#...#", "#...#"),
    "N": ("#...#", "##..#", "#.#.#", "#..##", "#...#", "#...#", "#...#"),
    "P": ("####.", "#...#", "#...#", "####.", "#....", "#....", "#...."),
    "R": ("####.", "#...#", "#...#", "####.", "#.#..", "#..#.", "#...#"),
    "S": (".####", "#....", "#....", ".###.", "....#", "....#", "####."),
    "T": ("#####", "..#..", "..#..", "..#..", "..#..", "..#..", "..#.."),
    "V": ("#...#", "#...#", "#...#", "#...#", "#...#", ".#.#.", "..#.."),
    "Z": ("#####", "....#", "...#.", "..#..", ".#...", "#....", "#####"),
}
INK = {"white": (15, 15, 15), "black": (250, 250, 250)}  # letter colour on each plate

LOGO_MIN, LOGO_MAX = 0.4, 0.65  # logo side as a fraction of a grid cell
MARGIN = 0.1  # at least this fraction of a cell between the logo and the cell's edges


def _shape(d: ImageDraw.ImageDraw, shape: str, box: tuple[float, float, float, float],
           fill: tuple[int, int, int]) -> None:
    x0, y0, x1, y1 = box
    cx, cy, r = (x0 + x1) / 2, (y0 + y1) / 2, (x1 - x0) / 2
    if shape == "circle":
        d.ellipse(box, fill=fill)
    elif shape == "square":
        d.rectangle((x0 + 0.1 * r, y0 + 0.1 * r, x1 - 0.1 * r, y1 - 0.1 * r), fill=fill)
    elif shape == "triangle":
        d.polygon([(cx, y0), (x1, y1), (x0, y1)], fill=fill)
    elif shape == "diamond":
        d.polygon([(cx, y0), (x1, cy), (cx, y1), (x0, cy)], fill=fill)
    elif shape == "star":
        pts = []
        for k in range(10):
            rad = r if k % 2 == 0 else 0.5 * r
            a = np.pi * (k / 5 - 0.5)
            pts.append((cx + rad * np.cos(a), cy + rad * np.sin(a)))
        d.polygon(pts, fill=fill)
    elif shape == "cross":
        w = 0.36 * r
        d.rectangle((cx - w, y0, cx + w, y1), fill=fill)
        d.rectangle((x0, cy - w, x1, cy + w), fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r}")


def _letter(d: ImageDraw.ImageDraw, letter: str, cx: float, top: float, scale: int,
            fill: tuple[int, int, int]) -> None:
    glyph = GLYPHS[letter]
    x0 = round(cx - 2.5 * scale)
    y0 = round(top)
    for j, row in enumerate(glyph):
        for i, ch in enumerate(row):
            if ch == "#":
                d.rectangle((x0 + i * scale, y0 + j * scale,
                             x0 + (i + 1) * scale - 1, y0 + (j + 1) * scale - 1), fill=fill)


def render_logo(logo: Logo, side: int = 128) -> Image.Image:
    """`logo` as a `side` x `side` image: plate, shape in the upper part, letter below."""
    im = Image.new("RGB", (side, side), PLATES[logo.plate])
    d = ImageDraw.Draw(im)
    s = side / 100  # layout in percent of the side
    _shape(d, logo.shape, (23 * s, 6 * s, 77 * s, 60 * s), COLOURS[logo.colour])
    scale = max(1, round(27 * s / 7))
    _letter(d, logo.letter, side / 2, 66 * s, scale, INK[logo.plate])  # clipped to the plate
    return im


def muted(rng: random.Random) -> tuple[int, int, int]:
    """A dull clutter colour: saturation <= 0.35, value 0.3..0.85 (never a logo colour)."""
    r, g, b = colorsys.hsv_to_rgb(rng.random(), rng.uniform(0.05, 0.35), rng.uniform(0.3, 0.85))
    return round(r * 255), round(g * 255), round(b * 255)


def _background(rng: random.Random, size: int) -> Image.Image:
    top, bottom = np.array(muted(rng), float), np.array(muted(rng), float)
    t = np.linspace(0.0, 1.0, size)[:, None]  # [H, 1]
    rows = np.rint(top * (1 - t) + bottom * t).astype(np.uint8)  # [H, 3]
    return Image.fromarray(np.repeat(rows[:, None, :], size, axis=1), "RGB")  # [H, W, 3]


def _clutter(d: ImageDraw.ImageDraw, rng: random.Random, size: int, amount: float) -> None:
    for _ in range(round(6 * amount)):  # large blocks: "buildings", "tables"
        w, h = rng.randint(size // 8, size // 3), rng.randint(size // 8, size // 2)
        x, y = rng.randint(-w // 2, size - w // 2), rng.randint(size // 4, size - h // 3)
        d.rectangle((x, y, x + w, y + h), fill=muted(rng))
    for _ in range(round(40 * amount)):  # small things
        kind = rng.randrange(4)
        w, h = rng.randint(size // 64, size // 10), rng.randint(size // 64, size // 10)
        x, y = rng.randint(0, size - 1), rng.randint(0, size - 1)
        if kind == 0:
            d.rectangle((x, y, x + w, y + h), fill=muted(rng))
        elif kind == 1:
            d.ellipse((x, y, x + w, y + h), fill=muted(rng))
        elif kind == 2:
            d.line((x, y, x + rng.randint(-size // 5, size // 5),
                    y + rng.randint(-size // 5, size // 5)),
                   fill=muted(rng), width=max(1, size // 256))
        else:
            d.polygon([(x + rng.randint(0, w), y + rng.randint(0, h)) for _ in range(3)],
                      fill=muted(rng))


def render_scene(rng: random.Random, logo: Logo, size: int = 1024,
                 grid: int = 8, zoom_cells: int = 1,
                 clutter: float = 1.0) -> tuple[Image.Image, list[int], list[int]]:
    """A `size` x `size` cluttered scene with `logo` drawn small in one grid cell.

    `clutter` scales the number of clutter objects (0: the gradient alone).
    Returns (image, logo box in pixels [x1, y1, x2, y2) exclusive, zoom box in 0..1000
    [x1, y1, x2, y2]: the block of `zoom_cells` x `zoom_cells` cells, aligned to multiples
    of `zoom_cells`, that holds the logo's cell)."""
    im = _background(rng, size)
    d = ImageDraw.Draw(im)
    _clutter(d, rng, size, clutter)
    gx, gy = rng.randrange(grid), rng.randrange(grid)
    cx0, cy0 = -(-gx * size // grid), -(-gy * size // grid)  # first whole pixel of the cell
    cx1, cy1 = (gx + 1) * size // grid, (gy + 1) * size // grid  # last pixel + 1 (or so)
    cell = size / grid
    side = rng.randint(round(LOGO_MIN * cell), round(LOGO_MAX * cell))
    m = int(np.ceil(MARGIN * cell))
    x = rng.randint(cx0 + m, cx1 - m - side)
    y = rng.randint(cy0 + m, cy1 - m - side)
    im.paste(render_logo(logo, side), (x, y))
    step = 1000 // grid if 1000 % grid == 0 else 1000 / grid
    bx, by = gx - gx % zoom_cells, gy - gy % zoom_cells
    zoom = [round(bx * step), round(by * step), round((bx + zoom_cells) * step),
            round((by + zoom_cells) * step)]
    return im, [x, y, x + side, y + side], zoom
