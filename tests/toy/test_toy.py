"""The toy world: deterministic, small logos inside the expert's zoom box (by pixels), valid
prompt rows, disjoint splits, truthful image-search lists, a corpus that holds every answer,
expert replies that parse and hold for what the real tools return, and the CLI boundary."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import orjson
import pytest
from PIL import Image

from marscli.agent.protocol import Answer, ToolCall, parse_turn
from marscli.errors import BadInput
from marscli.records.schema import load_prompts
from marscli.tools import ConvImage, ToolContext
from marscli.tools.zoom import ZoomInTool
from marscli.toy.entities import COLOURS, PLATES
from marscli.toy.world import build_world

SPLITS = ("train", "test", "sft")
SMALL = {"entities": 8, "train": 9, "test": 6, "sft": 12, "size": 512}
TOL = 12  # per channel: bicubic upscaling of a crop keeps flat interiors within this


def rows(world: Path, split: str) -> list[dict]:
    return [json.loads(line) for line in (world / f"{split}.jsonl").read_text().splitlines()]


def all_rows(world: Path) -> list[dict]:
    return [r for s in SPLITS for r in rows(world, s)]


def entities(world: Path) -> dict[str, dict]:
    return {e["name"]: e for e in json.loads((world / "world.json").read_text())["entities"]}


def files(world: Path) -> dict[str, bytes]:
    return {str(p.relative_to(world)): p.read_bytes() for p in sorted(world.rglob("*"))
            if p.is_file()}


def near(pix: np.ndarray, rgb: tuple[int, int, int], tol: int = TOL) -> np.ndarray:
    """[H, W] mask of pixels within `tol` of `rgb` in every channel."""
    return (np.abs(pix.astype(int) - np.array(rgb)) <= tol).all(axis=-1)


def zoom(scene: Image.Image, bbox: list[int]) -> np.ndarray:
    ctx = ToolContext(images=[ConvImage(image=scene, ref={}, root=0, source=scene)])
    res = ZoomInTool()({"bbox_2d": bbox, "label": "logo"}, ctx)
    assert res.ok, res.text
    return np.asarray(res.images[0].image)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("toy") / "world"
    stats = build_world(out, seed=0, **SMALL)
    assert stats["images"] == 27 and stats["entities"] == 8
    return out


# ------------------------------------------------------------------------- determinism


def test_same_seed_same_bytes_other_seed_differs(world, tmp_path):
    again = tmp_path / "again"
    build_world(again, seed=0, **SMALL)
    a, b = files(world), files(again)
    assert sorted(a) == sorted(b)
    assert [k for k in a if a[k] != b[k]] == []

    other = tmp_path / "other"
    build_world(other, seed=1, **SMALL)
    c = files(other)
    assert c["world.json"] != a["world.json"]
    assert c["images/train-0000.png"] != a["images/train-0000.png"]
    assert c["corpus.jsonl"] != a["corpus.jsonl"]


def test_one_split_size_leaves_other_splits_alone(world, tmp_path):
    bigger = tmp_path / "bigger"
    build_world(bigger, seed=0, **{**SMALL, "train": 12})
    a, b = files(world), files(bigger)
    for split in ("test", "sft"):
        assert a[f"{split}.jsonl"] == b[f"{split}.jsonl"]
        assert a[f"images/{split}-0000.png"] == b[f"images/{split}-0000.png"]


# ------------------------------------------------------------------------- pixels


def test_logo_is_small_and_inside_the_expert_zoom_box(world):
    ents = entities(world)
    size = SMALL["size"]
    for r in all_rows(world):
        e, toy = ents[r["toy"]["entity"]], r["toy"]
        x1, y1, x2, y2 = toy["logo_box"]
        assert (x2 - x1) * (y2 - y1) < 0.05 * size * size
        scene = Image.open(world / r["image"]).convert("RGB")
        pix = np.asarray(scene)  # [H, W, 3]
        shape = near(pix, COLOURS[e["logo"]["colour"]], tol=0)
        # The logo colour is drawn, and only inside the logo's box (clutter never uses it).
        ys, xs = np.nonzero(shape)
        assert len(xs) > 0, r["id"]
        assert x1 <= xs.min() and xs.max() < x2 and y1 <= ys.min() and ys.max() < y2, r["id"]
        assert (shape.sum() / shape.size) < 0.05

        box = toy["zoom_box"]
        if "replies" in r:  # the box the expert actually sends
            call = parse_turn(r["replies"][0])
            if r["category"] == "perception":
                assert isinstance(call, ToolCall) and call.name == "image_zoom_in_tool"
                box = call.arguments["bbox_2d"]
        px = [v / 1000 * size for v in box]
        assert px[0] <= x1 and px[1] <= y1 and x2 <= px[2] and y2 <= px[3], (r["id"], box)

        crop = zoom(scene, box)
        logo_px = near(crop, COLOURS[e["logo"]["colour"]]).sum()
        plate_px = near(crop, PLATES[e["logo"]["plate"]]).sum()
        assert logo_px > 0.008 * crop.shape[0] * crop.shape[1], r["id"]
        assert plate_px > 0.05 * crop.shape[0] * crop.shape[1], r["id"]
        # Control: the diagonally opposite cell holds none of the logo's colour.
        other = [1000 - box[2], 1000 - box[3], 1000 - box[0], 1000 - box[1]]
        if other != box:
            assert near(zoom(scene, other), COLOURS[e["logo"]["colour"]]).sum() == 0, r["id"]


def test_logo_files_match_their_entity(world):
    for e in entities(world).values():
        im = np.asarray(Image.open(world / e["logo_path"]).convert("RGB"))
        assert near(im, COLOURS[e["logo"]["colour"]], tol=0).sum() > 0.1 * im.shape[0] ** 2
        assert near(im, PLATES[e["logo"]["plate"]], tol=0).sum() > 0.3 * im.shape[0] ** 2
    listed = [json.loads(x) for x in (world / "logos.jsonl").read_text().splitlines()]
    assert {(r["title"], r["path"]) for r in listed} == {
        (n, e["logo_path"]) for n, e in entities(world).items()}


# ------------------------------------------------------------------------- rows


def test_every_prompt_row_validates(world):
    for split in SPLITS:
        prompts = load_prompts(str(world / f"{split}.jsonl"))
        assert len(prompts) == SMALL[split]
        assert {p.category for p in prompts} == {"perception", "knowledge", "both"}
        for p in prompts:
            assert p.answer and all(a and " " not in a for a in p.answer)
            assert all(path.is_file() for path in p.image_paths())
            assert len(p.image_search) == 5


def test_splits_are_disjoint_by_scene(world):
    seen_ids, seen_paths, seen_hashes = set(), set(), set()
    for r in all_rows(world):
        digest = hashlib.sha256((world / r["image"]).read_bytes()).hexdigest()
        assert r["id"] not in seen_ids and r["image"] not in seen_paths
        assert digest not in seen_hashes, r["id"]
        seen_ids.add(r["id"]), seen_paths.add(r["image"]), seen_hashes.add(digest)
    assert {r["id"].split("-")[0] for r in rows(world, "test")} == {"test"}


def test_image_search_lists_hold_the_true_entity(world):
    ents = entities(world)
    for r in all_rows(world):
        hits, name = r["image_search"], r["toy"]["entity"]
        titles = [h["title"] for h in hits]
        assert len(set(titles)) == 5
        k = r["toy"]["hit"]
        assert hits[k - 1] == {"title": name, "thumbnail": ents[name]["logo_path"]}
        assert all((world / h["thumbnail"]).is_file() for h in hits)
        true = ents[name]["logo"]
        unlike = [t for t in titles if t != name and ents[t]["logo"]["colour"] != true["colour"]
                  and ents[t]["logo"]["shape"] != true["shape"]]
        could = [n for n, o in ents.items() if n != name and o["logo"]["colour"] != true["colour"]
                 and o["logo"]["shape"] != true["shape"]]
        # logos unlike the true one first (the scene's logo tells its own), as many as there are
        assert len(unlike) == min(4, len(could)), r["id"]


def test_corpus_mentions_every_answer(world):
    corpus = [json.loads(x) for x in (world / "corpus.jsonl").read_text().splitlines()]
    assert all(set(c) == {"id", "title", "text"} for c in corpus)
    assert len({c["id"] for c in corpus}) == len(corpus)
    by_title: dict[str, str] = {}
    for c in corpus:
        by_title[c["title"]] = by_title.get(c["title"], "") + " " + c["text"]
    for name, e in entities(world).items():
        words = by_title[name].replace(".", " ").split()
        for v in (e["city"], e["founder"], e["year"], e["logo"]["colour"], e["logo"]["shape"],
                  e["logo"]["letter"]):
            assert v in words, (name, v)
    for r in all_rows(world):
        assert r["answer"][0] in by_title[r["toy"]["entity"]]


# ------------------------------------------------------------------------- expert

TOOLS_OF = {"perception": ["image_zoom_in_tool"],
            "knowledge": ["text_search_tool"],
            "both": ["image_search_tool", "text_search_tool"]}


def test_expert_replies_parse_as_calls_then_the_gold_answer(world):
    sft = rows(world, "sft")
    assert len(sft) == SMALL["sft"]
    for r in sft:
        actions = [parse_turn(t) for t in r["replies"]]
        assert [type(a) for a in actions] == [ToolCall] * (len(actions) - 1) + [Answer]
        assert [a.name for a in actions[:-1]] == TOOLS_OF[r["category"]], r["id"]
        assert actions[-1].text == r["answer"][0]
        assert all(a.thinking for a in actions)
        for a in actions[:-1]:
            if a.name == "text_search_tool":
                assert a.arguments["query"].split()[0] == r["toy"]["entity"]
            if a.name == "image_zoom_in_tool":
                assert a.arguments == {"bbox_2d": r["toy"]["zoom_box"], "label": "logo"}
        if r["category"] == "knowledge":  # the question names the company; nothing to see
            assert r["toy"]["entity"] in r["question"]
        if r["category"] == "both":
            assert r["toy"]["entity"] not in r["question"]
            pick = next(a for a in actions if isinstance(a, ToolCall)
                        and a.name == "text_search_tool").thinking
            assert pick.startswith(f"Result {r['toy']['hit']} matches the logo: "
                                   f"{r['toy']['entity']}.")
    assert all("replies" not in r for s in ("train", "test") for r in rows(world, s))


@pytest.fixture(scope="module")
def text_index(world, tmp_path_factory) -> Path:
    from marscli.search.text_index import build_text_index

    out = tmp_path_factory.mktemp("toyidx") / "text.sqlite"
    build_text_index(str(world / "corpus.jsonl"), out, progress=False)
    return out


def test_expert_text_queries_find_the_fact(world, text_index):
    from marscli.tools.search import TextSearchTool

    tool = TextSearchTool(f"local:{text_index}", cache=None)
    for r in all_rows(world):
        if r["category"] == "perception":
            continue
        kw = {"city": "city", "founder": "founder", "year": "year"}[r["toy"]["attribute"]]
        res = tool({"query": f"{r['toy']['entity']} {kw}"})
        assert res.ok
        first = res.text.split("\n\n")[0]
        assert first.startswith(f"[1] {r['toy']['entity']}\n") and r["answer"][0] in first, \
            (r["id"], res.text)


def test_vocab_makes_every_answer_one_token(world):
    pytest.importorskip("tokenizers")
    from marscli.qwen.tiny import make_tokenizer, read_texts

    tok = make_tokenizer(read_texts([world / "vocab.txt"]))
    answers = {r["answer"][0] for r in all_rows(world)} | set(entities(world))
    for a in sorted(answers):
        if a.isdigit():
            continue  # Qwen's pre-tokeniser splits digits one by one
        for form in (a, " " + a):
            assert len(tok.encode(form, add_special_tokens=False)) == 1, form


def test_expert_replays_through_the_real_agent_and_tools(world, text_index, tiny_model, tmp_path):
    from marscli.agent.loop import Agent, AgentConfig
    from marscli.engines.replay import ReplayEngine
    from marscli.tools import build_tools

    prompts = load_prompts(str(world / "sft.jsonl"))
    engine = ReplayEngine(str(tiny_model))
    tools = build_tools(text_search=f"local:{text_index}", image_search="data", cache=None)
    agent = Agent(engine, tools, AgentConfig(max_turns=6), media_dir=tmp_path / "crops",
                  rel_to=tmp_path)
    recs = list(agent.run([(p, 0) for p in prompts]))
    assert len(recs) == len(prompts)
    for p, rec in zip(prompts, recs):
        assert rec["stop"] == "answer", (p.id, rec["stop"])
        assert rec["final_answer"] == p.answer[0]
        assert rec["format_errors"] == 0 and not rec["tool_errors"], (p.id, rec["tool_errors"])
        assert rec["turns"] == len(p.extra["replies"])
        tool_texts = [s["text"] for s in rec["segments"] if s["role"] == "tool"]
        if p.category == "both":
            entity = p.extra["toy"]["entity"]
            hit = p.extra["toy"]["hit"]
            search = next(t for t in tool_texts if t.startswith("Reverse image search"))
            assert f"[{hit}] {entity} <image>" in search
        if p.category != "perception":
            assert p.answer[0] in tool_texts[-1]


# ------------------------------------------------------------------------- failures and CLI


def test_refuses_existing_folder_and_leaves_nothing_on_failure(tmp_path, monkeypatch):
    from marscli.errors import BadInput
    from marscli.toy import world as world_mod

    out = tmp_path / "w"
    out.mkdir()
    (out / "keep").write_text("x")
    with pytest.raises(BadInput, match="--force"):
        build_world(out, **SMALL)
    assert (out / "keep").read_text() == "x"

    calls = {"n": 0}
    real = world_mod.render_scene

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("disk full")
        return real(*a, **k)

    monkeypatch.setattr(world_mod, "render_scene", flaky)
    with pytest.raises(RuntimeError):
        build_world(out, force=True, **SMALL)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w"]
    assert (out / "keep").read_text() == "x"

    with pytest.raises(BadInput, match="--entities"):
        build_world(tmp_path / "x", entities=2)
    # the command's ranges are the library's: a Python caller meets them too
    for opts, message in (({"entities": 97}, "--entities: 97 is out of range — must be >= 5 and "
                                             "<= 96"),
                          ({"train": -1}, "--train: -1 is out of range"),
                          ({"perceive": 1_000_001}, "--perceive: 1000001 is out of range"),
                          ({"size": 9000}, "--size: 9000 is out of range — must be >= 256")):
        with pytest.raises(BadInput, match=message):
            build_world(tmp_path / "x", **{**SMALL, **opts})
    assert not (tmp_path / "x").exists()


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_COLOR": "1"}
    return subprocess.run([sys.executable, "-m", "marscli", *args], capture_output=True,
                          text=True, env=env, timeout=120, check=False)


def test_cli_creates_the_folder_and_refuses_an_existing_one(tmp_path):
    out = tmp_path / "cw"
    args = ("toy-world", str(out), "--entities", "6", "--train", "3", "--test", "3",
            "--sft", "3", "--size", "256")
    r = _cli(*args)
    assert r.returncode == 0, r.stderr
    assert r.stdout == ""
    for name in ("README.md", "world.json", "corpus.jsonl", "logos.jsonl", "train.jsonl",
                 "test.jsonl", "sft.jsonl", "vocab.txt"):
        assert (out / name).is_file(), name
    assert len(list((out / "images").iterdir())) == 9
    assert json.loads((tmp_path / "cw.meta.json").read_text())["stage"] == "toy-world"
    before = files(out)

    r = _cli(*args)
    assert r.returncode == 2
    assert r.stderr.startswith("error: ") and "--force" in r.stderr
    assert files(out) == before

    r = _cli(*args, "--force")
    assert r.returncode == 0, r.stderr
    assert files(out) == before  # same seed, same bytes

    r = _cli("toy-world", str(tmp_path / "bad"), "--entities", "200")
    assert r.returncode == 2 and "--entities" in r.stderr
    assert not (tmp_path / "bad").exists()
    for bad, named in ((("--avoid-seeds", "0,x"), "--avoid-seeds"),
                       (("--avoid-seeds", "0,1", "--seed", "1"), "--avoid-seeds: 1"),
                       (("--entities", "60", "--seed", "9", "--avoid-seeds", "0,1,2",
                         "--avoid-entities", "8"), "--entities"),
                       (("--avoid-by", "shape"), "--avoid-by")):
        r = _cli("toy-world", str(tmp_path / "bad"), *bad)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and named in r.stderr, r.stderr
        assert not (tmp_path / "bad").exists()


def test_a_seed_past_64_bits_and_a_force_on_the_folder_in_use_are_one_line(tmp_path):
    """A seed world.json cannot hold, and --force on the current folder or one holding it
    (the replace would fail half-way, or delete the shell's folder): exit 2, one line,
    before anything is drawn; the world stays."""
    args = ("--entities", "5", "--train", "1", "--test", "0", "--sft", "0", "--size", "256")
    for seeds, named in (((("--seed", str(10**23)),), "--seed: 1000"),
                         ((("--avoid-seeds", f"1,{-10**23}"),), "--avoid-seeds: -1000")):
        r = _cli("toy-world", str(tmp_path / "bad"), *seeds[0], *args)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and named in r.stderr, r.stderr
        assert not (tmp_path / "bad").exists()
    out = tmp_path / "w"
    assert _cli("toy-world", str(out), *args).returncode == 0
    before = files(out)
    for cwd, target in ((out, "."), (out / "images", ".."), (out / "images", str(out))):
        r = subprocess.run([sys.executable, "-m", "marscli", "toy-world", target, *args,
                            "--force"], capture_output=True, text=True, cwd=cwd, timeout=120,
                           env={**os.environ, "NO_COLOR": "1"}, check=False)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert "current folder" in r.stderr and files(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w", "w.meta.json"]


def test_zoom_cells_box_is_the_aligned_block_holding_the_logo(tmp_path):
    build_world(tmp_path / "w", entities=5, train=12, test=0, sft=4, grid=4, zoom_cells=2,
                kinds=("perception",))
    rows = [orjson.loads(x) for x in (tmp_path / "w" / "train.jsonl").read_bytes().splitlines()]
    quadrants = {(0, 0, 500, 500), (500, 0, 1000, 500), (0, 500, 500, 1000), (500, 500, 1000, 1000)}
    for r in rows:
        box, logo = r["toy"]["zoom_box"], r["toy"]["logo_box"]
        assert tuple(box) in quadrants
        # the logo (pixels of a 1024 scene) lies inside the block (0..1000 of the scene)
        assert box[0] * 1.024 <= logo[0] and logo[2] <= box[2] * 1.024
        assert box[1] * 1.024 <= logo[1] and logo[3] <= box[3] * 1.024
    with pytest.raises(BadInput, match="zoom-cells"):
        build_world(tmp_path / "bad", entities=5, train=1, test=0, sft=0, grid=4, zoom_cells=3)


def test_zoomed_grounding_rows_name_the_cell_of_the_crop_the_logo_is_drawn_in(tmp_path):
    """With quadrant zooms, perceive-zoomed.jsonl asks where the logo is in each reading row's
    crop: the box answered is the quadrant of the crop holding the logo's plate, found here by
    its exact pixel colour; single-cell zooms write no such file (the box would be the crop)."""
    from marscli.toy.perceive import WHERE

    w = tmp_path / "w"
    build_world(w, seed=3, perceive=6, grid=4, zoom_cells=2, **SMALL)
    msgs = [orjson.loads(x) for x in (w / "perceive.jsonl").read_bytes().splitlines()]
    zoomed = [orjson.loads(x) for x in (w / "perceive-zoomed.jsonl").read_bytes().splitlines()]
    assert len(zoomed) == 6
    boxes = set()
    for k, z in enumerate(zoomed):
        assert z["images"] == msgs[2 * k]["images"]  # the reading row's crop
        assert z["messages"][1]["content"] == "<image>" + WHERE
        box = json.loads(z["messages"][2]["content"])
        crop = np.asarray(Image.open(w / z["images"][0]).convert("RGB")).astype(int)
        plate = np.zeros(crop.shape[:2], bool)
        for rgb in PLATES.values():
            plate |= np.abs(crop - rgb).max(-1) <= 2
        ys, xs = np.nonzero(plate)
        h, wd = plate.shape
        cx, cy = 1000 * xs.mean() / wd, 1000 * ys.mean() / h
        assert box[0] <= cx < box[2] and box[1] <= cy < box[3], (box, cx, cy)
        assert box[2] - box[0] == box[3] - box[1] == 500
        boxes.add(tuple(box))
    assert len(boxes) > 1  # not one answer for every scene
    build_world(tmp_path / "one", seed=3, perceive=2, **SMALL)
    assert not (tmp_path / "one" / "perceive-zoomed.jsonl").exists()


def test_logo_reading_rows_ask_each_logo_file_each_perception_question(tmp_path):
    """perceive-logos.jsonl: every logo file with the three perception questions; the colour
    answered is the one drawn in the file (most pixels of a logo colour), the shape and letter
    are its entity's, and a world without --perceive writes none."""
    from marscli.toy.entities import COLOURS

    w = tmp_path / "w"
    build_world(w, seed=3, perceive=1, **SMALL)
    rows = [orjson.loads(x) for x in (w / "perceive-logos.jsonl").read_bytes().splitlines()]
    by_file = {e["logo_path"]: e for e in entities(w).values()}
    assert len(rows) == 3 * len(by_file)
    asked = {}
    for r in rows:
        (image,) = r["images"]
        question, answer = r["messages"][1]["content"], r["messages"][2]["content"]
        asked.setdefault(image, set()).add(question)
        attr = next(a for a in ("colour", "shape", "letter") if a in question)
        logo = by_file[image]["logo"]
        assert answer == logo[attr], (image, attr)
        if attr == "colour":
            px = np.asarray(Image.open(w / image).convert("RGB")).astype(int)
            counts = {c: int((np.abs(px - rgb).max(-1) <= 2).sum()) for c, rgb in COLOURS.items()}
            assert max(counts, key=counts.get) == answer, counts
    assert set(asked) == set(by_file) and all(len(q) == 3 for q in asked.values())
    build_world(tmp_path / "none", seed=3, **SMALL)
    assert not (tmp_path / "none" / "perceive-logos.jsonl").exists()


def test_perception_rows_are_the_zoom_tools_crop_and_the_experts_box(tmp_path, tiny_model):
    from marscli.agent.messages import to_trajectory
    from marscli.qwen.policy import load_processor
    from marscli.toy.perceive import WHERE

    plain = tmp_path / "plain"
    build_world(plain, seed=0, **SMALL)
    w = tmp_path / "w"
    stats = build_world(w, seed=0, perceive=3, **SMALL)
    assert stats["perceive"] == 3 and stats["images"] == 27 + 6
    a, b = files(plain), files(w)
    for split in SPLITS:  # a split of its own: the others are byte for byte the same
        assert a[f"{split}.jsonl"] == b[f"{split}.jsonl"]
    msgs = [orjson.loads(x) for x in (w / "perceive.jsonl").read_bytes().splitlines()]
    assert len(msgs) == 6
    ents = entities(w)
    for k in range(3):
        read, ground = msgs[2 * k], msgs[2 * k + 1]
        scene = Image.open(w / ground["images"][0]).convert("RGB")
        box = json.loads(ground["messages"][-1]["content"])
        assert ground["messages"][1]["content"] == "<image>" + WHERE
        crop = np.asarray(Image.open(w / read["images"][0]).convert("RGB"))
        assert np.array_equal(crop, zoom(scene, box))  # what the agent will see
        q, ans = read["messages"][1]["content"], read["messages"][2]["content"]
        logo = next(e["logo"] for e in ents.values()
                    if ans in (e["logo"]["colour"], e["logo"]["shape"], e["logo"]["letter"]))
        if "colour" in q:  # the crop shows the shape in the answer's colour
            assert near(crop, COLOURS[ans]).sum() > 50, logo
    proc = load_processor(str(tiny_model))
    traj = to_trajectory(msgs[1], "perceive.jsonl", 2, w, proc, "unused")
    assert [s["role"] for s in traj["segments"]] == ["prompt", "model"]
    with pytest.raises(BadInput, match="--perceive"):
        build_world(tmp_path / "bad", seed=0, perceive=-1, **SMALL)


def test_direct_share_answers_that_many_sft_rows_without_zooming(tmp_path):
    from marscli.toy.expert import DIRECT

    base = {"entities": 5, "train": 4, "test": 3, "sft": 10, "size": 512, "grid": 4,
            "kinds": ("perception",)}
    build_world(tmp_path / "z", seed=0, **base)
    build_world(tmp_path / "d", seed=0, direct=0.3, **base)
    zoomed, direct = rows(tmp_path / "z", "sft"), rows(tmp_path / "d", "sft")
    no_zoom = [d for d in direct if len(d["replies"]) == 1]
    # round(0.3 x n) of each attribute's rows: colour 4 -> 1, shape 3 -> 1, letter 3 -> 1
    assert sorted(d["toy"]["attribute"] for d in no_zoom) == ["colour", "letter", "shape"]
    logos = [e["logo"] for e in entities(tmp_path / "d").values()]
    values = {a: {lg[a] for lg in logos} for a in ("colour", "shape", "letter")}
    for z, d in zip(zoomed, direct):
        assert z["replies"][-1].endswith(f"<answer>{z['answer'][0]}</answer>")
        if len(d["replies"]) == 1:  # the same question, a logo's value of the world, no tool
            answer = parse_turn(d["replies"][0])
            assert isinstance(answer, Answer) and answer.thinking == DIRECT
            assert answer.text in values[d["toy"]["attribute"]]
        else:
            assert d["replies"] == z["replies"]
    # the scenes and the other splits do not move (world.json records the share, vocab.txt and
    # the README hold the replies)
    moved = {"sft.jsonl": b"", "world.json": b"", "vocab.txt": b"", "README.md": b"",
             "syllables.txt": b""}
    assert files(tmp_path / "z") | moved == files(tmp_path / "d") | moved
    with pytest.raises(BadInput, match="--direct"):
        build_world(tmp_path / "bad", seed=0, direct=1.5, **base)


def test_direct_perception_rows_answer_blind_in_equal_shares(tmp_path):
    """A perception question answered without a zoom names some logo's value of the world,
    drawn without looking (the cold start under-uses the zoom without teaching the world's
    logos), and every attribute has the same share of such rows."""
    build_world(tmp_path / "w", seed=0, direct=0.3, entities=8, train=0, test=1, sft=180,
                size=512, grid=4, kinds=("perception",))
    sft = rows(tmp_path / "w", "sft")
    direct = [r for r in sft if len(r["replies"]) == 1]
    by_attr = Counter(r["toy"]["attribute"] for r in direct)
    assert by_attr == {"colour": 18, "shape": 18, "letter": 18}  # 0.3 x 60 each
    right = sum(parse_turn(r["replies"][0]).text == r["answer"][0] for r in direct)
    assert 0 < right < len(direct) / 2  # a blind draw: right at about the marginal's rate


def test_direct_search_rows_answer_another_companys_fact(tmp_path):
    """A search question answered without a tool names another company's fact: the cold start
    under-uses search without teaching the facts RL is tested on."""
    from marscli.toy.expert import DIRECT_SEARCH

    build_world(tmp_path / "w", seed=0, direct=1.0, entities=8, train=0, test=1, sft=30,
                size=512, grid=4, kinds=("knowledge", "both"))
    ents = entities(tmp_path / "w")
    for r in rows(tmp_path / "w", "sft"):
        (reply,) = r["replies"]
        answer = parse_turn(reply)
        assert isinstance(answer, Answer) and answer.thinking == DIRECT_SEARCH
        attr = r["toy"]["attribute"]
        assert answer.text != r["answer"][0], r["id"]
        assert answer.text in {e[attr] for n, e in ents.items() if n != r["toy"]["entity"]}


def test_avoided_worlds_share_no_logo_and_no_seed(tmp_path):
    from marscli.toy.world import world_entities

    def pairs(ents):
        return {(e.logo.shape, e.logo.colour) for e in ents}

    avoided = set().union(*(pairs(world_entities(s, 8)[0]) for s in (0, 1, 2)))
    ents, _, _ = world_entities(1000, 24, (0, 1, 2), 8)
    assert len(ents) == 24 and not pairs(ents) & avoided
    assert len({(e.logo.shape, e.logo.colour, e.logo.plate) for e in ents}) == 24
    # the same world when built: world.json records what it avoided
    build_world(tmp_path / "w", seed=1000, entities=24, avoid=(0, 1, 2), avoid_entities=8,
                train=1, test=0, sft=0, size=512, grid=4)
    world = json.loads((tmp_path / "w" / "world.json").read_text())
    assert world["avoid"] == {"seeds": [0, 1, 2], "entities": 8, "by": "pair"}
    assert [e["name"] for e in world["entities"]] == [e.name for e in ents]
    with pytest.raises(BadInput, match="--avoid-seeds: 1 is this world's own"):
        world_entities(1, 8, (0, 1))
    with pytest.raises(BadInput, match="--entities"):  # 48 pairs - 24 avoided, 2 plates each
        world_entities(1000, 96, (0, 1, 2), 8)


def test_avoiding_whole_logos_keeps_every_pair_and_redraws_until_none_is_reused():
    """--avoid-by logo: a reading world may show the demo's (shape, colour) pairs, never one of
    its logos whole; a world that reuses none is the world drawn without avoiding."""
    from marscli.toy.world import world_entities

    theirs = {e.logo for s in (0, 1, 2) for e in world_entities(s, 8)[0]}
    plain = [world_entities(s, 96)[0] for s in (1002, 1003, 1004, 1005)]
    reused = [s for s, ents in zip((1002, 1003, 1004, 1005), plain, strict=True)
              if theirs & {e.logo for e in ents}]
    clean = [s for s in (1002, 1003, 1004, 1005) if s not in reused]
    assert reused and clean  # both cases below are met by these seeds
    for seed in (1002, 1003, 1004, 1005):
        ents = world_entities(seed, 96, (0, 1, 2), 8, avoid_by="logo")[0]
        assert not theirs & {e.logo for e in ents}, seed
        assert {(e.logo.shape, e.logo.colour) for e in ents} \
            >= {(lg.shape, lg.colour) for lg in theirs}  # the pairs are all there
        assert (ents == plain[(1002, 1003, 1004, 1005).index(seed)]) == (seed in clean), seed
    with pytest.raises(BadInput, match="--avoid-by 'shape'"):
        world_entities(1002, 8, (0,), avoid_by="shape")


def test_syllables_tokenizer_splits_every_worlds_names_alike(tmp_path):
    """A tokenizer trained on one world's syllables.txt knows none of its names as a word:
    another world's names are token sequences of the same lengths (what lets a model
    pre-trained on some worlds copy the names of any other)."""
    pytest.importorskip("tokenizers")
    from marscli.qwen.tiny import make_tokenizer, read_texts

    for seed in (1000, 0):
        build_world(tmp_path / str(seed), seed=seed, entities=8, train=3, test=0, sft=3,
                    size=512, grid=4)
    text = (tmp_path / "1000" / "syllables.txt").read_text()
    tok = make_tokenizer(read_texts([tmp_path / "1000" / "syllables.txt"]))

    def lengths(seed: int) -> list[int]:
        w = json.loads((tmp_path / str(seed) / "world.json").read_text())
        names = [e["name"] for e in w["entities"]] + [e["founder"] for e in w["entities"]]
        assert not any(re.search(rf"\b{n}\b", text) for n in names if seed == 1000)
        return sorted(len(tok.encode(f, add_special_tokens=False)) for n in names
                      for f in (n, " " + n))

    seen, unseen = lengths(1000), lengths(0)
    assert min(seen) >= 2 and max(seen) <= 3 and min(unseen) >= 2 and max(unseen) <= 3
    assert abs(sum(seen) - sum(unseen)) <= 2, (seen, unseen)


def test_clutter_zero_leaves_the_gradient_and_the_logo(tmp_path):
    build_world(tmp_path / "w", seed=0, clutter=0.0, **SMALL)
    for r in rows(tmp_path / "w", "train"):
        pix = np.asarray(Image.open(tmp_path / "w" / r["image"]).convert("RGB")).astype(int)
        x0, y0, x1, y1 = r["toy"]["logo_box"]
        outside = pix.copy()
        outside[y0:y1, x0:x1] = pix[y0:y1, :1]  # the logo blanked out with its rows' colour
        # every row of the rest is one colour: a vertical gradient and nothing on it
        assert (outside == outside[:, :1]).all()
    with pytest.raises(BadInput, match="--clutter"):
        build_world(tmp_path / "bad", seed=0, clutter=-1, **SMALL)
