"""Training batches rebuilt token-exactly from trajectory segments, shared by `update` and `sft`.

- `load_example(row, src, line, base, spec)` validates one trajectory row (segments, images,
  token ids against the policy's vocabulary, placeholder counts against the images) and turns
  it into an `Example`: expanded ids, the loss mask (1 on `model` tokens) and image paths in
  the order their placeholder runs appear. Nothing is decoded here but image headers, so a
  large file validates quickly and holds no pixels in memory.
  Every image whose reference carries `sha256` must still hash to it (each file hashed once
  per process, cached by path, size and mtime), so a changed or overwritten image is refused
  with FILE:LINE rather than trained on.
- `shard(examples, rank, world)` splits a minibatch across data-parallel ranks by sequence,
  balancing tokens; `micro_batches(lengths, max_tokens)` buckets sequences by length so that a
  micro-batch's padded size (longest × count) stays under the token budget; `plan(...)` does
  both and pads every rank to the same number of micro-batches (collectives in ZeRO need it).
- `collate(examples, spec)` right-pads a micro-batch into tensors and runs the image processor;
  the processed pixels of each file are cached (bounded by bytes), since SFT epochs and
  update's old-log-prob and training passes read the same images again.

Position 0 is never trained: no token predicts it, so its loss-mask bit is cleared.
This module imports torch only inside `collate`.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from marscli.errors import BadInput
from marscli.qwen.images import MAX_SOURCE_PIXELS, open_image, placeholder_count
from marscli.qwen.tokens import assemble
from marscli.records.provenance import sha256_file
from marscli.records.schema import parse_image_refs, parse_segments


@dataclass
class Spec:
    """What batch assembly needs to know about the policy."""

    processor: Any  # the policy's processor (images → patches)
    image_pad: int
    pad: int
    vocab_size: int

    @classmethod
    def of(cls, processor: Any, policy: str) -> Spec:
        """Spec from a loaded processor and the checkpoint folder's config.json."""
        from marscli.qwen.tokens import special_ids

        ids = special_ids(processor.tokenizer)
        return cls(processor, ids.image_pad, ids.pad, vocab_size(policy, len(processor.tokenizer)))


def vocab_size(policy: str, fallback: int) -> int:
    """The policy's embedding size (text_config.vocab_size), read without loading weights."""
    cfg_path = Path(policy) / "config.json"
    if not cfg_path.is_file():
        return fallback
    cfg = json.loads(cfg_path.read_text())
    return int(
        (cfg.get("text_config") or {}).get("vocab_size") or cfg.get("vocab_size") or fallback
    )


@dataclass
class Example:
    """One trajectory, ready to batch. Lists, not tensors: cheap to hold by the thousand."""

    src: str
    line: int
    input_ids: list[int]  # expanded (image placeholders spelled out)
    loss_mask: list[int]  # 1 on model tokens, position 0 cleared
    images: list[Path] = field(default_factory=list)  # one per placeholder run, in order
    # the engine's log-prob of each token, aligned to input_ids; None off the model segments
    # and where the engine had none (`"logprobs": null`: replay, openai): absent, never 0
    engine_logprobs: list[float | None] = field(default_factory=list)
    advantage: float = 0.0
    minibatch: int = 0
    index: int = 0  # position in the input file (the key of per-example values, e.g. log-probs)
    extra: dict = field(default_factory=dict)  # stage-specific values

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def n_model_tokens(self) -> int:
        return sum(self.loss_mask)

    def engine_logp(self) -> tuple[list[float], list[bool]]:
        """(values, present) [T]: the engine's log-probs with absent ones as 0.0, and whether
        each model token (loss mask 1) has one."""
        present = [bool(m) and isinstance(lp, (int, float)) and not isinstance(lp, bool)
                   for m, lp in zip(self.loss_mask, self.engine_logprobs)]
        return [float(lp) if p else 0.0 for lp, p in zip(self.engine_logprobs, present)], present


def image_runs(ids: Sequence[int], image_pad: int) -> list[int]:
    """Lengths of the maximal runs of placeholder ids: the model reads each run as one image."""
    runs, n = [], 0
    for t in ids:
        if t == image_pad:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    if n:
        runs.append(n)
    return runs


def load_example(row: dict, src: str, line: int, base: Path, spec: Spec) -> Example:
    """Validate a trajectory row and assemble it; errors read `FILE:LINE: field: ...`."""
    segs = parse_segments(row, src, line)
    seq = assemble(segs, spec.image_pad)
    top = max(seq.input_ids, default=0)
    if top >= spec.vocab_size:
        raise BadInput(f"{src}:{line}: segments: token ids exceed the policy's vocabulary (a "
                       f"different tokenizer?) — id {top} >= vocabulary size {spec.vocab_size}")
    mask = list(seq.loss_mask)
    if mask:
        mask[0] = 0
    if not any(mask):
        raise BadInput(f"{src}:{line}: segments: no model token to train on after the first "
                       "position")
    runs = image_runs(seq.input_ids, spec.image_pad)
    paths = _image_paths(row, src, line, base, segs, runs)
    for p, n in zip(paths, runs):
        want = placeholder_count(spec.processor, p)
        if want is not None and want != n:
            raise BadInput(f"{src}:{line}: images: image {p.name} gives {want} placeholder "
                           f"tokens but its run in the segments has {n} (a different processor "
                           "or resize setting?)")
    return Example(src=src, line=line, input_ids=seq.input_ids, loss_mask=mask, images=paths,
                   engine_logprobs=seq.model_logprobs)


def _image_paths(row: dict, src: str, line: int, base: Path, segs: list, runs: list[int]
                 ) -> list[Path]:
    """The image file behind each placeholder run: segments list image indexes in order."""
    if not runs and not row.get("images"):
        return []
    refs = parse_image_refs(row, src, line)
    listed = [i for s in segs for i in (s.images or [])]
    order = listed if any(s.images is not None for s in segs) else list(range(len(refs)))
    if len(order) != len(runs):
        raise BadInput(f"{src}:{line}: segments: {len(runs)} image placeholder runs but the "
                       f"segments list {len(order)} images")
    paths = []
    for i in order:
        if not 0 <= i < len(refs):
            raise BadInput(f"{src}:{line}: segments: image index {i} out of range "
                           f"(the row has {len(refs)} images)")
        p = Path(refs[i]["path"])
        p = p if p.is_absolute() else base / p
        if not p.is_file():
            raise BadInput(f"{src}:{line}: images[{i}].path: {p}: image not found")
        _check_sha256(p, refs[i].get("sha256"), f"{src}:{line}: images[{i}].sha256")
        paths.append(p)
    return paths


_DIGESTS: dict[tuple[str, int, int], str] = {}  # (path, size, mtime_ns) -> sha256, per process


def _check_sha256(path: Path, want: Any, where: str) -> None:
    """The file is the one the record was written with (rows without `sha256`, such as
    message rows, are taken as they are). Each file is hashed once per process: the G samples
    of a prompt and every epoch share their images."""
    if want is None:
        return
    if not isinstance(want, str):
        raise BadInput(f"{where}: expected a hex string, got {type(want).__name__}")
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _DIGESTS:
        _DIGESTS[key] = sha256_file(path)
    got = _DIGESTS[key]
    if got != want.lower():
        raise BadInput(f"{where}: {path}: the file's sha256 is {got[:12]}…, the record's "
                       f"{want[:12]}… — the image changed since the record was written; "
                       "restore it or re-run the rollout")


# ------------------------------------------------------------------------------ planning


def micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indexes grouped into micro-batches, longest first, each with longest × count ≤ max_tokens
    (so the padding a micro-batch computes is bounded by sorting, not by chance). A sequence
    longer than the budget sits alone: it is never split, nor refused (a row of the model's
    whole context trains; the log-probs' chunks keep its logits small)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    out: list[list[int]] = []
    for i in order:
        if out and lengths[out[-1][0]] * (len(out[-1]) + 1) <= max_tokens:
            out[-1].append(i)  # sorted: the first member is the longest
        else:
            out.append([i])
    return out


def shard(lengths: Sequence[int], rank: int, world: int) -> list[int]:
    """This rank's indexes: longest first to the least-loaded rank (ties: lower rank), so every
    rank gets about the same number of tokens and every sequence goes to exactly one rank."""
    if world == 1:
        return list(range(len(lengths)))
    load = [0] * world
    mine = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world), key=lambda k: (load[k], k))
        load[r] += lengths[i]
        if r == rank:
            mine.append(i)
    return sorted(mine)


@dataclass
class Micro:
    """A micro-batch: examples and a weight (0 for the filler that keeps ranks in step)."""

    examples: list[Example]
    weight: float = 1.0


def plan(examples: Sequence[Example], rank: int, world: int, max_tokens: int,
         n_micro: int | None = None, filler: Example | None = None) -> list[Micro]:
    """This rank's micro-batches for one minibatch. With `n_micro` (the maximum over ranks),
    pads with weight-0 fillers so every rank runs the same number of forwards and backwards."""
    mine = [examples[i] for i in shard([len(e) for e in examples], rank, world)]
    out = [Micro([mine[i] for i in mb]) for mb in micro_batches([len(e) for e in mine], max_tokens)]
    fill = (mine or [filler or examples[0]])[-1]
    while n_micro is not None and len(out) < n_micro:
        out.append(Micro([fill], weight=0.0))
    return out


# ------------------------------------------------------------------------------ tensors


@dataclass
class Batch:
    """A collated micro-batch. `tensors` go to the model; the rest rides along."""

    tensors: dict  # input_ids, attention_mask, mm_token_type_ids, [pixel_values, image_grid_thw]
    loss_mask: Any  # torch [B, T] float
    examples: list[Example]
    weight: float = 1.0
    extra: dict = field(default_factory=dict)  # advantages [B], and [B, T] per `logps` key

    @property
    def n_tokens(self) -> int:
        """Real (unpadded) tokens."""
        return int(self.tensors["attention_mask"].sum())


class FeatureCache:
    """Image features by (path, size, mtime), least recently used first out, at most
    `max_bytes` of pixel values. Decoding and resizing a 1024² PNG costs about 30 ms, a third
    of a tiny model's training step."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes, self.bytes = max_bytes, 0
        self._items: OrderedDict[tuple, Any] = OrderedDict()
        self.hits = self.misses = 0

    def get(self, processor: Any, path: Path) -> Any:
        from marscli.qwen.tokens import image_features

        st = os.stat(path)
        key = (str(path), st.st_size, st.st_mtime_ns, id(processor))
        feats = self._items.get(key)
        if feats is not None:
            self.hits += 1
            self._items.move_to_end(key)
            return feats
        self.misses += 1
        feats = image_features(processor, open_image(path, max_pixels=MAX_SOURCE_PIXELS))
        feats.image = None  # the PIL image is not needed for training; do not hold it
        size = feats.pixel_values.numel() * feats.pixel_values.element_size()
        if size <= self.max_bytes:
            self._items[key] = feats
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, old = self._items.popitem(last=False)
                self.bytes -= old.pixel_values.numel() * old.pixel_values.element_size()
        return feats


FEATURES = FeatureCache(int(os.environ.get("MARSCLI_FEATURE_CACHE_MB", "1024")) << 20)


def collate(examples: Sequence[Example], spec: Spec, weight: float = 1.0,
            device: Any = None, logps: Mapping[str, Mapping[int, Any]] | None = None) -> Batch:
    """Right-pad to the longest sequence; pixels of every image in order (sequence, then run).

    `logps` maps a name (old_logp, ref_logp) to per-example log-probs [T] by `Example.index`;
    each name whose values cover every example becomes `extra[name]` [B, T], zero-padded."""
    import torch

    width = max(len(e) for e in examples)
    ids = torch.full((len(examples), width), spec.pad, dtype=torch.long)  # [B, T]
    attn = torch.zeros((len(examples), width), dtype=torch.long)  # [B, T]
    mask = torch.zeros((len(examples), width), dtype=torch.float32)  # [B, T]
    for b, e in enumerate(examples):
        ids[b, :len(e)] = torch.tensor(e.input_ids)
        attn[b, :len(e)] = 1
        mask[b, :len(e)] = torch.tensor(e.loss_mask, dtype=torch.float32)
    t: dict[str, Any] = {"input_ids": ids, "attention_mask": attn,
                         "mm_token_type_ids": (ids == spec.image_pad).int() * attn.int()}
    feats = [FEATURES.get(spec.processor, p) for e in examples for p in e.images]
    if feats:
        t["pixel_values"] = torch.cat([f.pixel_values for f in feats])  # [patches, dim]
        t["image_grid_thw"] = torch.stack([f.grid_thw for f in feats])  # [images, 3]
        runs = [n for e in examples for n in image_runs(e.input_ids, spec.image_pad)]
        for e_n, f in zip(runs, feats):
            if e_n != f.n_tokens:
                raise BadInput(f"{examples[0].src}: an image gives {f.n_tokens} placeholder "
                               f"tokens but its run has {e_n} (a different processor?)")
    extra: dict[str, Any] = {"advantages": torch.tensor([e.advantage for e in examples],
                                                        dtype=torch.float32)}
    for key, values in (logps or {}).items():
        if all(e.index in values for e in examples):
            x = torch.zeros((len(examples), width), dtype=torch.float32)  # [B, T]
            for b, e in enumerate(examples):
                x[b, :len(e)] = values[e.index]
            extra[key] = x
    if device is not None:
        t = {k: v.to(device) for k, v in t.items()}
        mask = mask.to(device)
        extra = {k: v.to(device) for k, v in extra.items()}
    return Batch(t, mask, list(examples), weight, extra)
