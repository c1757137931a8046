"""Write the `make ask-demo` scene: 3840x2160 with a small sign, and an expert's replies.

    python scripts/demo_image.py runs/ask-demo/scene.png --replies runs/ask-demo/replies.json

The sign (about 1% of the picture's width in text height) cannot be read at the resolution the
model first sees; the expert zooms on the box that holds it, then answers. `--replies` writes
those two assistant turns (a JSON list of strings) for `marscli ask --engine replay --replies
FILE`: the real agent loop and zoom tool replay them, so the crop in the trace is the one the
tool cut. The zoom box is computed from where the sign is drawn.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

SIZE = (3840, 2160)
SIGN = (2880, 590, 3180, 720)  # x1, y1, x2, y2 in pixels
TEXT = "EST. 1997"


def scene() -> Image.Image:
    im = Image.new("RGB", SIZE, (96, 130, 160))
    d = ImageDraw.Draw(im)
    for i in range(0, SIZE[0], 240):  # clutter
        d.rectangle([i, 1500 + (i % 480) // 4, i + 180, SIZE[1]], fill=(70 + i % 90, 90, 60))
    d.rectangle(SIGN, fill=(240, 230, 200), outline=(20, 20, 20), width=6)
    font = ImageFont.load_default(size=44)
    d.text(((SIGN[0] + SIGN[2]) / 2, (SIGN[1] + SIGN[3]) / 2), TEXT, fill=(10, 10, 10),
           font=font, anchor="mm")
    return im


def zoom_box(margin: int = 40) -> list[int]:
    """The sign plus a margin, in the zoom tool's 0..1000 relative coordinates."""
    x1, y1, x2, y2 = SIGN
    w, h = SIZE
    return [max(0, (x1 - margin) * 1000 // w), max(0, (y1 - margin) * 1000 // h),
            min(1000, -(-(x2 + margin) * 1000 // w)), min(1000, -(-(y2 + margin) * 1000 // h))]


def replies() -> list[str]:
    call = {"name": "image_zoom_in_tool", "arguments": {"bbox_2d": zoom_box(), "label": "sign"}}
    return [
        "<thinking>There is a small sign on the right, too small to read at this size. "
        f"I zoom in on it.</thinking><tool_call>{json.dumps(call)}</tool_call>",
        f"<thinking>The crop shows the sign clearly: it reads {TEXT}.</thinking>"
        f"<answer>{TEXT}</answer>",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="the scene (PNG)")
    ap.add_argument("--replies", help="also write the expert's replies here (JSON)")
    args = ap.parse_args()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    scene().save(args.out)
    if args.replies:
        Path(args.replies).write_text(json.dumps(replies(), indent=1) + "\n")


if __name__ == "__main__":
    main()
