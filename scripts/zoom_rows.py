#!/usr/bin/env python3
"""Grounding in the tool call itself: the expert's perception trajectories cut after the zoom.

usage: scripts/zoom_rows.py TRAJECTORIES.jsonl > ZOOM.jsonl   (- reads stdin)

Each perception trajectory whose first model turn calls image_zoom_in_tool becomes a row of its
prompt and that turn only (segments and images cut there, the rest of the record dropped), so
that `marscli sft` trains on the zoom's box alone. Why (docs/notes/demo-log.md, lever ab): among the
expert's rows of the three kinds, the box's two deciding digits (the quadrant) are 2 of about
220 model tokens (a perception row and a row of each other kind), here 2 of 59; a tiny model
that grounds in message rows (65.6%) still zoomed at chance in the agent's format after 3
epochs of the whole trajectories (5 in lever aa), and 8 epochs of these rows put 96.9% of its
zooms on the logo's quadrant in a world it never saw. Rows are validated as they are read: a
bad one is `FILE:LINE: field: ...`, exit 2, and nothing is written.
"""

from __future__ import annotations

import json
import sys

from marscli.agent.protocol import ToolCall, parse_turn
from marscli.errors import BadInput
from marscli.records.jsonl import read_rows
from marscli.tools.zoom import ZoomInTool

KEEP = ("v", "id", "prompt_id", "sample", "policy", "category", "toy", "question", "answer_gt")


def zoom_row(row: dict, where: str) -> dict | None:
    """`row` cut after its first model turn, or None where that turn is not a perception
    question's zoom."""
    if row.get("category") != "perception":
        return None
    segs = row.get("segments")
    if not isinstance(segs, list) or not all(isinstance(s, dict) for s in segs):
        raise BadInput(f"{where}: segments: a list of segment objects is needed")
    first = next((i for i, s in enumerate(segs) if s.get("role") == "model"), None)
    if first is None:
        raise BadInput(f"{where}: segments: no model segment")
    # The agent's own parser: a zoom named in the thinking, or a malformed call, is no zoom row.
    call = parse_turn(str(segs[first].get("text", "")))
    if not (isinstance(call, ToolCall) and call.name == ZoomInTool.name):
        return None
    kept = segs[: first + 1]
    used = [i for s in kept for i in (s.get("images") or [])]
    images = row.get("images") or []
    if used and (not isinstance(images, list) or max(used) >= len(images)):
        raise BadInput(f"{where}: images: the kept segments use image {max(used)} but the row "
                       f"lists {len(images) if isinstance(images, list) else 0}")
    out = {k: row[k] for k in KEEP if k in row}
    return {**out, "images": images[: max(used) + 1] if used else [], "segments": kept}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    rows = read_rows(argv[0])
    out = [z for line, row in rows if (z := zoom_row(row, f"{argv[0]}:{line}")) is not None]
    # Everything validated before anything is written: no half-written output on a bad row.
    sys.stdout.write("".join(json.dumps(z) + "\n" for z in out))
    print(f"zoom_rows: {len(out)} zoom rows of {len(rows)} trajectories", file=sys.stderr)
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main(sys.argv[1:]))
    except BadInput as e:
        print(f"zoom_rows: {e}", file=sys.stderr)
        raise SystemExit(e.exit_code) from None
