"""Image loading that refuses bad files before they cost memory, and Qwen's smart resize.

- `open_image` opens only regular files: a folder, a named pipe (which would block the open
  forever), a device or a socket is refused from `os.stat` alone with one line naming the path
  (`check_regular_file`, for every other image-reading path too).
- Decompression bombs are refused from the header, before any pixel is decoded.
- An image the model is to see (`for_model`) is refused from its header when its aspect ratio
  is over `MAX_ASPECT`: Qwen-VL's processor (transformers' `qwen2_vl` `smart_resize`, which
  Qwen3-VL's uses) raises "absolute aspect ratio must be smaller than 200" mid-run.
"""

from __future__ import annotations

import math
import os
import stat
from pathlib import Path
from typing import Any

from PIL import Image, UnidentifiedImageError

from marscli.errors import BadInput

# An 8000x6000 photo is 48 MP; 50,000 x 50,000 is a decompression bomb. Refuse above this,
# from the header alone, before any pixel is decoded.
MAX_INPUT_PIXELS = 200_000_000
# Inputs are decoded at most this large (a bigger one is downscaled on load); the zoom tool
# crops from the decoded source, and update/sft rebuild pixels the same way.
MAX_SOURCE_PIXELS = 100_000_000
Image.MAX_IMAGE_PIXELS = None  # we do our own check, with a clearer message

# transformers' qwen2_vl smart_resize: `max(h, w) / min(h, w) > 200` raises (no size floor:
# a side under the patch factor is scaled up to min_pixels)
MAX_ASPECT = 200
QWEN_FACTOR = 32
CROP_MIN_PIXELS = 65_536
CROP_MAX_PIXELS = 8_294_400
MIN_SIDE = 28


def open_image(path: str | Path, *, max_pixels: int | None = None,
               what: str = "image", for_model: bool = False) -> Image.Image:
    """Decode an RGB image, checking it exists, is a file, is an image and is not a bomb;
    `for_model`: also that the model's processor takes its aspect ratio (`check_aspect`).

    With `max_pixels`, large images are downscaled on load (JPEG draft mode decodes at a
    fraction of the size, so an 8000x6000 input never occupies full-resolution memory twice).
    """
    p = check_regular_file(path, what)
    try:
        im = Image.open(p)
        w, h = im.size
        if w * h > MAX_INPUT_PIXELS:
            raise BadInput(f"{path}: {what} claims {w}x{h} pixels, over the {MAX_INPUT_PIXELS:,} "
                           "pixel limit (decompression bomb?) — downscale it first")
        if for_model:
            check_aspect(w, h, path, what)
        if max_pixels and w * h > max_pixels:
            scale = math.sqrt(max_pixels / (w * h))
            im.draft("RGB", (max(1, int(w * scale)), max(1, int(h * scale))))
        if im.mode != "RGB":
            im = im.convert("RGB")
        im.load()  # an RGB file decodes in place: no second full-size copy
    except BadInput:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise BadInput(f"{path}: {what} cannot be decoded ({type(e).__name__}: {e})") from None
    if max_pixels and im.width * im.height > max_pixels:
        nh, nw = fit_pixels(im.height, im.width, max_pixels)
        im = im.resize((nw, nh), Image.BICUBIC)
    return im


_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a named pipe"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"))


def check_regular_file(path: str | Path, what: str = "image") -> Path:
    """`path` as a Path if it is a regular file (links followed); BadInput otherwise. Checked
    with `os.stat`, which never blocks, before anything opens it: opening a FIFO waits for a
    writer that may never come."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise BadInput(f"{path}: {what} not found") from None
    except OSError as e:
        raise BadInput(f"{path}: {what} cannot be read ({e.strerror})") from None
    if not stat.S_ISREG(mode):
        kind = next((k for test, k in _KINDS if test(mode)), "not a regular file")
        raise BadInput(f"{path}: {what} path is {kind}, expected an image file")
    return Path(path)


def check_aspect(w: int, h: int, path: str | Path, what: str = "image") -> None:
    """BadInput when Qwen-VL's processor would refuse a w x h image (over `MAX_ASPECT`)."""
    ratio = max(w, h) / max(1, min(w, h))
    if ratio > MAX_ASPECT:
        shown = f"{ratio:.2f}".rstrip("0").rstrip(".")  # 200.01 is over, 5000.00 is 5000
        raise BadInput(f"{path}: {what} is {w}x{h} pixels, an aspect ratio of {shown}:1 — "
                       f"Qwen-VL's processor takes at most {MAX_ASPECT}:1; crop or pad it first")


def fit_pixels(h: int, w: int, max_pixels: int) -> tuple[int, int]:
    """Scale (h, w) down, keeping the aspect ratio, to at most max_pixels."""
    s = math.sqrt(max_pixels / (h * w))
    return max(1, int(h * s)), max(1, int(w * s))


def smart_resize(h: int, w: int, factor: int = QWEN_FACTOR, min_pixels: int = CROP_MIN_PIXELS,
                 max_pixels: int = CROP_MAX_PIXELS) -> tuple[int, int]:
    """Qwen-VL's resize rule: both sides multiples of `factor`, area within [min, max] pixels,
    aspect ratio kept as closely as the grid allows."""
    if max(h, w) / min(h, w) > MAX_ASPECT:
        raise ValueError(f"aspect ratio {max(h, w) / min(h, w):.0f} is over {MAX_ASPECT}")
    hb = max(factor, round(h / factor) * factor)
    wb = max(factor, round(w / factor) * factor)
    if hb * wb > max_pixels:
        beta = math.sqrt(h * w / max_pixels)
        hb = max(factor, math.floor(h / beta / factor) * factor)
        wb = max(factor, math.floor(w / beta / factor) * factor)
    elif hb * wb < min_pixels:
        beta = math.sqrt(min_pixels / (h * w))
        hb = math.ceil(h * beta / factor) * factor
        wb = math.ceil(w * beta / factor) * factor
    return hb, wb


def resize_crop(im: Image.Image) -> Image.Image:
    """What the zoom-in tool returns: tiny crops upscaled to 28 px first, then smart-resized."""
    w, h = im.size
    if min(w, h) < MIN_SIDE:
        s = MIN_SIDE / min(w, h)
        w, h = max(MIN_SIDE, round(w * s)), max(MIN_SIDE, round(h * s))
        im = im.resize((w, h), Image.BICUBIC)
    nh, nw = smart_resize(h, w)
    return im if (nw, nh) == im.size else im.resize((nw, nh), Image.BICUBIC)


def placeholder_count(processor: Any, path: Path) -> int | None:
    """Placeholder tokens the processor will give this image, from its header alone; None when
    that cannot be known without decoding (huge sources the agent downscaled on load)."""
    ip = processor.image_processor
    try:
        with Image.open(path) as im:
            w, h = im.size
    except (UnidentifiedImageError, OSError) as e:
        raise BadInput(f"{path}: image cannot be decoded ({type(e).__name__}: {e})") from None
    if w * h > MAX_SOURCE_PIXELS or not hasattr(ip, "get_number_of_image_patches"):
        return None
    merge = getattr(ip, "merge_size", 2)
    return ip.get_number_of_image_patches(h, w, {}) // (merge * merge)
