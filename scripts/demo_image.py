"""Write a 3840x2160 demo scene with a small sign in it (for `make ask-demo`)."""

from __future__ import annotations

import sys
from pathlib import Path

from PIL import Image, ImageDraw


def main(out: str) -> None:
    im = Image.new("RGB", (3840, 2160), (96, 130, 160))
    d = ImageDraw.Draw(im)
    for i in range(0, 3840, 240):  # clutter
        d.rectangle([i, 1500 + (i % 480) // 4, i + 180, 2160], fill=(70 + i % 90, 90, 60))
    d.rectangle([2900, 600, 3120, 720], fill=(240, 230, 200), outline=(20, 20, 20), width=6)
    d.text((2930, 640), "EST. 1997", fill=(10, 10, 10))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    im.save(out)


if __name__ == "__main__":
    main(sys.argv[1])
