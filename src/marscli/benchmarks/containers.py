"""The containers a benchmark comes in, read the same way whatever the layout inside: JSONL,
a JSON array, parquet, TSV, or a folder of them.

- `data_files(path, split)`: the files of BENCH. A file is itself. A folder gives its data
  files (the first of `*.parquet`, `data/*.parquet`, `CONFIG/*.parquet`, `*.tsv`, `*.jsonl`,
  `*.json` to match); when their names carry several splits (`fvqa_train.parquet` +
  `fvqa_test.parquet`; `datasets`' `SPLIT-00000-of-00001.parquet` shards, HR-Bench's
  `hrbench_4k-...` and `hrbench_8k-...`), one split is chosen, never mixed: `--split`, else
  `test` (a folder whose files all name one split gives that one). The split
  chosen (None when the names carry none) goes with the rows into the summary.
- `iter_file(file)`: `(n, row)` per row, every row a dict; `unit_of(file)` says what `n`
  counts: `line` for JSONL and TSV (a TSV row's first line), `row` for parquet rows and the
  objects of a JSON array (1-based). `where(file, n, unit)` is how errors name a row. A
  byte that is not UTF-8 is refused naming its line (and, in a TSV, its column).
- `columns_of(file)`: the column names (parquet schema, TSV header, the first JSON row's keys),
  for format detection.

pyarrow (the `eval` extra) is imported only when a parquet file is read.
"""

from __future__ import annotations

import csv
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import orjson

from marscli.benchmarks.common import clip
from marscli.errors import BadInput
from marscli.records.jsonl import iter_rows

_SURROGATE = re.compile("[\udc80-\udcff]")  # a byte that is not UTF-8, as surrogateescape keeps it
BATCH_ROWS = 16  # parquet rows decoded at a time (HR-MMSearch is 2 GB of images)
SPLITS = ("train", "test", "validation", "val", "dev")
_SPLIT_RE = re.compile(r"(?:^|[_\-.])(train|test|validation|val|dev)(?=$|[_\-.])")
_HF_SHARD = re.compile(r"(.+?)-\d{5}-of-\d{5}")
_PATTERNS = ("*.parquet", "data/*.parquet", "*/*.parquet", "*.tsv", "*.jsonl", "*.json")
# files beside the data that are not rows: InfoSeek's qtype file, marscli's own sidecars
_NOT_DATA = re.compile(r"qtype|\.settings\.json$|\.summary\.json$|\.meta\.json$|"
                       r"dataset_info|image_search_results", re.I)


def split_of(file: Path) -> str | None:
    """The split a data file's name carries (`fvqa_test.parquet`, `test-00000-of-00001`),
    `validation` read as `val`; None when it carries none."""
    stem = file.stem.lower()
    shard = _HF_SHARD.fullmatch(stem)  # `datasets`' own names: SPLIT-00000-of-00002
    m = _SPLIT_RE.search(stem) if shard is None else None
    split = shard[1] if shard else m[1] if m else None
    return {"validation": "val"}.get(split, split) if split else None


def data_files(path: Path, split: str | None = None,
               patterns: tuple[str, ...] = _PATTERNS) -> tuple[list[Path], str | None]:
    """BENCH's data files and the split they hold (module docstring)."""
    if split is not None:
        split = {"validation": "val"}.get(split, split)
    if not path.is_dir():
        have = split_of(path)
        if split is not None and have is not None and have != split:
            raise BadInput(f"--split {split}: {path} holds the {have} split — point at the "
                           f"{split} file, or drop --split")
        return [path], have
    files: list[Path] = []
    for pattern in patterns:
        files = [f for f in sorted(path.glob(pattern)) if not _NOT_DATA.search(f.name)]
        if files:
            break
    if not files:
        raise BadInput(f"{path}: no data files in this folder (looked for "
                       f"{', '.join(patterns)})")
    by_split: dict[str | None, list[Path]] = {}
    for f in files:
        by_split.setdefault(split_of(f), []).append(f)
    named = sorted(k for k in by_split if k is not None)
    if not named:
        if split is not None:
            raise BadInput(f"--split {split}: the files in {path} carry no split names — "
                           "drop --split")
        return files, None
    # one split only (HR-MMSearch publishes its test set as `train-*`): that one
    want = split or (named[0] if len(by_split) == 1 else "test")
    if want not in by_split:
        raise BadInput(f"{path}: no {want} split here (splits: {', '.join(named)}) — choose "
                       f"one with --split")
    return by_split[want], want


def unit_of(file: Path) -> str:
    return "row" if file.suffix.lower() == ".parquet" or _is_json_array(file) else "line"


def where(file: Path | str, n: int, unit: str) -> str:
    """How an error names a row: `FILE:LINE`, or `FILE: row N`."""
    return f"{file}:{n}" if unit == "line" else f"{file}: {unit} {n}"


def iter_file(file: Path, columns: list[str] | None = None) -> Iterator[tuple[int, dict]]:
    """Every row of one data file as `(n, dict)` (`columns`: parquet columns to read)."""
    suffix = file.suffix.lower()
    if suffix == ".parquet":
        yield from enumerate(iter_parquet(file, columns), start=1)
    elif suffix in (".tsv", ".csv"):
        yield from iter_tsv(file)
    elif _is_json_array(file):
        yield from enumerate(_json_array(file), start=1)
    else:
        yield from iter_rows(str(file))


def columns_of(file: Path) -> list[str]:
    suffix = file.suffix.lower()
    if suffix == ".parquet":
        return parquet_columns(file)
    if suffix in (".tsv", ".csv"):
        with file.open(encoding="utf-8", errors="replace") as fh:
            head = fh.readline(1 << 16).rstrip("\r\n")
        # unquoted as the rows are: VLMEvalKit's `dump` (LOCALIZE) quotes every header name
        return next(csv.reader([head], delimiter="\t"), [])
    for _, row in iter_file(file):
        return list(row)
    raise BadInput(f"{file}: empty file — expected at least one row")


# ----------------------------------------------------------------------------- JSON arrays


def _is_json_array(file: Path) -> bool:
    if file.suffix.lower() != ".json":
        return False
    with file.open("rb") as fh:
        head = fh.read(4096).lstrip()
    return head.startswith(b"[")


def _json_array(file: Path) -> list[dict]:
    data = file.read_bytes()
    try:
        rows = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        _refuse_non_utf8(file, data)
        raise BadInput(f"{file}: not valid JSON ({clip(str(e))})") from None
    if not isinstance(rows, list):
        raise BadInput(f"{file}: expected a JSON array of objects")
    for n, row in enumerate(rows, start=1):
        if not isinstance(row, dict):
            raise BadInput(f"{file}: row {n}: expected a JSON object, got "
                           f"{type(row).__name__}")
    return rows


def _refuse_non_utf8(file: Path, data: bytes) -> None:
    """Name the line of the first byte that is not UTF-8 (orjson says only that one is)."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise BadInput(f"{file}:{line}: not valid UTF-8 (byte 0x{data[e.start]:02x}) — save "
                       "the file as UTF-8") from None


# ----------------------------------------------------------------------------- TSV


def iter_tsv(file: Path) -> Iterator[tuple[int, dict]]:
    """VLMEvalKit TSV rows (pandas `to_csv(sep="\\t")`: quoted where a cell holds a tab or a
    newline) with the line each starts on."""
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))  # base64 images are tens of MB
    # surrogateescape: a byte that is not UTF-8 is kept as a lone surrogate, so the row and
    # the cell holding it can be named instead of the decoder's chunk offset
    with file.open(encoding="utf-8", errors="surrogateescape", newline="") as fh:
        reader = csv.DictReader(fh, delimiter="\t")
        _check_utf8(file, 1, {"header": "\t".join(reader.fieldnames or [])})
        line = 1
        for row in reader:
            start, line = line + 1, reader.line_num
            _check_utf8(file, start, row)
            yield start, row


def _check_utf8(file: Path, line: int, row: dict) -> None:
    """Refuse a TSV row with a byte that is not UTF-8 (a lone surrogate here), naming its
    cell's column."""
    for key, value in row.items():
        for cell in value if isinstance(value, list) else [value]:  # extra cells: a list
            if not isinstance(cell, str) or cell.isascii():
                continue
            bad = _SURROGATE.search(cell)
            if bad:
                raise BadInput(f"{file}:{line}: {clip(key or 'extra cells')}: not valid UTF-8 "
                               f"(byte 0x{ord(bad[0]) - 0xdc00:02x}) — save the file as UTF-8")


# ----------------------------------------------------------------------------- parquet


def _pyarrow():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise BadInput('reading parquet benchmarks needs pyarrow: pip install "marscli[eval]" '
                       "(or pip install pyarrow)") from None
    return pq


def parquet_columns(path: Path) -> list[str]:
    pq = _pyarrow()
    try:
        return list(pq.read_schema(path).names)
    except Exception as e:
        raise BadInput(f"{path}: not a readable parquet file ({type(e).__name__}: "
                       f"{clip(str(e))})") from None


def iter_parquet(path: Path, columns: list[str] | None = None) -> Iterator[dict]:
    pq = _pyarrow()
    try:
        pf = pq.ParquetFile(path)
        for batch in pf.iter_batches(batch_size=BATCH_ROWS, columns=columns):
            yield from batch.to_pylist()
    except Exception as e:
        raise BadInput(f"{path}: cannot read parquet ({type(e).__name__}: "
                       f"{clip(str(e))})") from None
