"""Large inputs stay cheap: an 8000 x 6000 photo through `ask` and `rollout` (with a zoom-in)
peaks under PEAK_MB of resident memory (bench/bench_memory.py prints the numbers beside a
640 x 480 baseline: about 1 GB for either, torch and transformers included), and the trajectory
it gives is one `update` accepts: the processor saw a copy downscaled to its own pixel budget,
with the placeholder count the processor would give the full source, and training rebuilds the
same pixels through the same function."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import orjson
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from bench_memory import LARGE, REPLIES, peak_rss_mb, photo

PEAK_MB = 3000  # the bound this test asserts, per process, for the 8000 x 6000 input


@pytest.fixture(scope="module")
def large(tmp_path_factory, tiny_model):
    work = tmp_path_factory.mktemp("large")
    img = photo(work / "photo.jpg", LARGE)
    (work / "p.jsonl").write_bytes(orjson.dumps(
        {"v": 1, "id": "big", "image": "photo.jpg", "question": "What colour?",
         "answer": ["red"], "replies": REPLIES}) + b"\n")
    m = [sys.executable, "-m", "marscli"]
    cmds = [[*m, "ask", str(img), "What colour?", "--policy", str(tiny_model), "--max-turns",
             "2", "--max-turn-tokens", "8", "--crops-dir", str(work / "crops")],
            [*m, "rollout", str(work / "p.jsonl"), "-o", str(work / "t.jsonl"), "--policy",
             str(tiny_model), "--engine", "replay", "-n", "2"]]
    with ThreadPoolExecutor(2) as pool:
        ask, rollout = pool.map(lambda c: peak_rss_mb(c, work), cmds)
    return work, ask, rollout


@pytest.mark.slow
def test_large_image_peak_rss_is_bounded(large):
    _, ask, rollout = large
    for name, (mb, _, code, err) in (("ask", ask), ("rollout", rollout)):
        assert code == 0, f"{name}: {err}"
        assert mb < PEAK_MB, f"{name}: peak RSS {mb:.0f} MB on {LARGE[0]}x{LARGE[1]}"


@pytest.mark.slow
def test_large_image_trajectory_trains_on_the_same_pixels(large, tiny_model):
    from marscli.qwen.images import CROP_MAX_PIXELS
    from marscli.qwen.policy import load_processor
    from marscli.qwen.tokens import image_features, model_image
    from marscli.train.batch import Spec, collate, load_example

    work, _, (_, _, code, err) = large
    assert code == 0, err
    recs = [orjson.loads(x) for x in (work / "t.jsonl").read_bytes().splitlines()]
    assert [r["stop"] for r in recs] == ["answer", "answer"]
    proc = load_processor(str(tiny_model))
    ip = proc.image_processor
    from PIL import Image

    with Image.open(work / recs[0]["images"][1]["path"]) as crop:  # cut from the source
        assert crop.width * crop.height <= CROP_MAX_PIXELS
        assert abs(crop.width / crop.height - 4 / 3) < 0.02  # the quadrant of a 4:3 photo
    spec = Spec.of(proc, str(tiny_model))
    for n, r in enumerate(recs, 1):  # update's validation: placeholder runs match the images
        e = load_example(r, "t.jsonl", n, work, spec)
        batch = collate([e], spec)  # rebuilds pixels through image_features, checks the runs
        assert batch.tensors["image_grid_thw"].shape[0] == 2
    src = Image.new("RGB", LARGE)
    small = model_image(proc, src)
    assert small.width * small.height <= ip.size.longest_edge < LARGE[0] * LARGE[1]
    full = ip.get_number_of_image_patches(LARGE[1], LARGE[0], {}) // ip.merge_size ** 2
    assert image_features(proc, src).n_tokens == full
