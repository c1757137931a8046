"""fp32 training state by HF parameter name, one file per rank, read back by slice.

Each rank writes the part of every parameter it holds (DeepSpeed's fp32 partition, or the
whole parameter where nothing is partitioned) as a flat fp32 slice: key NAME in
`master-rank-RRRRR-of-NNNNN.safetensors`, `exp_avg/NAME` and `exp_avg_sq/NAME` in
`moments-rank-RRRRR-of-NNNNN.safetensors`. Rank 0 then writes `shards.json`, built from the
files' headers (the metadata each rank wrote: name → [start, end) of the flattened parameter
and its shape):

    {"v": 1, "world": N, "kinds": ["master", "moments"],
     "params": {NAME: {"shape": [...], "trainable": true, "pieces": [[rank, start, end], ...]}}}

A reader (`FlatReader`) answers `read(name, start, end)` with the flat range of a parameter
from whichever pieces overlap it, through `safe_open(...).get_slice`, so a rank of another
launch reads only what its own partition needs: N ranks write, M ranks read. The same reader
serves whole tensors (the single `master.safetensors` of earlier versions, an HF export),
reading only the rows that cover the range. Importing this module is cheap.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from marscli.errors import BadInput

INDEX = "shards.json"
KINDS = ("master", "moments")
MOMENTS = ("exp_avg", "exp_avg_sq")
_META = "marscli.pieces"  # safetensors metadata key: JSON {name: [start, end, shape]}


def rank_file(kind: str, rank: int, world: int) -> str:
    return f"{kind}-rank-{rank:05d}-of-{world:05d}.safetensors"


# ------------------------------------------------------------------------------ writing


@dataclass
class Piece:
    """This rank's slice [start, end) of a flattened parameter of `shape`."""

    start: int
    end: int
    shape: list[int]
    trainable: bool


def write_rank_file(path: Path, tensors: dict[str, Any], pieces: dict[str, Piece]) -> None:
    """One rank's flat fp32 slices (`tensors` by key) as a safetensors file, with the pieces
    they are in the header's metadata. Written tensor by tensor (the format is an 8-byte header
    length, the JSON header, then the data): safetensors' own `save_file` first copies every
    tensor into one buffer, which would double the rank's share while it saves."""
    import torch

    meta = {n: [p.start, p.end, p.shape, p.trainable] for n, p in pieces.items()}
    header: dict[str, Any] = {"__metadata__": {"format": "pt", _META: json.dumps(meta)}}
    at = 0
    for k, v in tensors.items():
        header[k] = {"dtype": "F32", "shape": [v.numel()], "data_offsets": [at, at + 4 * v.numel()]}
        at += 4 * v.numel()
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for v in tensors.values():  # one tensor on the host at a time (a GPU slice is copied)
            f.write(v.detach().reshape(-1).to("cpu", torch.float32).contiguous().numpy().data)


def write_index(state: Path, world: int, kinds: list[str]) -> dict:
    """`shards.json` from the rank files' headers (rank 0, after every rank wrote). A
    parameter's pieces must cover it exactly, or the save is refused (a bug, not bad input)."""
    params: dict[str, dict] = {}
    for r in range(world):
        for name, (start, end, shape, trainable) in _pieces_of(state / rank_file(kinds[0], r,
                                                                                 world)).items():
            e = params.setdefault(name, {"shape": shape, "trainable": trainable, "pieces": []})
            e["pieces"].append([r, start, end])
    for name, e in params.items():
        gap = _gap(e["pieces"], math.prod(e["shape"]))
        if gap is not None:
            raise RuntimeError(f"{state}: the ranks' slices of {name} leave {gap} uncovered")
    index = {"v": 1, "world": world, "kinds": kinds, "params": params}
    (state / INDEX).write_text(json.dumps(index) + "\n")
    return index


def _pieces_of(path: Path) -> dict[str, list]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return json.loads((f.metadata() or {}).get(_META, "{}"))


def _gap(pieces: list[list[int]], numel: int) -> str | None:
    """The first range of [0, numel) the pieces leave uncovered or cover twice, or None."""
    at = 0
    for _, start, end in sorted(pieces, key=lambda p: p[1]):
        if start != at:
            return f"[{at}, {start})" if start > at else f"[{start}, {at}) twice"
        at = end
    return None if at == numel else f"[{at}, {numel})"


# ------------------------------------------------------------------------------ reading


def read_index(state: Path) -> dict:
    """`shards.json`, checked: parsable, its rank files present, each parameter covered."""
    f = state / INDEX
    fix = f"delete {state} to train from the HF weights with a fresh optimiser"
    try:
        index = json.loads(f.read_text())
        world, kinds, params = int(index["world"]), list(index["kinds"]), dict(index["params"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BadInput(f"{f}: not a readable shard index ({type(e).__name__}: {e}) — "
                       f"{fix}") from None
    for kind in kinds:
        for r in range(world):
            if not (state / rank_file(kind, r, world)).is_file():
                raise BadInput(f"{state / rank_file(kind, r, world)}: missing (written by rank "
                               f"{r} of {world}) — restore it, or {fix}")
    for name, e in params.items():
        gap = _gap(e["pieces"], math.prod(e["shape"]))
        if gap is not None:
            raise BadInput(f"{f}: {name}: the slices leave {gap} uncovered — {fix}")
    return index


@dataclass
class _Stored:
    """Where a range of a flattened parameter lies: the file, its key, the range it holds."""

    path: Path
    key: str
    start: int
    end: int


class FlatReader:
    """Flat ranges of parameters, by name, from sharded or whole-tensor safetensors files."""

    def __init__(self) -> None:
        self.where: dict[str, list[_Stored]] = {}  # key → its pieces
        self.shapes: dict[str, list[int]] = {}
        self.dtypes: dict[str, str] = {}

    @staticmethod
    @contextmanager
    def _file(path: Path) -> Iterator[Any]:
        """The file, memory-mapped only while in use: pages a mapping has touched count in the
        process's resident memory until it is closed (keeping every file open made a rank's
        peak RSS grow by all the bytes it read)."""
        from safetensors import SafetensorError, safe_open

        try:
            f = safe_open(str(path), "pt")
        except (SafetensorError, OSError) as e:
            raise BadInput(f"{path}: not a readable safetensors file ({e}) — restore it, "
                           f"or delete {path.parent} to start from the HF weights") from None
        with f:
            yield f

    def add_shards(self, state: Path, index: dict, kind: str, keys: Iterable[str] = ("",)
                   ) -> None:
        """The pieces of `kind` files of a `shards.json` index; `keys` are the prefixes of
        the names inside ("" for masters, "exp_avg/" ... for moments)."""
        world = index["world"]
        for name, e in index["params"].items():
            if kind == "moments" and not e.get("trainable", True):
                continue
            self.shapes[name] = list(e["shape"])
            for prefix in keys:
                self.where[prefix + name] = [
                    _Stored(state / rank_file(kind, r, world), prefix + name, s, t)
                    for r, s, t in e["pieces"]]
                self.dtypes[prefix + name] = "F32"

    def add_whole(self, paths: list[Path]) -> None:
        """Whole tensors (an HF export, the single master file of earlier versions)."""
        for p in paths:
            with self._file(p) as f:
                for k in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                    sl = f.get_slice(k)
                    shape = list(sl.get_shape())
                    self.shapes[k], self.dtypes[k] = shape, sl.get_dtype()
                    self.where[k] = [_Stored(p, k, 0, math.prod(shape))]

    def read(self, key: str, start: int = 0, end: int | None = None) -> Any:
        """Elements [start, end) of the flattened tensor `key` (1-D, its stored dtype), or
        None if no file holds it."""
        import torch

        pieces = self.where.get(key)
        if pieces is None:
            return None
        end = math.prod(self.shapes[key.rsplit("/", 1)[-1]]) if end is None else end
        parts = []
        for s in pieces:
            lo, hi = max(start, s.start), min(end, s.end)
            if lo < hi:
                parts.append(self._range(s, lo - s.start, hi - s.start))
        if not parts:
            return torch.empty(0)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _range(self, s: _Stored, a: int, b: int) -> Any:
        """Elements [a, b) of a stored tensor flattened (a copy): the rows that cover them
        only."""
        with self._file(s.path) as f:
            try:
                sl = f.get_slice(s.key)
            except Exception as e:  # a key the index promised is not there
                raise BadInput(f"{s.path}: {s.key}: not readable ({type(e).__name__}: {e}) — "
                               f"the file does not match {INDEX}; delete {s.path.parent} to "
                               "start from the HF weights") from None
            shape = list(sl.get_shape())
            if len(shape) <= 1:
                return sl[a:b].clone()
            row = math.prod(shape[1:])
            r0, r1 = a // row, -(-b // row)
            return sl[r0:r1].reshape(-1)[a - r0 * row:b - r0 * row].clone()

    def full(self, name: str) -> Any:
        """The whole tensor `name` in its shape, or None."""
        v = self.read(name)
        return None if v is None else v.view(self.shapes[name])


@contextmanager
def open_reader() -> Iterator[FlatReader]:
    yield FlatReader()
