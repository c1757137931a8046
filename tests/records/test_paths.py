"""Hostile record ids (`../../x`, `a/b`, absolute paths, `..`) never make a stage write outside
its output folder: rollout and eval, with zoom crops and the data backend's search thumbnails,
both of which are files named after the trajectory id."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from PIL import Image

from helpers import prompt, read_jsonl, scene, write_jsonl

ESCAPE = f"marscli-escape-{uuid.uuid4().hex[:8]}"
IDS = ["../../x", "a/b", "../" * 12 + f"tmp/{ESCAPE}", f"/tmp/{ESCAPE}-abs", "..", ".",
       "a\\..\\..\\b", "~/x", "ok"]
REPLIES = [
    ('<thinking>Zoom.</thinking><tool_call>{"name": "image_zoom_in_tool", "arguments": '
    '{"bbox_2d": [500, 500, 1000, 1000]}}</tool_call>'),
    ('<thinking>Search.</thinking><tool_call>{"name": "image_search_tool", "arguments": {}}'
    '</tool_call>'),
    "<thinking>Red.</thinking><answer>red</answer>",
]
PER_TRAJECTORY = 3  # one crop, two thumbnails


def inputs(root: Path) -> Path:
    """Prompts (or a benchmark) with hostile ids, two thumbnails each, in root/data."""
    d = root / "data"
    d.mkdir(parents=True)
    scene(d / "scene.png")
    for i, c in enumerate([(200, 30, 30), (30, 30, 200)]):
        Image.new("RGB", (40, 30), c).save(d / f"thumb{i}.png")
    hits = [{"title": f"Logo {i}", "thumbnail": f"thumb{i}.png"} for i in range(2)]
    return write_jsonl(d / "p.jsonl", [prompt(i, replies=REPLIES, image_search=hits) for i in IDS])


def files(root: Path) -> set[Path]:
    return {p.resolve() for p in root.rglob("*") if p.is_file()}


def check_confined(root: Path, before: set[Path], out_dir: Path, media: Path,
                   n_media: int) -> set[Path]:
    new = files(root) - before
    assert all(out_dir.resolve() in p.parents for p in new), sorted(new)
    in_media = {p for p in new if p.parent == media.resolve()}
    assert len(in_media) == n_media  # one file per crop or thumbnail: none overwrote another
    assert not list(Path("/tmp").glob(f"{ESCAPE}*")) and not list(root.rglob(f"{ESCAPE}*"))
    return in_media


def check_records(recs: list[dict], out: Path, media: Path, n: int) -> None:
    assert sorted(r["id"] for r in recs) == sorted(f"{i}#{k}" for i in IDS for k in range(n))
    for r in recs:
        assert r["stop"] == "answer", r["id"]
        derived = r["images"][1:]
        assert len(derived) == PER_TRAJECTORY and {"bbox_2d", "title"} <= {
            k for im in derived for k in im}
        for im in derived:
            assert (out.parent / im["path"]).resolve().parent == media.resolve(), im["path"]


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("paths")


def test_rollout_writes_only_inside_its_output_folder(tiny_model, tree):
    from marscli.agent.runner import media_dir
    from marscli.stages.rollout import run_rollout

    root = tree / "rollout"
    prompts = inputs(root)
    out = root / "a" / "b" / "out" / "t.jsonl"
    before = files(root)
    run_rollout(str(prompts), str(out), policy=str(tiny_model), engine="replay", n=2,
                image_search="data", progress=False)
    media = media_dir(out)
    check_confined(root, before, out.parent, media, 2 * len(IDS) * PER_TRAJECTORY)
    check_records(read_jsonl(out), out, media, 2)


def test_eval_writes_only_inside_its_output_folder(tiny_model, tree):
    from marscli.agent.runner import media_dir
    from marscli.stages.eval import run_eval

    root = tree / "eval"
    bench = inputs(root)
    out = root / "a" / "b" / "out" / "r.jsonl"
    before = files(root)
    run_eval(str(bench), str(out), policy=str(tiny_model), engine="replay", samples=1,
             image_search="data", max_turns=4, progress=False)
    media = media_dir(out)
    check_confined(root, before, out.parent, media, len(IDS) * PER_TRAJECTORY)
    recs = read_jsonl(out)
    check_records(recs, out, media, 1)
    assert all(r["score"]["accuracy"] == 1.0 for r in recs)
