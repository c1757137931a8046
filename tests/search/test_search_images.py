"""Reverse image search offline: the perceptual-hash index and the row-driven `data` backend."""

from __future__ import annotations

import random

import orjson
import pytest
from PIL import Image, ImageDraw

from marscli.errors import BadInput
from marscli.search.image_index import LocalImageBackend, build_image_index, image_hashes
from marscli.tools import ConvImage, ToolContext
from marscli.tools.search import ImageSearchTool, query_image


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MARSCLI_CACHE_DIR", str(tmp_path / "cache"))


def scene(seed: int, size=(320, 240)) -> Image.Image:
    """A distinct picture per seed: a colour gradient plus random shapes."""
    rng = random.Random(seed)
    w, h = size
    c0, c1 = [tuple(rng.randrange(256) for _ in range(3)) for _ in range(2)]
    im = Image.linear_gradient("L").resize(size).convert("RGB")
    im = Image.composite(Image.new("RGB", size, c0), Image.new("RGB", size, c1),
                         im.convert("L").rotate(rng.choice([0, 90, 180, 270]), expand=False)
                         .resize(size))
    d = ImageDraw.Draw(im)
    for _ in range(rng.randint(4, 9)):
        x0, y0 = rng.randrange(w), rng.randrange(h)
        x1, y1 = x0 + rng.randint(20, w // 2), y0 + rng.randint(20, h // 2)
        fill = tuple(rng.randrange(256) for _ in range(3))
        rng.choice([d.rectangle, d.ellipse])([x0, y0, x1, y1], fill=fill)
    return im


@pytest.fixture
def gallery(tmp_path):
    folder = tmp_path / "gallery"
    folder.mkdir()
    for i in range(20):
        scene(i).save(folder / f"scene_{i:02d}.png")
    out = tmp_path / "images.sqlite"
    assert build_image_index(str(folder), out) == 20
    return folder, out


def altered(im: Image.Image) -> Image.Image:
    """Resized to 60 % and cropped by about 4 % on each side, then JPEG-compressed."""
    w, h = im.size
    im = im.crop((int(w * .04), int(h * .03), int(w * .96), int(h * .97)))
    im = im.resize((int(im.width * .6), int(im.height * .6)), Image.BILINEAR)
    import io
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=70)
    return Image.open(io.BytesIO(buf.getvalue())).convert("RGB")


def test_scenes_are_distinct():
    hashes = {image_hashes(scene(i)) for i in range(20)}
    assert len(hashes) == 20


def test_index_finds_a_resized_cropped_copy(gallery):
    _, out = gallery
    be = LocalImageBackend(str(out))
    for i in range(20):
        (best, d0), (_, d1) = be.nearest(altered(scene(i)), 2)[:2]
        assert be.titles[best] == f"scene {i:02d}", (i, d0, d1)
        assert d0 < d1


def test_local_backend_through_the_tool(gallery, tmp_path):
    folder, out = gallery
    q = altered(scene(7))
    res = ImageSearchTool(f"local:{out}")({}, ToolContext(images=[ConvImage(image=q, ref={},
                                                                          source=q)]))
    assert res.ok and res.text.splitlines()[1] == "[1] scene 07 <image>"
    assert len(res.images) == 5 and res.text.count("<image>") == 5
    assert res.images[0].meta == {"title": "scene 07", "thumbnail": str(folder / "scene_07.png")}
    # the index stores paths relative to itself: it still works after moving both together
    (tmp_path / "moved").mkdir()
    folder.rename(tmp_path / "moved" / "gallery")
    out.rename(tmp_path / "moved" / "images.sqlite")
    q.save(tmp_path / "q.png")
    res = query_image(str(tmp_path / "q.png"), f"local:{tmp_path}/moved/images.sqlite")
    assert res.images[0].meta["thumbnail"] == str(tmp_path / "moved/gallery/scene_07.png")


def test_local_backend_without_an_image_is_an_error_observation(gallery):
    res = ImageSearchTool(f"local:{gallery[1]}")({}, ToolContext(images=[]))
    assert not res.ok and res.text.startswith("error:")


def test_index_from_jsonl_and_bad_rows(tmp_path):
    scene(1).save(tmp_path / "a.png")
    (tmp_path / "list.jsonl").write_bytes(
        orjson.dumps({"path": "a.png", "title": "The A"}) + b"\n")
    out = tmp_path / "i.sqlite"
    assert build_image_index(str(tmp_path / "list.jsonl"), out) == 1
    assert LocalImageBackend(str(out)).titles == ["The A"]
    (tmp_path / "bad.jsonl").write_bytes(
        orjson.dumps({"path": "a.png"}) + b"\n" + orjson.dumps({"path": "missing.png"}) + b"\n")
    with pytest.raises(BadInput, match=r"bad\.jsonl:2: path: .*missing\.png: image not found"):
        build_image_index(str(tmp_path / "bad.jsonl"), tmp_path / "j.sqlite")
    assert not list(tmp_path.glob("j.sqlite*"))


def _thumbs(tmp_path, n):
    (tmp_path / "thumbs").mkdir()
    for i in range(n):
        scene(100 + i, (64, 48)).save(tmp_path / "thumbs" / f"{i}.png")
    return [f"thumbs/{i}.png" for i in range(n)]


def test_data_backend_marscli_rows(tmp_path):
    thumbs = _thumbs(tmp_path, 7)
    row = {"v": 1, "id": "q1", "_base": str(tmp_path),
           "image_search": [{"title": f"T{i}", "thumbnail": t} for i, t in enumerate(thumbs)]}
    row["image_search"][1]["thumbnail"] = "thumbs/missing.png"
    res = ImageSearchTool("data")({}, ToolContext(images=[], row=row))
    assert res.ok and res.text.splitlines() == [
        "Reverse image search results:", "[1] T0 <image>", "[2] T1 (thumbnail unavailable)",
        "[3] T2 <image>", "[4] T3 <image>", "[5] T4 <image>"]
    assert [n.meta["title"] for n in res.images] == ["T0", "T2", "T3", "T4"]
    assert res.images[0].meta["thumbnail"] == str(tmp_path / "thumbs/0.png")
    assert res.images[0].image.size == (64, 48)


def test_data_backend_mars_rows(tmp_path):
    thumbs = _thumbs(tmp_path, 2)
    row = {"prompt": [{"role": "user", "content": "<image>Q"}], "_base": str(tmp_path),
           "image_search_title_list": ["Alpha", "Beta"], "image_search_thumbnail_list": thumbs}
    res = ImageSearchTool("data", image_k=5)({}, ToolContext(images=[], row=row))
    assert res.text.splitlines()[1:] == ["[1] Alpha <image>", "[2] Beta <image>"]
    assert len(res.images) == 2


def test_data_backend_without_results(tmp_path):
    res = ImageSearchTool("data")({}, ToolContext(images=[], row={"id": "x"}))
    assert res.ok and res.text == "No matching images were found." and not res.images
    with pytest.raises(BadInput, match="image_search"):
        ImageSearchTool("data")({}, ToolContext(images=[], row={"image_search": "nope"}))
