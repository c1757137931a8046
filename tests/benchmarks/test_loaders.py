"""Every benchmark loader on a small fixture written in its format by the test itself: MARS
folders, parquet (MMSearch, HR-MMSearch, verl-style FVQA), JSONL + image folders (V*,
InfoSeek), VLMEvalKit TSV with base64 PNGs (HR-Bench, MME-RealWorld); format detection; and
bad input named by file, line and field."""

from __future__ import annotations

import base64
import sys
from pathlib import Path

import pytest

from marscli.benchmarks import LoadContext, detect_format, load_benchmark
from marscli.benchmarks.common import split_options
from marscli.errors import BadInput

from helpers import HR_HEADER, hr_rows, png, write_jsonl, write_parquet, write_tsv


def save_png(path: Path, color=(200, 30, 30)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(png(color))
    return path


def ctx(tmp_path: Path, **kw) -> LoadContext:
    return LoadContext(source="test", cache_dir=tmp_path / "cache", **kw)


def load(path: Path, tmp_path: Path, fmt: str = "auto", **kw):
    return load_benchmark(str(path), fmt, ctx(tmp_path, **kw))


def by_id(loaded) -> dict:
    return {p.id: p for _, p in loaded.prompts}


# ----------------------------------------------------------------------- MARS folders


def test_mars_release_folder(tmp_path):
    folder = tmp_path / "eval" / "hr_bench_4k"
    save_png(folder / "images" / "a.png")
    write_jsonl(folder / "data.jsonl", [
        {"prompt": [{"role": "user", "content": "<image>What is shown?\n(A) a cat\n(B) a dog\n"
                                                 "Answer with the letter."}],
         "image": ["images/a.png"], "reward_model": {"ground_truth": ["B"]},
         "extra_info": {"index": 7}, "image_search_title_list": ["a dog"],
         "image_search_thumbnail_list": ["images/a.png"]},
    ])
    assert detect_format(folder) == "mars"
    loaded = load(folder, tmp_path)
    (line, p), = loaded.prompts
    assert line == 1 and p.id == "7" and p.answer == ["B"]
    assert p.extra["benchmark"] == "hrbench-4k"  # the release's folder name, mapped
    assert p.choices == ["a cat", "a dog"]  # parsed from the question of an MC benchmark
    assert p.image_paths()[0].is_file()
    assert p.image_search == [{"title": "a dog", "thumbnail": "images/a.png"}]


def test_marscli_rows_carry_their_benchmark_and_fields(tmp_path):
    save_png(tmp_path / "x.png")
    f = write_jsonl(tmp_path / "mixed.jsonl", [
        {"v": 1, "id": "q1", "image": "x.png", "question": "Q?", "answer": ["a1"],
         "benchmark": "fvqa", "category": "c1", "replies": ["r"]},
        {"v": 1, "id": "q2", "image": "x.png", "question": "Q?", "answer": ["a2"]},
    ])
    loaded = load(f, tmp_path, benchmark="mine")
    ps = by_id(loaded)
    assert ps["q1"].extra["benchmark"] == "fvqa" and ps["q1"].extra["replies"] == ["r"]
    assert ps["q2"].extra["benchmark"] == "mine" and ps["q1"].category == "c1"


@pytest.mark.parametrize("gold", [{}, {"answer": []}, {"answer": ""}, {"answer": ["  "]},
                                  {"prompt": [{"role": "user", "content": "<image>Q?"}],
                                   "reward_model": {"ground_truth": ""}}])
def test_a_row_without_gold_is_refused_at_load(tmp_path, gold):
    """No gold answer is never an item scored 0: the loader refuses it, naming the row."""
    save_png(tmp_path / "x.png")
    row = {"id": "q2", "image": "x.png", **({} if "prompt" in gold else {"question": "Q?"}),
           **gold}
    f = write_jsonl(tmp_path / "mixed.jsonl", [
        {"id": "q1", "image": "x.png", "question": "Q?", "answer": ["a1"]}, row])
    with pytest.raises(BadInput, match=r"mixed\.jsonl:2: answer: missing gold answer"):
        load(f, tmp_path, benchmark="fvqa")


def test_split_on_a_single_file_is_refused(tmp_path):
    """--split chooses among a folder's files; on one file it would be silently ignored."""
    save_png(tmp_path / "x.png")
    f = write_jsonl(tmp_path / "b.jsonl", [
        {"id": "q1", "image": "x.png", "question": "Q?", "answer": ["a1"]}])
    with pytest.raises(BadInput, match=r"--split dev: .*b\.jsonl is one file"):
        load(f, tmp_path, split="dev")


# ----------------------------------------------------------------------- parquet


@pytest.fixture()
def pa():
    return pytest.importorskip("pyarrow")


def test_mmsearch_parquet(tmp_path, pa):
    img = png()
    f = write_parquet(tmp_path / "mmsearch" / "end2end.parquet", [
        {"sample_id": "s1", "query": "Who made this?", "query_image": {"bytes": img, "path": None},
         "gt_answer": "ACME", "alternative_gt_answers": ["Acme Corp"], "area": "news",
         "subfield": "tech", "image_search_result": {"bytes": img, "path": None}},
        {"sample_id": "s2", "query": "Text only?", "query_image": None,
         "gt_answer": "x", "alternative_gt_answers": [], "area": "knowledge",
         "subfield": "art", "image_search_result": None},
    ])
    assert detect_format(f) == "mmsearch"
    loaded = load(f, tmp_path)
    assert loaded.rows == 2 and loaded.unit == "row"
    assert loaded.skipped == {"text-only queries (no query_image)": 1}
    (n, p), = loaded.prompts
    assert n == 1 and p.id == "s1" and p.answer == ["ACME", "Acme Corp"]
    assert p.category == "news" and p.extra["subfield"] == "tech"
    assert p.extra["benchmark"] == "mmsearch" and "image_search_result" not in p.extra
    cached = Path(p.images[0])
    assert cached.parent == tmp_path / "cache" and cached.suffix == ".png"
    assert cached.read_bytes() == img  # named by sha256, bytes unchanged
    import hashlib

    assert cached.stem == hashlib.sha256(img).hexdigest()


def test_hr_mmsearch_parquet_folder_and_shard_keep(tmp_path, pa):
    rows = [{"sample_id": f"h{i}", "query": f"q{i}?", "query_image": {"bytes": png((i, 0, 0)),
             "path": None}, "ground_truth": f"a{i}", "difficulty": "hard", "category": "sport"}
            for i in range(6)]
    folder = tmp_path / "HR-MMSearch"
    write_parquet(folder / "data" / "train-00000-of-00002.parquet", rows[:3])
    write_parquet(folder / "data" / "train-00001-of-00002.parquet", rows[3:])
    assert detect_format(folder) == "hr-mmsearch"
    keep = {"h1", "h4"}
    loaded = load(folder, tmp_path, keep=lambda i: i in keep)
    assert loaded.rows == 6 and set(by_id(loaded)) == keep
    assert len(list((tmp_path / "cache").iterdir())) == 2  # other shards' images not decoded
    p = by_id(loaded)["h4"]
    assert p.answer == ["a4"] and p.category == "sport" and p.extra["difficulty"] == "hard"


def test_fvqa_verl_parquet_with_image_paths(tmp_path, pa):
    save_png(tmp_path / "fv" / "imgs" / "1.png")
    f = write_parquet(tmp_path / "fv" / "fvqa_test.parquet", [
        {"data_source": "fvqa", "prompt": [{"role": "user", "content": "<image>Which bird?"}],
         "images": [{"bytes": png((0, 0, 200)), "path": None}],
         "reward_model": {"ground_truth": ["robin"], "style": "rule"},
         "extra_info": {"index": 3}},
        {"data_source": "fvqa", "prompt": [{"role": "user", "content": "<image>Which tree?"}],
         "images": [{"bytes": None, "path": "imgs/1.png"}],
         "reward_model": {"ground_truth": ["oak", "quercus"], "style": "rule"},
         "extra_info": {"index": 4}},
    ])
    assert detect_format(f) == "fvqa"  # generic columns: the file name decides
    ps = by_id(load(f, tmp_path))
    assert ps["3"].question == "Which bird?" and ps["3"].answer == ["robin"]
    assert ps["4"].answer == ["oak", "quercus"]
    assert ps["4"].image_paths()[0] == tmp_path / "fv" / "imgs" / "1.png"
    assert ps["3"].extra["benchmark"] == "fvqa" and ps["3"].extra["data_source"] == "fvqa"


def test_parquet_without_pyarrow_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    with pytest.raises(BadInput, match=r'needs pyarrow: pip install "marscli\[eval\]"'):
        load(tmp_path / "x.parquet", tmp_path, fmt="mmsearch")


def test_parquet_missing_column_is_named(tmp_path, pa):
    f = write_parquet(tmp_path / "m.parquet", [{"sample_id": "a", "query": "q?"}])
    with pytest.raises(BadInput, match=r"m\.parquet: no answer column — expected one of "
                                       r"gt_answer"):
        load(f, tmp_path, fmt="mmsearch")


# ----------------------------------------------------------------------- JSONL + images


def test_vstar_jsonl(tmp_path):
    root = tmp_path / "vstar_bench"
    save_png(root / "direct_attributes" / "sa_1.jpg")
    save_png(root / "relative_position" / "sa_2.jpg")
    write_jsonl(root / "test_questions.jsonl", [
        {"image": "direct_attributes/sa_1.jpg", "text": "What is the color of the cup?\n"
         "(A) red\n(B) blue\n(C) green\n(D) white\nAnswer with the option's letter from the "
         "given choices directly.", "category": "direct_attributes", "question_id": 0,
         "label": "C"},
        {"image": "relative_position/sa_2.jpg", "text": "Is the cat left of the dog?\n(A) yes\n"
         "(B) no\nAnswer with the option's letter from the given choices directly.",
         "category": "relative_position", "question_id": 1, "label": "(A)"},
    ])
    assert detect_format(root) == "vstar"
    ps = by_id(load(root, tmp_path))
    p0, p1 = ps["0"], ps["1"]
    assert p0.choices == ["red", "blue", "green", "white"] and p0.answer == ["C"]
    assert p0.question == ("What is the color of the cup?\nOptions:\nA. red\nB. blue\nC. green\n"
                           "D. white\nAnswer with the option's letter.")
    assert p1.choices == ["yes", "no"] and p1.answer == ["A"]
    assert p0.category == "direct_attributes" and p0.image_paths()[0].is_file()


def test_vstar_bad_label_names_line(tmp_path):
    save_png(tmp_path / "a.jpg")
    f = write_jsonl(tmp_path / "test_questions.jsonl", [
        {"image": "a.jpg", "text": "Q?\n(A) x\n(B) y", "label": "C", "question_id": 5}])
    with pytest.raises(BadInput, match=r"test_questions\.jsonl:1: label: 'C' is not one of the "
                                       r"options A-B"):
        load(f, tmp_path, fmt="vstar")


def test_infoseek_jsonl_with_qtype_file_and_image_dir(tmp_path):
    imgs = tmp_path / "oven_images"
    save_png(imgs / "oven_001.jpg")
    save_png(imgs / "oven_002.png")
    root = tmp_path / "infoseek"
    write_jsonl(root / "infoseek_val.jsonl", [
        {"data_id": "val_1", "image_id": "oven_001", "question": "How tall is it?",
         "answer": ["300"], "answer_eval": [{"wikidata": 300.0, "range": [270.0, 330.0]}],
         "data_split": "val_unseen_question"},
        {"data_id": "val_2", "image_id": "oven_002", "question": "Who built it?",
         "answer": ["Eiffel"], "answer_eval": ["Gustave Eiffel", "Eiffel"],
         "data_split": "val_unseen_entity"},
    ])
    write_jsonl(root / "infoseek_val_qtype.jsonl", [
        {"data_id": "val_1", "question_type": "Numerical"},
        {"data_id": "val_2", "question_type": "String"}])
    assert detect_format(root / "infoseek_val.jsonl") == "infoseek"
    ps = by_id(load(root, tmp_path, image_dir=imgs))
    assert ps["val_1"].image_paths()[0] == imgs / "oven_001.jpg"
    assert ps["val_2"].image_paths()[0] == imgs / "oven_002.png"  # extension found
    assert ps["val_1"].category == "numerical" and ps["val_2"].category == "string"
    assert ps["val_1"].extra["answer_eval"][0]["range"] == [270.0, 330.0]
    assert ps["val_2"].extra["data_split"] == "val_unseen_entity"


# ----------------------------------------------------------------------- TSV


def test_hrbench_tsv(tmp_path):
    f = write_tsv(tmp_path / "hr_bench_8k.tsv", HR_HEADER, hr_rows())
    assert detect_format(f) == "hrbench"
    loaded = load(f, tmp_path)
    ps = by_id(loaded)
    assert [line for line, _ in loaded.prompts] == [2, 3, 4]
    assert ps["0"].extra["benchmark"] == "hrbench-8k"
    assert ps["0"].choices == ["cat", "dog", "cow", "pig"] and ps["0"].answer == ["B"]
    assert ps["0"].extra["cycle_category"] == "cycle1" and ps["0"].category == "single"
    assert ps["1"].images == ps["0"].images  # row 1's image names row 0's index
    assert ps["2"].question.startswith("Which is larger?\nLook closely.\nOptions:\nA. left")
    assert len(list((tmp_path / "cache").iterdir())) == 1  # one image, written once


def test_mme_realworld_tsv_has_five_options(tmp_path):
    b64 = base64.b64encode(png()).decode()
    f = write_tsv(tmp_path / "MME-RealWorld.tsv",
                  ["index", "question", "A", "B", "C", "D", "E", "answer", "category",
                   "l2-category", "image"],
                  [["11", "How many cars?", "(A) 1", "(B) 2", "(C) 3", "(D) 4",
                    "(E) The image does not feature the cars.", "E", "Perception", "count", b64],
                   ["12", "Colour?", "red", "blue", "", "", "", "B", "Perception", "color",
                    b64]])
    assert detect_format(f) == "mme-realworld"
    ps = by_id(load(f, tmp_path))
    assert len(ps["11"].choices) == 5 and ps["11"].answer == ["E"]
    assert ps["12"].choices == ["red", "blue"]  # empty options dropped
    assert ps["11"].extra["benchmark"] == "mme-realworld"
    assert ps["11"].extra["l2-category"] == "count"


def test_tsv_missing_column_names_column_and_line(tmp_path):
    header = [c for c in HR_HEADER if c != "answer"]
    rows = [[c for i, c in enumerate(r) if HR_HEADER[i] != "answer"] for r in hr_rows()]
    f = write_tsv(tmp_path / "hr_bench_4k.tsv", header, rows)
    with pytest.raises(BadInput, match=r"hr_bench_4k\.tsv:1: header: missing column 'answer'"):
        load(f, tmp_path, fmt="hrbench")


def test_tsv_bad_rows_name_their_line(tmp_path):
    rows = hr_rows()
    rows[2][6] = "F"  # the third data row (a two-line quoted question): file lines 4-5
    f = write_tsv(tmp_path / "hr_bench_4k.tsv", HR_HEADER, rows)
    with pytest.raises(BadInput, match=r"hr_bench_4k\.tsv:4: answer: 'F' is not one of the "
                                       r"options A-D"):
        load(f, tmp_path)
    rows = hr_rows()
    rows[1][8] = "99"  # names no row
    f = write_tsv(tmp_path / "hr_bench_4k.tsv", HR_HEADER, rows)
    with pytest.raises(BadInput, match=r"hr_bench_4k\.tsv:3: image: '99' is neither"):
        load(f, tmp_path)


# ----------------------------------------------------------------------- formats


def test_unknown_format_lists_the_valid_names(tmp_path):
    save_png(tmp_path / "x.png")
    with pytest.raises(BadInput) as e:
        load(tmp_path / "x.png", tmp_path, fmt="nope")
    msg = str(e.value)
    assert msg.startswith("unknown --format 'nope'")
    for name in ("auto", "mars", "mmsearch", "hr-mmsearch", "fvqa", "infoseek", "simplevqa",
                 "livevqa", "vstar", "hrbench", "mme-realworld"):
        assert name in msg
    with pytest.raises(BadInput, match=r"x\.png: unknown file type \.png"):
        load(tmp_path / "x.png", tmp_path)


def test_split_options():
    assert split_options("Q?\n(A) x\n(B) y\nAnswer.") == ("Q?", ["x", "y"])
    assert split_options("Q?\nOptions:\nA. x\nB. y\nC. z") == ("Q?", ["x", "y", "z"])
    assert split_options("Just a question") == ("Just a question", [])
