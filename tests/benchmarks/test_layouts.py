"""The benchmarks in the layouts they are published in (dataset cards, lmms-eval task files,
the benchmarks' own evaluation code; docs/evaluation.md has the table), each built here with
small images: found by `--format auto`, read by `--format NAME`, checked by `eval --check`
(normalised rows on stdout, a summary on stderr), and bad rows refused in one line; then
`eval summarize RUN` against hand-computed intervals."""

from __future__ import annotations

import base64
import csv
import io
import json
from pathlib import Path

import orjson
import pytest

from marscli.benchmarks import LoadContext, detect_format, load_benchmark
from marscli.errors import BadInput
from marscli.evaluation.check import one_line
from marscli.evaluation.compare import compare, wilson

from helpers import HR_HEADER, hr_rows, invoke, png, write_jsonl, write_parquet, write_tsv


@pytest.fixture()
def pa():
    return pytest.importorskip("pyarrow")


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    """`eval --check`'s decoded images go here, not into ~/.cache."""
    monkeypatch.setenv("MARSCLI_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "eval-images"


def b64(color=(10, 20, 30)) -> str:
    return base64.b64encode(png(color)).decode()


def load(path: Path, tmp_path: Path, fmt: str = "auto", **kw):
    ctx = LoadContext(source="t", cache_dir=tmp_path / "cache", **kw)
    return load_benchmark(str(path), fmt, ctx)


def check(path: Path, *args: str) -> tuple[int, list[dict], str]:
    code, out, err = invoke(["eval", str(path), "--check", *args])
    return code, [json.loads(line) for line in out.splitlines() if line.strip()], err


def one_line_error(code: int, out: str, err: str) -> str:
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and out == "" and len(lines) == 1, (code, out, err)
    assert lines[0].startswith("error: ") and len(lines[0]) <= 200, lines[0]
    return lines[0]


# ----------------------------------------------------------------------- SimpleVQA


def simplevqa_rows(image) -> list[dict]:
    return [{"data_id": 0, "image": image, "image_description": "", "language": "EN",
             "question": "Which city is this?", "answer": "Paris",
             "original_category": "geography", "source": "web", "atomic_question": "x",
             "atomic_fact": "y", "vqa_category": "place"},
            {"data_id": 1, "image": image, "image_description": "", "language": "CN",
             "question": "这是哪里?", "answer": "巴黎", "original_category": "geography",
             "source": "web", "atomic_question": "x", "atomic_fact": "y",
             "vqa_category": "place"}]


def test_simplevqa_base64_image_column(tmp_path):
    f = write_jsonl(tmp_path / "simplevqa.jsonl", simplevqa_rows(b64()))
    assert detect_format(f) == "simplevqa"  # by its columns, not the file name
    code, rows, err = check(f)
    assert code == 0, err
    (row,) = rows
    assert row["id"] == "0" and row["answer"] == ["Paris"] and row["category"] == "geography"
    img = Path(row["image"])
    assert img.is_absolute() and img.read_bytes() == png((10, 20, 30))
    assert row["benchmark"] == "simplevqa" and row["choices"] is None
    assert "2 rows, 1 kept, skipped: 1 not English" in err


def test_simplevqa_hf_parquet_image_struct(tmp_path, pa, cache):
    write_parquet(tmp_path / "SimpleVQA" / "data" / "test-00000-of-00001.parquet",
                  simplevqa_rows({"bytes": png((1, 2, 3)), "path": None}))
    code, rows, err = check(tmp_path / "SimpleVQA")
    assert code == 0, err
    (row,) = rows
    img = Path(row.pop("image"))
    assert row == {"v": 1, "id": "0", "question": "Which city is this?", "answer": ["Paris"],
                   "choices": None, "category": "geography", "benchmark": "simplevqa",
                   "split": "test"}
    assert img.parent == cache and img.read_bytes() == png((1, 2, 3))
    assert ("check: simplevqa (simplevqa format, split test): 2 rows, 1 kept, skipped: 1 not "
            "English") in err


def test_bad_base64_is_one_short_line_without_the_blob(tmp_path):
    blob = "QUJD" * 400  # base64 of text, not of an image: 1600 characters
    rows = simplevqa_rows(b64())
    rows[0]["image"] = blob + "!"  # not even base64's alphabet at the end
    f = write_jsonl(tmp_path / "simplevqa.jsonl", rows)
    line = one_line_error(*invoke(["eval", str(f), "--check"]))
    assert "simplevqa.jsonl:1: image" in line and "QUJDQUJD" not in line


# ----------------------------------------------------------------------- not UTF-8


def test_tsv_not_utf8_is_one_line_naming_the_row_and_column(tmp_path):
    """A Latin-1 byte in the third row (which starts on line 4: the second row's question
    spans two lines) is named by line and column, exit 2, not a decoder traceback."""
    rows = hr_rows()
    rows[2][7] = "cross\udce9"  # `category`; written back as the raw byte 0xe9
    f = write_tsv(tmp_path / "hr_bench_4k.tsv", HR_HEADER, [])
    f.write_bytes(f.read_bytes() + "\n".join("\t".join(r) for r in rows).encode(
        "utf-8", "surrogateescape") + b"\n")
    line = one_line_error(*invoke(["eval", str(f), "--check"]))
    assert line == (f"error: {f}:4: category: not valid UTF-8 (byte 0xe9) — save the file "
                    "as UTF-8")


@pytest.mark.parametrize("name, fmt, where", [("qa.json", "livevqa", "qa.json:2:"),
                                              ("rows.jsonl", "livevqa", "rows.jsonl:2:")])
def test_json_not_utf8_is_one_line_naming_the_line(tmp_path, name, fmt, where):
    good = json.dumps({"id": "a", "query": "Q?", "gt_answer": "x", "query_image": "i.png"})
    bad = good.replace("Q?", "caf\udce9?").encode("utf-8", "surrogateescape")
    body = (b"[" + good.encode() + b",\n" + bad + b"]") if name.endswith(".json") else \
        good.encode() + b"\n" + bad + b"\n"
    (tmp_path / name).write_bytes(body)
    line = one_line_error(*invoke(["eval", str(tmp_path / name), "--check", "--format", fmt]))
    assert where in line and "UTF-8" in line


# ----------------------------------------------------------------------- LiveVQA


def test_livevqa_qa_json_array_with_authors_absolute_paths(tmp_path):
    root = tmp_path / "LiveVQA"
    (root / "image").mkdir(parents=True)
    (root / "image" / "news_001.jpg").write_bytes(png((5, 5, 5)))
    (root / "qa.json").write_text(json.dumps([
        {"id": "lv1", "query": "Who is speaking at this event?", "gt_answer": "Jane Doe",
         "query_image": "/data/authors/LiveVQA/image/news_001.jpg", "topic": "politics"}]))
    assert detect_format(root) == "livevqa"
    code, rows, err = check(root)
    assert code == 0, err
    assert rows[0]["image"] == str((root / "image" / "news_001.jpg").resolve())
    assert rows[0]["category"] == "politics" and rows[0]["answer"] == ["Jane Doe"]
    # a missing image: the row (the array's first object), the field and the file searched
    (root / "image" / "news_001.jpg").unlink()
    line = one_line_error(*invoke(["eval", str(root), "--check"]))
    assert "qa.json: row 1: image:" in line and "news_001.jpg" in line


def test_livevqa_qa_json_given_as_the_file_is_livevqa_not_mmsearch(tmp_path):
    """LiveVQA's rows have MMSearch's `query` + `gt_answer`: its published file name decides,
    and without it the columns MMSearch alone has do."""
    root = tmp_path / "LiveVQA"
    (root / "image").mkdir(parents=True)
    (root / "image" / "n1.jpg").write_bytes(png())
    row = {"id": "lv1", "query": "Who is this?", "gt_answer": "Jane Doe",
           "query_image": "/data/authors/LiveVQA/image/n1.jpg", "topic": "politics"}
    (root / "qa.json").write_text(json.dumps([row]))
    assert detect_format(root / "qa.json") == "livevqa"
    code, rows, err = check(root / "qa.json")
    assert code == 0, err
    assert rows[0]["benchmark"] == "livevqa" and "check: livevqa (livevqa format" in err
    assert rows[0]["image"] == str((root / "image" / "n1.jpg").resolve())
    write_jsonl(tmp_path / "rows.jsonl", [row])  # another name: the columns alone
    assert detect_format(tmp_path / "rows.jsonl") == "livevqa"
    write_jsonl(tmp_path / "end2end.jsonl", [{**row, "sample_id": "s1", "area": "news"}])
    assert detect_format(tmp_path / "end2end.jsonl") == "mmsearch"


def test_long_paths_are_shortened_not_the_row_and_field(tmp_path):
    """With paths of 150+ characters, the error line keeps the file's name, the row and the
    field (the folders give way), and stays within 200 characters."""
    root = tmp_path / ("d" * 70) / ("e" * 70) / "LiveVQA"
    root.mkdir(parents=True)
    (root / "qa.json").write_text(json.dumps([
        {"id": "lv1", "query": "Who?", "gt_answer": "Jane", "query_image": "/x/news_001.jpg"}]))
    line = one_line_error(*invoke(["eval", str(root), "--check"]))
    assert line.startswith("error: .../qa.json: row 1: image: ") and "news_001.jpg" in line
    msg = f"{root}/qa.json: row 7: query_image: missing image"
    assert one_line(msg) == ".../qa.json: row 7: query_image: missing image"
    short = f"{tmp_path}/qa.json: row 7: query_image: missing image"
    assert one_line(short) == short  # within the limit: untouched
    assert one_line("x" * 300) == "x" * 190 + "..."  # no path: the tail is cut


# ----------------------------------------------------------------------- MAT-Search


def test_mat_search_json_array_and_image_folder(tmp_path):
    root = tmp_path / "MAT-Benchmark"
    (root / "MAT-Search-image").mkdir(parents=True)
    (root / "MAT-Search-image" / "1.png").write_bytes(png())
    (root / "MAT-Search.json").write_text(json.dumps([
        {"id": 1, "question": "The currency in the picture is the official currency of "
         "which country?", "answer": "United States", "image_path": "1.png"}]))
    assert detect_format(root) == "mat-search"
    assert detect_format(root / "MAT-Search.json") == "mat-search"
    code, rows, err = check(root / "MAT-Search.json")
    assert code == 0, err
    assert rows[0]["id"] == "1" and rows[0]["answer"] == ["United States"]
    assert rows[0]["image"] == str((root / "MAT-Search-image" / "1.png").resolve())
    assert rows[0]["benchmark"] == "mat-search"


# ----------------------------------------------------------------------- any container

# One row of each flat layout (strings only, as a TSV holds them) and its image folder.
FLAT = {
    "livevqa": ({"id": "lv1", "query": "Who is this?", "gt_answer": "Jane Doe",
                 "query_image": "/data/authors/LiveVQA/image/n1.png", "topic": "politics"},
                "image"),
    "mat-search": ({"id": "7", "question": "Which country?", "answer": "United States",
                    "image_path": "n1.png"}, "MAT-Search-image"),
    "simplevqa": ({"data_id": "0", "image": b64((7, 7, 7)), "language": "EN",
                   "question": "Which city?", "answer": "Paris",
                   "original_category": "geography"}, None),
}


def write_container(folder: Path, row: dict, container: str) -> Path:
    if container == "jsonl":
        return write_jsonl(folder / "rows.jsonl", [row])
    if container == "parquet":
        return write_parquet(folder / "rows.parquet", [row])
    return write_tsv(folder / "rows.tsv", list(row), [list(row.values())])


@pytest.mark.parametrize("fmt", sorted(FLAT))
def test_format_name_reads_every_container_alike(tmp_path, pa, fmt):
    """`--format NAME` on JSONL, parquet and TSV: the same normalised rows (the image
    compared by its bytes: a path beside each file, or base64 decoded into the cache)."""
    row, image_dir = FLAT[fmt]
    got = {}
    for container in ("jsonl", "parquet", "tsv"):
        folder = tmp_path / container
        if image_dir:
            (folder / image_dir).mkdir(parents=True)
            (folder / image_dir / "n1.png").write_bytes(png((7, 7, 7)))
        f = write_container(folder, row, container)
        code, rows, err = check(f, "--format", fmt)
        assert code == 0, (container, err)
        (out,) = rows
        assert Path(out["image"]).is_absolute()
        got[container] = {**out, "image": Path(out["image"]).read_bytes()}
    assert got["jsonl"] == got["parquet"] == got["tsv"]
    want = {"livevqa": ("lv1", ["Jane Doe"], "politics"),
            "mat-search": ("7", ["United States"], None),
            "simplevqa": ("0", ["Paris"], "geography")}[fmt]
    r = got["tsv"]
    assert (r["id"], r["answer"], r["category"]) == want
    assert r["benchmark"] == fmt and r["image"] == png((7, 7, 7)) and r["choices"] is None


# ----------------------------------------------------------------------- MME-RealWorld


def test_mme_realworld_lite_options_as_a_python_list_literal(tmp_path, pa):
    opts = "['(A) 1', '(B) 2', '(C) 3', '(D) 4', \"(E) The image doesn't show it\"]"
    f = write_parquet(tmp_path / "MME-RealWorld-lite" / "data" / "train-00000-of-00001.parquet",
                      [{"index": 7, "question": "How many cars?", "multi-choice options": opts,
                        "answer": "E", "category": "Perception/Monitoring",
                        "l2-category": "counting", "bytes": b64()},
                       {"index": 8, "question": "Colour?",
                        "multi-choice options": "['(A) red', '(B) blue']", "answer": "B",
                        "category": "Reasoning/Remote Sensing", "l2-category": "color",
                        "bytes": b64((9, 9, 9))}])
    assert detect_format(f) == "mme-realworld"
    code, rows, err = check(f.parent.parent)
    assert code == 0, err
    assert rows[0]["choices"] == ["1", "2", "3", "4", "The image doesn't show it"]
    assert rows[0]["answer"] == ["E"] and rows[1]["choices"] == ["red", "blue"]
    assert rows[0]["question"].endswith("E. The image doesn't show it\nAnswer with the "
                                        "option's letter.")
    assert "2 multiple-choice" in err and "split train" in err


def test_mme_realworld_options_never_evaluated(tmp_path, pa):
    f = write_parquet(tmp_path / "mme.parquet", [
        {"index": 1, "question": "Q?", "multi-choice options": "__import__('os').getcwd()",
         "answer": "A", "category": "c", "bytes": b64()}])
    with pytest.raises(BadInput, match=r"mme\.parquet: row 1: multi-choice options: not a list "
                                       r"literal"):
        load(f, tmp_path, fmt="mme-realworld")


# VLMEvalKit's own MME-RealWorld files, written here as its code writes them:
# `MMERealWorld.load_data.generate_tsv` (pandas `to_csv(sep="\t", index=False)`: quoted only
# where a cell holds a tab, a quote or a newline) from the release's JSON items, and
# `vlmeval.tools.LOCALIZE` (`localize_df` then `dump`: every cell quoted, `image` dropped and
# an absolute `image_path` appended, the images decoded to `LMUData/images/NAME/INDEX.jpg`).
MME_ITEMS = [
    {"index": 7, "question": "How many cars are in the lot?",
     "multi-choice options": ["(A) 1", "(B) 2", "(C) 3", "(D) 4",
                              "(E) The image doesn't show \"cars\""],
     "answer": "E", "category": "Perception/Monitoring", "l2-category": "counting"},
    {"index": 8, "question": "What colour is the roof?\nLook at the left building.",
     "multi-choice options": ["(A) red", "(B) blue", "(C) green", "(D) grey", "(E) white"],
     "answer": "B", "category": "Reasoning/Remote Sensing", "l2-category": "color"},
]


def vlmevalkit_rows(items: list[dict], choice_prompt: str = "The choices are listed "
                    "below:\n") -> list[dict]:
    """generate_tsv's rows: the text column, and A-E as each option's `[4:]`."""
    return [{"index": it["index"], "image": b64((it["index"], 0, 0)),
             "question": it["question"],
             "multi-choice options": choice_prompt + "\n".join(it["multi-choice options"]),
             **{c: it["multi-choice options"][i][4:] for i, c in enumerate("ABCDE")},
             "answer": it["answer"], "category": it["category"],
             "l2-category": it["l2-category"]} for it in items]


def write_vlmevalkit_tsv(path: Path, rows: list[dict], quote_all: bool = False) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8", newline="") as fh:
        w = csv.DictWriter(fh, list(rows[0]), delimiter="\t", lineterminator="\n",
                           quoting=csv.QUOTE_ALL if quote_all else csv.QUOTE_MINIMAL)
        w.writeheader()
        w.writerows(rows)
    return path


def localize(rows: list[dict], root: Path) -> list[dict]:
    """LOCALIZE: each image decoded to ROOT/INDEX.jpg, `image` replaced by `image_path`."""
    from PIL import Image

    root.mkdir(parents=True, exist_ok=True)
    out = []
    for r in rows:
        p = root / f"{r['index']}.jpg"
        Image.open(io.BytesIO(base64.b64decode(r["image"]))).convert("RGB").save(p)
        out.append({**{k: v for k, v in r.items() if k != "image"}, "image_path": str(p)})
    return out


def test_mme_realworld_vlmevalkit_generate_tsv_reads_the_lettered_columns(tmp_path, pa):
    f = write_vlmevalkit_tsv(tmp_path / "MME-RealWorld.tsv", vlmevalkit_rows(MME_ITEMS))
    assert detect_format(f) == "mme-realworld"
    code, rows, err = check(f)
    assert code == 0, err
    assert rows[0]["choices"] == ["1", "2", "3", "4", "The image doesn't show \"cars\""]
    assert [r["answer"] for r in rows] == [["E"], ["B"]]
    assert rows[1]["category"] == "Reasoning/Remote Sensing"
    # the same items in the Hugging Face lite file's list-literal form: the same prompts
    hf = write_parquet(tmp_path / "lite" / "mme_realworld_lite.parquet", [
        {**{k: v for k, v in it.items() if k != "multi-choice options"},
         "multi-choice options": repr(it["multi-choice options"]),
         "bytes": b64((it["index"], 0, 0))} for it in MME_ITEMS])
    code, hf_rows, err = check(hf)
    assert code == 0, err
    for a, b in zip(rows, hf_rows):
        assert (a["question"], a["choices"], a["answer"]) == (b["question"], b["choices"],
                                                              b["answer"])
    got = load(f, tmp_path)
    assert got.prompts[0][1].extra["l2-category"] == "counting"


def test_mme_realworld_cn_text_column_without_letter_columns(tmp_path):
    rows = [{k: v for k, v in r.items() if k not in "ABCDE"}
            for r in vlmevalkit_rows(MME_ITEMS, "选项如下所示:\n")]
    f = write_vlmevalkit_tsv(tmp_path / "MME-RealWorld-CN.tsv", rows)
    got = load(f, tmp_path)
    p = got.prompts[1][1]
    assert p.choices == ["red", "blue", "green", "grey", "white"] and p.answer == ["B"]


def test_mme_realworld_localize_image_path_absolute_and_relative(tmp_path):
    images = tmp_path / "LMUData" / "images" / "MME-RealWorld"
    rows = localize(vlmevalkit_rows(MME_ITEMS), images)
    rows[1]["image_path"] = "images/8.jpg"  # a relative path: against the TSV's folder
    (tmp_path / "data" / "images").mkdir(parents=True)
    (images / "8.jpg").rename(tmp_path / "data" / "images" / "8.jpg")
    f = write_vlmevalkit_tsv(tmp_path / "data" / "MME-RealWorld_local.tsv", rows,
                             quote_all=True)
    assert detect_format(f) == "mme-realworld"
    code, got, err = check(f)
    assert code == 0, err
    assert got[0]["image"] == str(images / "7.jpg")
    assert got[1]["image"] == str(tmp_path / "data" / "images" / "8.jpg")
    assert got[0]["choices"][4] == "The image doesn't show \"cars\""
    (images / "7.jpg").unlink()
    line = one_line_error(*invoke(["eval", str(f), "--check"]))
    assert "MME-RealWorld_local.tsv:2: image_path: no such file" in line, line
    with pytest.raises(BadInput, match="no such file " + str(images / "7.jpg")):
        load(f, tmp_path)  # the path as the row gives it, not where it was last looked for


@pytest.mark.parametrize("change, field", [
    ({"C": ""}, "C"),  # a gap: D and E would be relabelled C and D
    ({"multi-choice options": "The choices are listed below:\n(A) 1\n(B) 2"},
     "multi-choice options"),  # the text lists 2 options, the columns 5
    ({"A": "", "B": "", "C": "", "D": "", "E": "", "multi-choice options": "Pick one"},
     "multi-choice options"),
    ({"answer": "F"}, "answer"),
])
def test_mme_realworld_vlmevalkit_bad_row_is_one_line(tmp_path, change, field):
    rows = vlmevalkit_rows(MME_ITEMS)
    rows[1].update(change)
    f = write_vlmevalkit_tsv(tmp_path / "MME-RealWorld.tsv", rows)
    line = one_line_error(*invoke(["eval", str(f), "--check"]))
    # row 1 spans lines 2-7 (its text column holds five newlines): row 2 starts on line 8
    assert f"MME-RealWorld.tsv:{2 + 6}: {field}:" in line, line


# ----------------------------------------------------------------------- InfoSeek / OVEN


def test_infoseek_oven_images_sharded_by_id(tmp_path):
    oven = tmp_path / "oven_images"
    (oven / "01").mkdir(parents=True)
    (oven / "01" / "oven_01963180.JPEG").write_bytes(png())
    (oven / "05").mkdir()
    (oven / "05" / "oven_05050169.png").write_bytes(png((0, 0, 9)))
    f = write_jsonl(tmp_path / "infoseek" / "infoseek_val.jsonl", [
        {"data_id": "val_1", "image_id": "oven_01963180", "question": "Who built it?",
         "answer": ["Eiffel"], "answer_eval": ["Eiffel"], "data_split": "val_unseen_entity"},
        {"data_id": "val_2", "image_id": "oven_05050169", "question": "How tall?",
         "answer": ["300"], "answer_eval": [{"wikidata": 300.0, "range": [270.0, 330.0]}],
         "data_split": "val_unseen_question"}])
    code, rows, err = check(f, "--image-dir", str(oven))
    assert code == 0, err
    assert rows[0]["image"] == str(oven / "01" / "oven_01963180.JPEG")
    assert rows[1]["image"] == str(oven / "05" / "oven_05050169.png")
    line = one_line_error(*invoke(["eval", str(f), "--check"]))  # no --image-dir: not found
    assert "infoseek_val.jsonl:1: image:" in line


def test_infoseek_oven_images_beside_the_file_need_no_image_dir(tmp_path):
    """The release's layout: `oven_images/NN/` in the file's own folder is looked in by
    default, extension unknown (.jpg here, .JPEG beside it for another id)."""
    root = tmp_path / "infoseek"
    (root / "oven_images" / "01").mkdir(parents=True)
    (root / "oven_images" / "01" / "oven_01963180.jpg").write_bytes(png())
    (root / "oven_images" / "01" / "oven_01000001.JPEG").write_bytes(png((1, 2, 3)))
    write_jsonl(root / "infoseek_val.jsonl", [
        {"data_id": "val_1", "image_id": "oven_01963180", "question": "Who built it?",
         "answer": ["Eiffel"], "answer_eval": ["Eiffel"], "data_split": "val_unseen_entity"},
        {"data_id": "val_2", "image_id": "oven_01000001", "question": "Who built it?",
         "answer": ["Eiffel"], "answer_eval": ["Eiffel"], "data_split": "val_unseen_entity"}])
    code, rows, err = check(root)
    assert code == 0, err
    assert [r["image"] for r in rows] == [
        str((root / "oven_images" / "01" / "oven_01963180.jpg").resolve()),
        str((root / "oven_images" / "01" / "oven_01000001.JPEG").resolve())]
    assert rows[0]["benchmark"] == "infoseek" and "check: infoseek (infoseek format" in err


# ----------------------------------------------------------------------- FVQA splits


def fvqa_row(i: int, split: str) -> dict:
    return {"data_source": "fvqa", "prompt": [{"role": "user", "content": f"<image>Q{i}?"}],
            "images": [{"bytes": png((i, i, i)), "path": None}],
            "reward_model": {"ground_truth": [f"{split}{i}"], "style": "rule"},
            "extra_info": {"index": f"{split}-{i}"}}


def test_fvqa_folder_reads_the_test_split_unless_told(tmp_path, pa):
    root = tmp_path / "FVQA"
    write_parquet(root / "fvqa_train.parquet", [fvqa_row(i, "train") for i in range(3)])
    write_parquet(root / "fvqa_test.parquet", [fvqa_row(i, "test") for i in range(2)])
    assert detect_format(root) == "fvqa"
    code, rows, err = check(root)
    assert code == 0, err
    assert [r["id"] for r in rows] == ["test-0", "test-1"]  # never mixed with train
    assert all(r["split"] == "test" for r in rows) and "split test" in err
    code, rows, err = check(root, "--split", "train")
    assert [r["id"] for r in rows] == ["train-0", "train-1", "train-2"]
    line = one_line_error(*invoke(["eval", str(root), "--check", "--split", "dev"]))
    assert "no dev split here (splits: test, train)" in line


def test_fvqa_eval_run_on_the_folder_evaluates_the_test_split(tmp_path, pa, tiny_model):
    """A real eval (the replay engine) on the train + test folder: only test rows are
    generated, every record says `split: test`, so does the summary, and stderr names it."""
    root = tmp_path / "FVQA"
    reply = "<thinking>Known.</thinking><answer>test0</answer>"
    write_parquet(root / "fvqa_train.parquet",
                  [{**fvqa_row(i, "train"), "replies": [reply]} for i in range(3)])
    write_parquet(root / "fvqa_test.parquet",
                  [{**fvqa_row(i, "test"), "replies": [reply]} for i in range(2)])
    out = tmp_path / "run" / "fvqa.jsonl"
    code, _, err = invoke(["eval", str(root), "--policy", str(tiny_model), "--engine",
                           "replay", "-o", str(out)])
    assert code == 0, err
    assert "eval: fvqa (fvqa format, test split): 2 rows" in err
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(r["prompt_id"] for r in recs) == ["test-0", "test-1"]
    assert all(r["split"] == "test" for r in recs)
    summ = json.loads(out.with_name("fvqa.summary.json").read_text())
    assert summ["benchmarks"]["fvqa"]["split"] == "test"
    assert summ["benchmarks"]["fvqa"]["accuracy"] == 50.0  # test0 right, test1 wrong


# ----------------------------------------------------------------------- lmms-lab parquet


def test_vstar_lmms_lab_parquet(tmp_path, pa, cache):
    root = tmp_path / "vstar-bench"
    write_parquet(root / "data" / "test-00000-of-00001.parquet", [
        {"question_id": 0, "image": {"bytes": png(), "path": "sa_1.jpg"},
         "text": "What is the color of the cup?\n(A) red\n(B) blue\n(C) green\n(D) white",
         "label": "C", "category": "direct_attributes"},
        {"question_id": 1, "image": {"bytes": png((1, 1, 1)), "path": "sa_2.jpg"},
         "text": "Is the cat left of the dog? (A) yes (B) no", "label": "A",
         "category": "relative_position"}])
    assert detect_format(root) == "vstar"
    code, rows, err = check(root, "--format", "vstar")
    assert code == 0, err
    r0, r1 = rows
    assert (r0["id"], r0["choices"], r0["answer"]) == ("0", ["red", "blue", "green", "white"],
                                                       ["C"])
    assert r0["question"] == ("What is the color of the cup?\nOptions:\nA. red\nB. blue\n"
                              "C. green\nD. white\nAnswer with the option's letter.")
    assert (r1["choices"], r1["category"]) == (["yes", "no"], "relative_position")
    assert Path(r1["image"]).parent == cache
    assert Path(r1["image"]).read_bytes() == png((1, 1, 1))
    assert {r["benchmark"] for r in rows} == {"vstar"} and {r["split"] for r in rows} == {"test"}
    assert "check: vstar (vstar format, split test): 2 rows, 2 kept" in err
    assert "2 multiple-choice" in err


def test_hrbench_parquet_config_splits(tmp_path, pa, cache):
    root = tmp_path / "HR-Bench" / "hrbench_version_split"
    row = {"index": 0, "question": "What is on the sign?", "A": "cat", "B": "dog", "C": "cow",
           "D": "pig", "answer": "B", "category": "single", "image": b64(),
           "cycle_category": "cycle1"}
    write_parquet(root / "hrbench_4k-00000-of-00001.parquet", [row])
    write_parquet(root / "hrbench_8k-00000-of-00001.parquet", [{**row, "index": 1}])
    assert detect_format(root / "hrbench_4k-00000-of-00001.parquet") == "hrbench"
    code, rows, err = check(root.parent, "--split", "hrbench_8k")
    assert code == 0, err
    (r,) = rows
    img = Path(r.pop("image"))
    assert r == {"v": 1, "id": "1", "question": "What is on the sign?\nOptions:\nA. cat\n"
                 "B. dog\nC. cow\nD. pig\nAnswer with the option's letter.", "answer": ["B"],
                 "choices": ["cat", "dog", "cow", "pig"], "category": "single",
                 "benchmark": "hrbench-8k", "split": "hrbench_8k"}
    assert img.parent == cache and img.read_bytes() == png((10, 20, 30))  # b64()'s colour
    assert "check: hrbench-8k (hrbench format, split hrbench_8k)" in err
    line = one_line_error(*invoke(["eval", str(root.parent), "--check"]))
    assert "no test split here (splits: hrbench_4k, hrbench_8k)" in line


# ----------------------------------------------------------------------- MARS training rows


def test_mars_rows_take_their_index_and_choices(tmp_path):
    root = tmp_path / "mars"
    root.mkdir()
    (root / "a.png").write_bytes(png())
    row = {"prompt": [{"role": "user", "content": "<image>Which animal?\n(A) cat\n(B) dog"}],
           "image": ["a.png"], "reward_model": {"ground_truth": "B"}, "index": 41,
           "extra_info": {"index": 3}}
    open_q = {**row, "reward_model": {"ground_truth": "Paris"}, "extra_info": {"index": 4}}
    open_q.pop("index")
    f = write_jsonl(root / "train.jsonl", [row, open_q])
    code, rows, err = check(f, "--format", "mars")
    assert code == 0, err
    mcq, open_row = rows
    assert (mcq["id"], mcq["choices"], mcq["answer"]) == ("41", ["cat", "dog"], ["B"])
    assert mcq["image"] == str(root / "a.png") and mcq["split"] == "train"
    assert mcq["question"] == "Which animal?\n(A) cat\n(B) dog"  # as the release wrote it
    # an open question's gold is not a letter: no choices; the id from extra_info.index
    assert (open_row["id"], open_row["choices"], open_row["answer"]) == ("4", None, ["Paris"])
    assert "check: mars (mars format, split train): 2 rows, 2 kept" in err
    assert "1 multiple-choice" in err


# ----------------------------------------------------------------------- which checkpoint


def summary(path: Path, benches: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps({"v": 1, "benchmarks": {
        name: {"accuracy": acc, "scored_items": n, "items": n, "metric": "accuracy"}
        for name, (acc, n) in benches.items()}}))
    return path


def test_wilson_against_hand_computed_values():
    # p = 0.5, n = 100: centre 0.5, half-width 1.96*sqrt(0.0025 + 3.8416/40000)/1.038416 = 0.096170
    lo, hi = wilson(0.5, 100)
    assert lo == pytest.approx(0.403830, abs=1e-6) and hi == pytest.approx(0.596170, abs=1e-6)
    lo, hi = wilson(0.0, 10)  # 0 of 10: [0, z²/(n+z²)] = [0, 3.8416/13.8416]
    assert lo == 0 and hi == pytest.approx(0.277540, abs=1e-6)


def test_summarize_run_table_and_best_checkpoint(tmp_path):
    run = tmp_path / "run"
    summary(run / "eval" / "ckpt-0.summary.json", {"vstar": (50.0, 100), "mmsearch": (0.0, 10)})
    summary(run / "eval" / "ckpt-2.summary.json", {"vstar": (80.0, 100), "mmsearch": (10.0, 10)})
    summary(run / "eval" / "ckpt-10.summary.json", {"vstar": (70.0, 100), "mmsearch": (30.0, 10)})
    doc = compare([run / "eval" / f"ckpt-{k}.summary.json" for k in (0, 2, 10)])
    c0 = doc["checkpoints"][0]
    assert c0["benchmarks"]["vstar"]["ci95"] == pytest.approx((40.3830, 59.6170), abs=1e-3)
    # mean of 50 and 0; half-width 1.96*sqrt(s1² + s2²)/2 with s = Wilson half-width / 1.96
    s1, s2 = (59.6170 - 40.3830) / 2 / 1.96, 27.7540 / 2 / 1.96
    half = 1.96 * (s1 ** 2 + s2 ** 2) ** 0.5 / 2
    assert c0["mean"]["accuracy"] == 25.0
    assert c0["mean"]["ci95"] == pytest.approx((25 - half, 25 + half), abs=1e-3)
    # means 25, 45, 50: ckpt-10, whose interval overlaps the runner-up ckpt-2's
    assert doc["best"] == "ckpt-10" and doc["by"] == "mean" and doc["runner_up"] == "ckpt-2"
    assert doc["separated"] is False
    assert compare(sorted((run / "eval").glob("*.json")), by="mmsearch")["best"] == "ckpt-10"
    code, out, err = invoke(["eval", "summarize", str(run), "--by", "vstar", "--json"])
    assert code == 0, err
    got = json.loads(out)
    assert [c["checkpoint"] for c in got["checkpoints"]] == ["ckpt-0", "ckpt-2", "ckpt-10"]
    assert got["best"] == "ckpt-2" and "best: ckpt-2 by vstar: 80.00" in err
    assert "ckpt-2 *" in err and "not separated at 95%" in err
    code, out, err = invoke(["eval", "summarize", str(run), "--by", "nope"])
    assert code == 2 and "--by 'nope': no such benchmark" in err
