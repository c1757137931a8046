"""`image_zoom_in_tool`: crop a region of any image in the conversation and look again.

`bbox_2d` is [x1, y1, x2, y2] in 0..1000 coordinates relative to image `img_idx`. The crop is
cut from the full-resolution root image (a crop of a crop maps back through its box), then
resized Qwen-style (images.resize_crop).
"""

from __future__ import annotations

from typing import Any

from marscli.qwen.images import resize_crop
from marscli.tools import TOOLS, NewImage, ToolContext, ToolResult, error, function_schema

SCHEMA = function_schema(
    "image_zoom_in_tool",
    "Zoom in on a region of an image: crop it at full resolution and return it as a new image. "
    "Use it for small text, logos, faces and details.",
    {"bbox_2d": {"type": "array", "items": {"type": "number"}, "minItems": 4, "maxItems": 4,
                 "description": "[x1, y1, x2, y2], relative coordinates 0-1000"},
     "label": {"type": "string", "description": "what is in the region"},
     "img_idx": {"type": "integer",
                 "description": "which image to crop, 0-based, counting every image in the "
                                "conversation (default 0)"}},
    required=("bbox_2d",))

def _num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@TOOLS.register("image_zoom_in_tool")
class ZoomInTool:
    name = "image_zoom_in_tool"
    schema = SCHEMA

    def __call__(self, args: dict[str, Any], ctx: ToolContext) -> ToolResult:
        bbox = args.get("bbox_2d")
        if not isinstance(bbox, list) or len(bbox) != 4 or not all(_num(v) for v in bbox):
            return error("bbox_2d must be a list of four numbers [x1, y1, x2, y2]")
        x1, y1, x2, y2 = (float(v) for v in bbox)
        if not all(0 <= v <= 1000 for v in (x1, y1, x2, y2)):
            return error("bbox_2d coordinates must lie in 0..1000")
        if x1 >= x2 or y1 >= y2:
            return error("bbox_2d needs x1 < x2 and y1 < y2")
        idx = args.get("img_idx", 0)
        if not isinstance(idx, int) or isinstance(idx, bool):
            return error("img_idx must be an integer")
        if not 0 <= idx < len(ctx.images):
            return error(f"img_idx {idx} is out of range: the conversation has "
                         f"{len(ctx.images)} image(s), numbered 0..{len(ctx.images) - 1}")
        label = args.get("label")
        if label is not None and not isinstance(label, str):
            return error("label must be a string")

        target = ctx.images[idx]
        root = ctx.images[target.root]
        src = root.source if root.source is not None else root.image
        ox1, oy1, ox2, oy2 = target.box or (0.0, 0.0, float(src.width), float(src.height))
        w, h = ox2 - ox1, oy2 - oy1
        box = (ox1 + x1 / 1000 * w, oy1 + y1 / 1000 * h, ox1 + x2 / 1000 * w, oy1 + y2 / 1000 * h)
        pix = (int(box[0]), int(box[1]), max(int(box[0]) + 1, round(box[2])),
               max(int(box[1]) + 1, round(box[3])))
        crop = resize_crop(src.crop(pix))
        meta = {"from": idx, "bbox_2d": [x1, y1, x2, y2]}
        if label:
            meta["label"] = label
        text = (f"Zoomed in on image {idx}" + (f" ({label})" if label else "")
                + f": image {len(ctx.images)} is the region {[round(v) for v in bbox]}.\n<image>")
        return ToolResult(text=text, images=[NewImage(crop, meta, root=target.root, box=box)])
