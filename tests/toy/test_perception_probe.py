"""scripts/perception_probe.py: held-out grounding and reading rows, scored on the bare reply."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
from PIL import Image

from marscli.toy.perceive import WHERE, crop_of
from marscli.toy.world import build_world

from helpers import ROOT

spec = importlib.util.spec_from_file_location("probe", ROOT / "scripts" / "perception_probe.py")
probe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(probe)


def test_rows_are_the_test_scenes_with_the_experts_box_and_crop(tmp_path):
    w = tmp_path / "w"
    build_world(w, seed=0, entities=5, train=2, test=4, sft=2, size=512, grid=4, zoom_cells=2,
                kinds=("perception", "knowledge"))
    test = [json.loads(x) for x in (w / "test.jsonl").read_text().splitlines()]
    got = probe.probe_rows(w, tmp_path / "out", None)
    seen = [r for r in test if r["category"] == "perception"]
    assert len(got["grounding"]) == len(got["reading"]) == len(seen) == 2  # knowledge rows out
    for r, g, rd in zip(seen, got["grounding"], got["reading"]):
        assert g["question"] == WHERE and json.loads(g["answer"][0]) == r["toy"]["zoom_box"]
        assert rd["question"] == r["question"] and rd["answer"] == r["answer"]
        assert rd["category"] == r["toy"]["attribute"]
        with Image.open(w / r["image"]) as scene:
            want = np.asarray(crop_of(scene.convert("RGB"), r["toy"]["zoom_box"]))
        assert (np.asarray(Image.open(rd["image"])) == want).all()


def test_score_compares_the_bare_reply_and_counts_by_category():
    def rec(text, gold, cat):
        return {"segments": [{"role": "prompt", "text": "q"}, {"role": "model", "text": text}],
                "answer_gt": [gold], "category": cat}

    s = probe.score([rec(" Red\n", "red", "colour"), rec("blue", "red", "colour"),
                     rec("[0, 0, 500, 500]", "[0, 0, 500, 500]", "ground"),
                     rec("<answer>M</answer>", "M", "letter")])  # the tag is not the format
    assert s["accuracy"] == 50.0 and s["items"] == 4
    assert s["by_category"] == {"colour": 50.0, "ground": 100.0, "letter": 0.0}
    assert s["most_common"][0][1] == 1
