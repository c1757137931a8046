"""`marscli report RUN_OR_TRAJ -o OUT.html`: the run's page (view/report.py), written atomically
(`-`: stdout); what it holds on stderr."""

from __future__ import annotations

import sys

from marscli.errors import check_range
from marscli.records.outputs import write_output
from marscli.records.provenance import stage_inputs
from marscli.view.report import build

MIN_IMAGE_PX, MAX_IMAGE_PX = 16, 8192  # --image-px


@stage_inputs()
def main(path: str, output: str, max_trajectories: int = 200, image_px: int = 512,
         page_title: str | None = None) -> dict:
    """Write the report of `path` to `output`; returns what `build` says of it, and `bytes`."""
    check_range("--max-trajectories", max_trajectories, 0)
    check_range("--image-px", image_px, MIN_IMAGE_PX, MAX_IMAGE_PX)
    text, info = build(path, max_trajectories, image_px, page_title)
    data = text.encode("utf-8")
    write_output(output, data)
    info["bytes"] = len(data)
    print(f"wrote {output}: {info['shown']:,} of {info['trajectories']:,} trajectories, "
          f"{info['images']:,} images, {info['bytes'] / 1e6:.1f} MB", file=sys.stderr)
    return info
