"""The zoom-in tool: relative boxes, crops from the full-resolution source, Qwen resizing,
and every argument mistake an observation (never an exception)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from marscli.qwen.images import resize_crop, smart_resize
from marscli.tools import ConvImage, ToolContext
from marscli.tools.zoom import ZoomInTool


def ctx(w=4000, h=2000):
    arr = np.zeros((h, w, 3), np.uint8)
    arr[:, w // 2:, 0] = 255  # right half red
    arr[h // 2:, :, 2] = 255  # bottom half blue
    im = Image.fromarray(arr)
    return ToolContext(images=[ConvImage(im, {}, root=0, source=im)])


@pytest.mark.parametrize("h,w,expect", [
    (1000, 1000, (992, 992)),  # round to the nearest multiple of 32
    (100, 100, (256, 256)),  # under min pixels (65,536): scaled up
    (4000, 4000, (2880, 2880)),  # over max pixels (8,294,400): scaled down
    # 32x1984 is under min pixels: scaled by sqrt(65536/66000), ceil to 64x2016
    (33, 2000, (64, 2016)),
])
def test_smart_resize(h, w, expect):
    got = smart_resize(h, w)
    assert got == expect
    assert got[0] % 32 == 0 and got[1] % 32 == 0
    assert 65_536 <= got[0] * got[1] <= 8_294_400


def test_resize_crop_upscales_tiny_crops():
    out = resize_crop(Image.new("RGB", (10, 40)))
    assert out.width % 32 == 0 and out.height % 32 == 0 and out.width * out.height >= 65_536


def test_zoom_cuts_the_right_region_at_full_resolution():
    c = ctx()
    res = ZoomInTool()({"bbox_2d": [500, 0, 1000, 500], "label": "red"}, c)
    assert res.ok and len(res.images) == 1
    crop = np.asarray(res.images[0].image)
    assert crop[..., 0].mean() > 250 and crop[..., 2].mean() < 5  # red, not blue
    assert res.images[0].box == (2000.0, 0.0, 4000.0, 1000.0)
    assert res.images[0].meta == {"from": 0, "bbox_2d": [500.0, 0.0, 1000.0, 500.0], "label": "red"}
    # 2000x1000 source pixels: kept near full resolution, not thumbnail-sized
    assert res.images[0].image.size == (1984, 992)  # round(62.5) == 62 (half to even)


def test_crop_of_crop_maps_back_to_source():
    c = ctx()
    first = ZoomInTool()({"bbox_2d": [0, 0, 1000, 1000]}, c).images[0]
    c.images.append(ConvImage(first.image, first.meta, root=0, box=first.box))
    second = ZoomInTool()({"bbox_2d": [500, 500, 1000, 1000], "img_idx": 1}, c).images[0]
    assert second.box == (2000.0, 1000.0, 4000.0, 2000.0) and second.root == 0
    crop = np.asarray(second.image)
    assert crop[..., 0].mean() > 250 and crop[..., 2].mean() > 250  # magenta quadrant


@pytest.mark.parametrize("args,msg", [
    ({}, "bbox_2d must be a list of four numbers"),
    ({"bbox_2d": [1, 2, 3]}, "four numbers"),
    ({"bbox_2d": ["a", 2, 3, 4]}, "four numbers"),
    ({"bbox_2d": [True, 2, 3, 4]}, "four numbers"),
    ({"bbox_2d": [600, 0, 300, 10]}, "x1 < x2"),
    ({"bbox_2d": [0, 0, 1200, 10]}, "0..1000"),
    ({"bbox_2d": [0, 0, 10, 10], "img_idx": 3}, "img_idx 3 is out of range"),
    ({"bbox_2d": [0, 0, 10, 10], "img_idx": "0"}, "img_idx must be an integer"),
    ({"bbox_2d": [0, 0, 10, 10], "label": 5}, "label must be a string"),
])
def test_bad_arguments_are_observations(args, msg):
    res = ZoomInTool()(args, ctx(64, 64))
    assert not res.ok and res.text.startswith("error:") and msg in res.text and not res.images
