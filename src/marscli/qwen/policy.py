"""Loading a policy checkpoint (HF format folder or hub id), refusing damaged ones with one line.

- `check_checkpoint` (before anything loads, cheap: headers and small JSON files only): the
  folder has a `config.json`; every top-level `*.json` (config, tokenizer, processor, shard
  index) parses; every shard the index names exists; every `*.safetensors` file, and those of
  `train_state/`, has a sane header: an 8-byte length no larger than the file (nor 100 MB), a
  JSON object, and each tensor's data offsets inside the file and as long as its dtype and
  shape say. A lying length of 10^15 is refused here instead of exhausting memory.
- `load_model` loads with transformers' loading info and refuses (BadInput, exit 2) a
  checkpoint whose weights do not match its `config.json`: a tensor missing (transformers would
  fill it with random values), one left over (a layer it would drop), or one of another shape.
  Tied weights (`lm_head` under `tie_word_embeddings`) are not missing. transformers' own
  report table and its "Loading weights" progress bar are kept off stderr.
- `load_processor` turns any failure to build the tokenizer or processor into one line; a
  local Qwen3-VL folder's processor is AutoProcessor's, built without its scan of every
  model's video processor (start-up: `_qwen3_vl_processor`).
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from marscli.errors import BadInput, RuntimeFailure

DEFAULT_POLICY = "sensenova/SenseNova-MARS-8B"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own reader refuses headers over 100 MB
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
                "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
                "F8_E8M0": 1, "C64": 8}  # others (sub-byte floats) get the offset checks only
SHOWN_KEYS = 3  # how many offending weight names a message lists


def check_checkpoint(path: str, option: str = "--policy") -> str:
    """Validate a local checkpoint folder (or accept a hub id); return what to load."""
    p = Path(path)
    if not p.exists():
        from marscli.records.outputs import find_replaced

        find_replaced(p, option)  # an `OUT.old-PID` a killed replace left: put it back
    if not p.exists():
        if _HUB_ID.match(path) and not path.startswith("."):
            return path  # a hub id: transformers resolves (and, with a network, downloads) it
        raise BadInput(f"{option}: {path}: no such checkpoint folder")
    if not p.is_dir():
        raise BadInput(f"{option}: {path}: expected a checkpoint folder (config.json, "
                       "*.safetensors, tokenizer, processor)")
    if not (p / "config.json").is_file():
        raise BadInput(f"{option}: {path}: checkpoint folder has no config.json")
    docs = {f.name: _read_json(f, option) for f in sorted(p.glob("*.json")) if f.is_file()}
    if not isinstance(docs["config.json"], dict):
        raise BadInput(f"{option}: {p / 'config.json'}: expected a JSON object")
    _check_index(p, docs.get("model.safetensors.index.json"), option)
    for f in sorted([*p.glob("*.safetensors"), *p.glob("train_state/*.safetensors")]):
        safetensors_header(f, option)
    return str(p)


def _read_json(f: Path, option: str) -> Any:
    try:
        return json.loads(f.read_bytes())
    except json.JSONDecodeError as e:
        raise BadInput(f"{option}: {f}: not valid JSON ({e.msg} at line {e.lineno}) — the file "
                       "is damaged; restore it from the original checkpoint") from None
    except UnicodeDecodeError:
        raise BadInput(f"{option}: {f}: not valid JSON (not UTF-8 text) — the file is damaged; "
                       "restore it from the original checkpoint") from None


def _check_index(folder: Path, index: Any, option: str) -> None:
    """Every shard a sharded checkpoint's index names is there."""
    if index is None:
        return
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    f = folder / "model.safetensors.index.json"
    if not isinstance(weight_map, dict):
        raise BadInput(f"{option}: {f}: weight_map: expected an object of tensor → shard file")
    for shard in sorted(set(map(str, weight_map.values()))):
        if not (folder / shard).is_file():
            raise BadInput(f"{option}: {f}: names shard {shard}, which is not in the folder")


def safetensors_header(f: Path, option: str = "--policy") -> dict[str, dict]:
    """The tensor entries of a safetensors file's header (`{name: {dtype, shape,
    data_offsets}}`), read without touching the data and checked against the file's size, so
    a truncated or lying file fails here with its name, not deep inside from_pretrained."""
    size = f.stat().st_size

    def bad(why: str) -> BadInput:
        return BadInput(f"{option}: {f}: not a valid safetensors file ({why}) — the file is "
                        "damaged; restore it from the original checkpoint")

    with f.open("rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise bad(f"{size} bytes, shorter than the 8-byte header length: truncated")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > MAX_HEADER_BYTES:
            raise bad(f"header length {n} but the file has {size} bytes"
                      + (": truncated" if n <= MAX_HEADER_BYTES else ""))
        raw = fh.read(n)
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise bad("the header is not JSON") from None
    if not isinstance(header, dict):
        raise bad("the header is not a JSON object")
    data = size - 8 - n
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    for name, entry in tensors.items():
        why = _entry_problem(entry, data)
        if why:
            if why == "truncated":
                end = 8 + n + entry["data_offsets"][1]
                raise BadInput(f"{option}: {f}: truncated safetensors file ({size} bytes, tensor "
                               f"{name!r} ends at byte {end}) — restore it from the original "
                               "checkpoint")
            raise bad(f"tensor {name!r}: {why}")
    return tensors


def _entry_problem(entry: Any, data: int) -> str | None:
    """What is wrong with one header entry, given `data` bytes after the header; None: fine."""
    if not isinstance(entry, dict):
        return "not an object"
    shape, offsets, dtype = entry.get("shape"), entry.get("data_offsets"), entry.get("dtype")
    if not isinstance(dtype, str):
        return "no dtype"
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        return "shape is not a list of sizes"
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(type(o) is int for o in offsets) and 0 <= offsets[0] <= offsets[1]):
        return "data_offsets is not [begin, end]"
    if offsets[1] > data:
        return "truncated"
    width = _DTYPE_BYTES.get(dtype)
    if width is not None and offsets[1] - offsets[0] != math.prod(shape) * width:
        return (f"{offsets[1] - offsets[0]} bytes of data for a {dtype} tensor of shape "
                f"{shape}")
    return None


def load_processor(path: str) -> Any:
    """The checkpoint's processor; a tokenizer or processor file transformers cannot use (a
    JSON file of the wrong shape raises KeyError deep inside) is one line, exit 2."""
    from transformers import AutoProcessor

    try:
        return _qwen3_vl_processor(path) or AutoProcessor.from_pretrained(path)
    except (MemoryError, KeyboardInterrupt):
        raise
    except Exception as e:
        raise BadInput(f"--policy: {path}: cannot load the tokenizer or processor "
                       f"({_one_line(e)}) — check tokenizer.json, tokenizer_config.json and "
                       "processor_config.json") from None


def _qwen3_vl_processor(path: str) -> Any:
    """A local Qwen3-VL checkpoint's processor, built as `AutoProcessor.from_pretrained` builds
    it (ProcessorMixin.from_pretrained: the processor dict, each part by its Auto class in the
    class's order, then `from_args_and_dict`) but for the video processor, made from its class
    directly: AutoVideoProcessor finds that class by importing every model's video processor
    module (transformers 5.19, models/auto/video_processing_auto.py `_load_backend_class`: ~80
    modules, ~0.1 s of a stage's start-up). Same objects, same outputs. None (AutoProcessor
    then, and its messages): a hub id, another processor or video processor class, remote
    code, or config files it cannot read."""
    folder = Path(path)
    if not folder.is_dir():
        return None
    from transformers import (
        AutoImageProcessor,
        AutoTokenizer,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )

    try:  # the class AutoProcessor would pick: processor_config.json's, else the image one's
        proc, kwargs = Qwen3VLProcessor.get_processor_dict(path)
        pre = folder / "preprocessor_config.json"
        named = proc.get("processor_class") or (
            json.loads(pre.read_bytes()).get("processor_class") if pre.is_file() else None)
        video, _ = Qwen3VLVideoProcessor.get_video_processor_dict(path)
    except Exception:
        return None
    if (named != "Qwen3VLProcessor" or "auto_map" in proc
            or video.get("video_processor_type") != "Qwen3VLVideoProcessor"
            or "auto_map" in video):
        return None
    parts = {"image_processor": AutoImageProcessor.from_pretrained(path),
             "tokenizer": AutoTokenizer.from_pretrained(path),
             "video_processor": Qwen3VLVideoProcessor.from_pretrained(path)}
    return Qwen3VLProcessor.from_args_and_dict(
        [parts[a] for a in Qwen3VLProcessor.get_attributes()], proc, **kwargs)


def load_model(path: str, device: str = "cpu", dtype: str | None = None) -> Any:
    """`AutoModelForImageTextToText` in eval mode; fp32 on CPU, bf16 on CUDA unless told.
    Refuses a checkpoint whose weights and config.json disagree (module docstring)."""
    import torch
    from transformers import AutoModelForImageTextToText

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise BadInput(f"--device {device}: CUDA is not available on this machine")
    dt = getattr(torch, dtype) if dtype else (torch.bfloat16 if device.startswith("cuda")
                                              else torch.float32)
    try:
        with quiet_transformers():
            model, info = AutoModelForImageTextToText.from_pretrained(
                path, dtype=dt, output_loading_info=True, ignore_mismatched_sizes=True)
    except OSError as e:
        raise BadInput(f"--policy: {path}: cannot load the model ({_one_line(e)})") from None
    except (MemoryError, torch.OutOfMemoryError) as e:
        raise RuntimeFailure(f"--policy: {path}: out of memory while loading the model "
                             f"({_one_line(e)})") from None
    except Exception as e:  # the header checks passed: the files' content is at fault
        raise BadInput(f"--policy: {path}: cannot load the model ({type(e).__name__}: "
                       f"{_one_line(e)}) — check config.json and the weights") from None
    check_loading_info(path, info)
    from transformers.integrations import is_deepspeed_zero3_enabled

    if is_deepspeed_zero3_enabled():  # built partitioned: DeepSpeed placed the partitions
        return model.eval()
    return model.to(device).eval()


def check_loading_info(path: str, info: dict) -> None:
    """Refuse a load that left weights random, dropped some, or reshaped some (BadInput)."""
    problems = [
        ("missing from the weights", sorted(info.get("missing_keys") or ())),
        ("in the weights but not in config.json's model", sorted(info.get("unexpected_keys")
                                                                  or ())),
        ("of another shape than config.json says", sorted(
            f"{k} {list(a)} vs {list(b)}" for k, a, b in info.get("mismatched_keys") or ())),
        ("not loaded", [_one_line(m) for m in info.get("error_msgs") or ()]),
    ]
    for what, keys in problems:
        if keys:
            more = f" (+{len(keys) - SHOWN_KEYS} more)" if len(keys) > SHOWN_KEYS else ""
            raise BadInput(f"--policy: {path}: {len(keys)} weight(s) {what}: "
                           f"{', '.join(keys[:SHOWN_KEYS])}{more} — the checkpoint is damaged "
                           "or its config.json does not describe it; restore both from the "
                           "original checkpoint")


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' loading report (a table of keys, which marscli turns into one line) and
    its progress bars ("Loading weights", "Writing model shards") stay off stderr; both are
    restored after. The report is
    filtered out rather than the logger's level raised: at level WARNING or above,
    transformers 5.19 logs a tensor-parallel plan check instead."""
    import logging

    from transformers.utils import logging as hf_logging

    def no_report(record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in str(record.msg)

    bars = hf_logging.is_progress_bar_enabled()
    logger = hf_logging.get_logger("transformers.modeling_utils")
    hf_logging.disable_progress_bar()
    logger.addFilter(no_report)
    try:
        yield
    finally:
        logger.removeFilter(no_report)
        if bars:
            hf_logging.enable_progress_bar()


def _one_line(e: BaseException | str) -> str:
    return " ".join(str(e).split())
