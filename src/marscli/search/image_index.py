"""`local:PATH` reverse image search: perceptual hashes and Hamming distance, Pillow + numpy only.

Each image gets two 64-bit hashes: a DCT pHash (signs of the 8x8 lowest frequencies of a 32x32
grey thumbnail against their median: survives resizing, recompression, small crops) and a dHash
(signs of horizontal gradients on a 9x8 thumbnail: cheap, sharpens ties). The distance is the sum
of both Hamming distances, 0..128. All hashes live in memory as two uint64 arrays, so a query
over a million images is one vectorised XOR and popcount.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from marscli.errors import BadInput, MarsError
from marscli.qwen.images import open_image
from marscli.records.jsonl import get_field, iter_rows
from marscli.records.provenance import note_inputs, stage_inputs
from marscli.search import IMAGE_BACKENDS, ImageHit, NoInput, SearchOptions, need_arg
from marscli.search.dbfile import new_database

FORMAT = "marscli-image-index-1"
IMAGE_EXTS = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"}
_HASH_PIXELS = 1_000_000  # decode big photos small (JPEG draft): the hash sees 32x32 anyway


def _dct_matrix(n: int = 32) -> np.ndarray:
    k, x = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    return np.cos(np.pi * (2 * x + 1) * k / (2 * n))  # [n, n], DCT-II without scaling


_DCT = _dct_matrix()
_BITS = (np.uint64(1) << np.arange(64, dtype=np.uint64))


def _pack(bits: np.ndarray) -> int:
    return int(np.bitwise_or.reduce(_BITS[bits.reshape(-1)]))


def image_hashes(im: Image.Image) -> tuple[int, int]:
    """(pHash, dHash) of an image, each a 64-bit unsigned int."""
    grey = im.convert("L")
    a = np.asarray(grey.resize((32, 32), Image.LANCZOS), dtype=np.float64)  # [32, 32]
    low = (_DCT @ a @ _DCT.T)[:8, :8]  # [8, 8]
    med = np.median(low.reshape(-1)[1:])  # the DC term says only "bright", leave it out
    d = np.asarray(grey.resize((9, 8), Image.LANCZOS), dtype=np.int16)  # [8, 9]
    return _pack(low > med), _pack(d[:, 1:] > d[:, :-1])


def _signed(u: int) -> int:
    return u - (1 << 64) if u >= 1 << 63 else u  # SQLite INTEGER is signed 64-bit


def _sources(src: str) -> Iterator[tuple[str, Path, str]]:
    """(where, image path, title) for a folder of images or a JSONL of {path|image, title}."""
    p = Path(src)
    if p.is_dir():
        for f in sorted(p.rglob("*")):
            if f.suffix.lower() in IMAGE_EXTS and f.is_file():
                yield str(f), f, f.stem.replace("_", " ").replace("-", " ")
        return
    base = p.parent
    for line, row in iter_rows(src):
        field = "path" if "path" in row or "image" not in row else "image"
        rel = get_field(row, field, str, src, line)
        title = get_field(row, "title", str, src, line, default=Path(rel).stem)
        yield f"{src}:{line}: {field}", base / rel, title


@stage_inputs()
def build_image_index(src: str, out: str | Path, *, progress: bool = True) -> int:
    """Hash every image of a folder (recursively) or JSONL list into `out`; return the count."""
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    if not Path(src).exists() and src != "-":
        raise BadInput(f"{src}: no such file or folder")
    out = Path(out)
    out_dir = out.parent.resolve()
    rows = []
    console = Console(stderr=True)
    with Progress(SpinnerColumn(), TextColumn("hashing {task.completed:,} images"),
                  TimeElapsedColumn(), console=console, transient=True,
                  disable=not (progress and console.is_terminal)) as bar:
        task = bar.add_task("hash", total=None)
        for where, path, title in _sources(src):
            note_inputs(path)  # the index may not be written onto an image it hashed
            try:
                ph, dh = image_hashes(open_image(path, max_pixels=_HASH_PIXELS))
            except MarsError as e:
                msg = str(e).removeprefix(f"{path}: ")
                raise BadInput(f"{where}: {path}: {msg}") from None
            rows.append((_signed(ph), _signed(dh), title,
                         os.path.relpath(path.resolve(), out_dir)))
            bar.advance(task)
    if not rows:
        raise BadInput(f"{src}: no images found (looked for {', '.join(sorted(IMAGE_EXTS))})")
    with new_database(out) as db:
        db.execute("BEGIN")
        db.execute("CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT)")
        db.execute("CREATE TABLE images(phash INTEGER, dhash INTEGER, title TEXT, path TEXT)")
        db.executemany("INSERT INTO images VALUES (?,?,?,?)", rows)
        db.executemany("INSERT INTO meta VALUES (?,?)", [("format", FORMAT),
                                                        ("rows", str(len(rows)))])
        db.execute("COMMIT")
    return len(rows)


class LocalImageBackend:
    def __init__(self, path: str) -> None:
        p = Path(path)
        if not p.is_file():
            raise BadInput(f"{path}: image index not found — build it with "
                           f"`marscli index images FOLDER -o {path}`")
        self.spec = f"local:{path}"
        try:
            with sqlite3.connect(f"{p.resolve().as_uri()}?mode=ro", uri=True) as db:
                fmt = db.execute("SELECT value FROM meta WHERE key='format'").fetchone()
                rows = db.execute("SELECT phash, dhash, title, path FROM images").fetchall()
            db.close()
        except sqlite3.DatabaseError:
            fmt = None
        if not fmt or fmt[0] != FORMAT:
            raise BadInput(f"{path}: not a marscli image index — build one with "
                           "`marscli index images FOLDER -o INDEX`")
        base = p.resolve().parent
        self.phash = np.array([r[0] for r in rows], dtype=np.int64).view(np.uint64)  # [N]
        self.dhash = np.array([r[1] for r in rows], dtype=np.int64).view(np.uint64)  # [N]
        self.titles = [r[2] for r in rows]
        self.paths = [str(base / r[3]) for r in rows]

    def nearest(self, im: Image.Image, k: int) -> list[tuple[int, int]]:
        """(row, distance) of the k nearest images, nearest first."""
        ph, dh = image_hashes(im)
        dist = (np.bitwise_count(self.phash ^ np.uint64(ph))
                + np.bitwise_count(self.dhash ^ np.uint64(dh))).astype(np.int64)  # [N]
        order = np.argsort(dist, kind="stable")[:k]
        return [(int(i), int(dist[i])) for i in order]

    def find(self, ctx: Any, k: int) -> list[ImageHit]:
        if not ctx.images:
            raise NoInput("there is no image in the conversation to search with")
        first = ctx.images[0]
        query = first.source if first.source is not None else first.image
        return [ImageHit(self.titles[i], self.paths[i]) for i, _ in self.nearest(query, k)]


@IMAGE_BACKENDS.register("local")
def _local(arg: str | None, opts: SearchOptions) -> LocalImageBackend:
    return LocalImageBackend(need_arg("local", arg, "path"))
