"""`load_processor` builds a Qwen3-VL checkpoint's processor without AutoVideoProcessor (which
imports every model's video processor module) and gets what AutoProcessor gets: the same
parts, the same saved files, the same tensors."""

from __future__ import annotations

import filecmp
import os

import numpy as np
import pytest
import torch
from PIL import Image

from marscli.qwen.policy import load_processor
from marscli.qwen.tokens import image_features


def test_load_processor_is_autoprocessor_without_its_video_scan(tiny_model, tmp_path,
                                                                monkeypatch):
    from transformers import AutoProcessor, AutoVideoProcessor

    ref = AutoProcessor.from_pretrained(str(tiny_model))

    def scan(*_, **__):
        raise AssertionError("AutoVideoProcessor used")

    with monkeypatch.context() as m:
        m.setattr(AutoVideoProcessor, "from_pretrained", scan)
        proc = load_processor(str(tiny_model))
    for part in ("image_processor", "tokenizer", "video_processor"):
        assert type(getattr(proc, part)) is type(getattr(ref, part))
    assert proc.to_json_string() == ref.to_json_string()
    ref.save_pretrained(tmp_path / "ref")
    proc.save_pretrained(tmp_path / "ours")
    names = sorted(os.listdir(tmp_path / "ref"))
    assert sorted(os.listdir(tmp_path / "ours")) == names
    assert filecmp.cmpfiles(tmp_path / "ref", tmp_path / "ours", names, shallow=False)[0] == names
    rng = np.random.default_rng(0)
    for w, h in [(480, 360), (33, 700)]:
        img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        msgs = [{"role": "user", "content": [{"type": "image", "image": img},
                                             {"type": "text", "text": "What colour?"}]}]
        got, want = (p.apply_chat_template(msgs, tokenize=True, return_dict=True,
                                           return_tensors="pt") for p in (proc, ref))
        assert set(got) == set(want) >= {"input_ids", "pixel_values", "image_grid_thw"}
        assert all(torch.equal(got[k], want[k]) for k in want)
        assert torch.equal(image_features(proc, img).pixel_values,
                           image_features(ref, img).pixel_values)


@pytest.mark.parametrize("processor_class", ["Qwen2VLProcessor", None])
def test_other_processors_are_left_to_autoprocessor(tiny_model, tmp_path, processor_class):
    """Not a Qwen3VLProcessor by name: AutoProcessor decides, as before."""
    import json
    import shutil

    from transformers import AutoProcessor

    folder = shutil.copytree(tiny_model, tmp_path / "ckpt")
    cfg = json.loads((folder / "processor_config.json").read_text())
    cfg.pop("processor_class")
    if processor_class:
        cfg["processor_class"] = processor_class
    (folder / "processor_config.json").write_text(json.dumps(cfg))
    want = AutoProcessor.from_pretrained(str(folder))
    assert type(load_processor(str(folder))) is type(want)
