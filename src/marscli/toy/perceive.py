"""Perception pre-training rows: what a pretrained VLM already knows, for a random tiny model.

MARS starts from Qwen3-VL-Instruct, which already reads a logo in a crop and points at an object
with a 0..1000 box; RL then teaches it when and where to zoom. The tiny model starts random, and
measured, it does not learn to see from the agent trajectories alone: after the cold-start SFT
its answer did not depend on the crop at all (p(gold) 0.141 with the true crop, 0.141 with
another row's), because the zoom box's digits carry most of the loss (57% on the demo's
trajectories) and drown the one answer token. So the world also writes `perceive.jsonl`,
message rows of the two skills, each trained on its own short answer (`marscli sft` on message
rows: the loss is on the assistant turn only), as a VLM's pre-training data would be:
- reading: the expert's crop of the logo (cut and resized as the zoom tool does) and a
  perception question → the one-word answer;
- grounding: the whole scene and "Where is the logo?" → the expert's zoom box, written as the
  tool call writes it ("[500, 0, 1000, 500]").
The scenes are a split of their own (`perceive-NNNN`), never shown to RL or the test.

Where the expert's zoom box spans several grid cells (`--zoom-cells 2`), the world also writes
`perceive-zoomed.jsonl`: grounding at the zoom's scale — the same crop and "Where is the logo?"
→ the logo's cell within the crop. In the crop the logo is about one merged vision token, the
size the tiny model learns first; measured (docs/demo.md), the random model left the grounding
plateau on these rows within 1000 steps where it had not in 2000 on whole scenes, and then
grounded whole scenes at once, logos it never saw included.

And `perceive-logos.jsonl`: reading at the logo files' own scale — each logo file (the 128 px
image-search thumbnail) with each perception question → the word. There the logo fills the
view; measured (docs/demo.md), the model read colour and shape of logos it never saw from
these rows within 432 steps, and reading the zoom's crops afterwards came twice as far as
without them.
"""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image

from marscli.qwen.images import resize_crop
from marscli.toy.entities import Entity
from marscli.toy.prompts import ATTRS, gold, question

SYSTEM = "You look at images and answer in one word or one box."
WHERE = "Where is the logo in this image? Answer with its box [x1, y1, x2, y2] in 0..1000."


def crop_of(scene: Image.Image, box: list[int]) -> Image.Image:
    """The zoom tool's crop of `box` (0..1000) of `scene` (tools/zoom.py, same rounding)."""
    w, h = scene.size
    x1, y1, x2, y2 = (box[0] / 1000 * w, box[1] / 1000 * h, box[2] / 1000 * w, box[3] / 1000 * h)
    pix = (int(x1), int(y1), max(int(x1) + 1, round(x2)), max(int(y1) + 1, round(y2)))
    return resize_crop(scene.crop(pix))


def _row(image: str, question: str, answer: str) -> dict:
    return {"messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": f"<image>{question}"},
                         {"role": "assistant", "content": answer}],
            "images": [image]}


def crop_image(row: dict) -> str:
    """Where `perception_rows` writes the expert's crop of scene row `row` (world-relative)."""
    return f"images/{row['id']}-crop.png"


def perception_rows(rows: list[dict], folder: Path, save_level: int) -> list[dict]:
    """Two message rows per scene row of `rows` (images under `folder`): read the crop, ground
    the logo. Crops are written as `images/<id>-crop.png`."""
    out = []
    for r in rows:
        box = r["toy"]["zoom_box"]
        rel = crop_image(r)
        with Image.open(folder / r["image"]) as scene:
            crop_of(scene.convert("RGB"), box).save(folder / rel, format="PNG",
                                                    compress_level=save_level)
        out.append(_row(rel, r["question"], r["answer"][0]))
        out.append(_row(r["image"], WHERE, json.dumps(box)))
    return out


def zoomed_rows(rows: list[dict], zoom_cells: int) -> list[dict]:
    """Grounding at the zoom's scale, one row per scene row of `rows`: the crop
    `perception_rows` wrote and WHERE → the box of the logo's cell within the crop (in 0..1000
    of the crop, a `zoom_cells` x `zoom_cells` grid). No rows for single-cell zooms: the box
    would be the whole crop."""
    if zoom_cells < 2:
        return []
    out = []
    for r in rows:
        toy = r["toy"]
        x1, y1, x2, y2 = toy["zoom_box"]
        lb, size = toy["logo_box"], toy["size"]  # pixels of the scene
        cx, cy = (lb[0] + lb[2]) / 2 * 1000 / size, (lb[1] + lb[3]) / 2 * 1000 / size
        i = min(zoom_cells - 1, int((cx - x1) / (x2 - x1) * zoom_cells))
        j = min(zoom_cells - 1, int((cy - y1) / (y2 - y1) * zoom_cells))
        box = [round(v * 1000 / zoom_cells) for v in (i, j, i + 1, j + 1)]
        out.append(_row(crop_image(r), WHERE, json.dumps(box)))
    return out


def logo_rows(ents: list[Entity]) -> list[dict]:
    """Reading at the logo's own scale: each entity's logo file (`logos/<slug>.png`, the
    image-search thumbnail) and each perception question → the word."""
    return [_row(f"logos/{e.slug}.png", question("perception", a, e), gold(e, a))
            for e in ents for a in ATTRS["perception"]]
