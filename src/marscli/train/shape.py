"""A model's shape (`memory.Shape`) read from its checkpoint folder or config.json, for
`marscli plan`: every field checked (a missing, malformed or absurd value is BadInput naming the
file and field), and vLLM's own checks of a tensor-parallel size."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from marscli.errors import BadInput
from marscli.train.memory import QWEN3_VL_MAX_PIXELS, Shape, Vision

MODEL_TYPES = ("qwen3_vl", "qwen3_vl_text", "qwen3")


def _read_json(f: Path) -> Any:
    try:
        return json.loads(f.read_bytes())
    except json.JSONDecodeError as e:
        raise BadInput(f"{f}: not valid JSON ({e.msg} at line {e.lineno})") from None
    except UnicodeDecodeError:
        raise BadInput(f"{f}: not valid JSON (not UTF-8 text)") from None
    except OSError as e:
        raise BadInput(f"{f}: cannot read it ({e.strerror or e})") from None


def config_file(path: str) -> Path:
    """POLICY_OR_CONFIG → the config.json to read."""
    p = Path(path)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise BadInput(f"{p}: no config.json in this folder — give a checkpoint folder or "
                           "a config.json file")
        return p / "config.json"
    if not p.exists():
        raise BadInput(f"{path}: no such file or folder — give a checkpoint folder or a "
                       "config.json file (recipes/qwen3-vl-8b.config.json ships one)")
    return p


# The most a config's size may say (the default: _MAX): well above any Qwen3 / Qwen3-VL model
# (8B: hidden 4,096, vocabulary 151,936), low enough that a typo (a vocabulary of 1e30)
# is refused instead of counted into a 25-digit parameter count.
_MAX = 1 << 20
_MAX_OF = {"hidden_size": 1 << 16, "out_hidden_size": 1 << 16, "num_hidden_layers": 1024,
           "depth": 1024, "num_attention_heads": 1024, "num_key_value_heads": 1024,
           "num_heads": 1024, "head_dim": 1024, "vocab_size": 1 << 22, "patch_size": 1024,
           "temporal_patch_size": 64, "in_channels": 64, "spatial_merge_size": 64}


def _int(cfg: dict, key: str, f: Path, prefix: str, default: int | None = None) -> int:
    v = cfg.get(key, default)
    if v is None:
        raise BadInput(f"{f}: {prefix}{key}: missing — plan reads Qwen3 / Qwen3-VL configs")
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise BadInput(f"{f}: {prefix}{key}: expected a positive integer, got {v!r}")
    if v > (hi := _MAX_OF.get(key, _MAX)):
        raise BadInput(f"{f}: {prefix}{key}: {v:,} is over {hi:,}, more than any Qwen3 / "
                       "Qwen3-VL model has — check the config")
    return v


def _kv_heads(text: dict, heads: int, f: Path, prefix: str) -> int:
    """num_key_value_heads as transformers reads it: absent is its class default (32), null
    is one a head (no GQA); a Qwen3 layer repeats each KV head heads / kv_heads times, so
    they must divide (transformers' num_key_value_groups)."""
    absent = "num_key_value_heads" not in text
    if text.get("num_key_value_heads", 0) is None:
        text = {**text, "num_key_value_heads": heads}
    kv = _int(text, "num_key_value_heads", f, prefix, 32)
    if heads % kv:
        raise BadInput(f"{f}: {prefix}num_key_value_heads: {kv}"
                       f"{' (absent: transformers default)' if absent else ''} does not divide "
                       f"num_attention_heads {heads} — grouped-query attention shares each KV "
                       "head among a whole number of query heads")
    return kv


def check_tp(s: Shape, tp: int, f: Path) -> None:
    """vLLM's own checks of a tensor-parallel size (ModelConfig.verify_with_parallel_config,
    the attention layers, the vision tower it shards too): refused here, not at engine start."""
    why = None
    if s.heads % tp:
        why = f"num_attention_heads {s.heads}"
    elif s.kv_heads % tp if s.kv_heads >= tp else tp % s.kv_heads:
        why = (f"num_key_value_heads {s.kv_heads} (vLLM splits KV heads evenly, or "
               "replicates them when fewer than --tensor-parallel, a whole number of times)")
    elif s.vision and s.vision.heads % tp:
        why = f"vision_config.num_heads {s.vision.heads}"
    if why:
        raise BadInput(f"--tensor-parallel {tp}: does not divide {f}'s {why} — vLLM refuses "
                       "it; use a --tensor-parallel that does")


def _check_vision(v: Vision, f: Path) -> None:
    if v.hidden % v.heads:  # the vision attention's head width (transformers', vLLM's)
        raise BadInput(f"{f}: vision_config.num_heads: {v.heads} does not divide "
                       f"vision_config.hidden_size {v.hidden}")


def load_shape(path: str) -> tuple[Shape, Path]:
    """The model's shape from a checkpoint folder or a config.json (BadInput naming the file
    and field when it is unreadable, malformed or not a Qwen3 / Qwen3-VL dense model)."""
    f = config_file(path)
    cfg = _read_json(f)
    if not isinstance(cfg, dict):
        raise BadInput(f"{f}: expected a JSON object")
    mt = cfg.get("model_type")
    if mt not in MODEL_TYPES:
        raise BadInput(f"{f}: model_type: {mt!r} is not a dense Qwen3 / Qwen3-VL model — plan "
                       f"counts {', '.join(MODEL_TYPES)}")
    text, tp = (cfg["text_config"], "text_config.") if "text_config" in cfg else (cfg, "")
    if not isinstance(text, dict):
        raise BadInput(f"{f}: text_config: expected a JSON object")
    heads = _int(text, "num_attention_heads", f, tp)
    hidden = _int(text, "hidden_size", f, tp)
    tied = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    vision = None
    if "vision_config" in cfg:
        v, vp = cfg["vision_config"], "vision_config."
        if not isinstance(v, dict):
            raise BadInput(f"{f}: vision_config: expected a JSON object")
        ds = v.get("deepstack_visual_indexes", [])
        if not isinstance(ds, list):
            raise BadInput(f"{f}: vision_config.deepstack_visual_indexes: expected a list")
        vision = Vision(
            hidden=_int(v, "hidden_size", f, vp), intermediate=_int(v, "intermediate_size", f, vp),
            depth=_int(v, "depth", f, vp), heads=_int(v, "num_heads", f, vp),
            patch=_int(v, "patch_size", f, vp),
            temporal_patch=_int(v, "temporal_patch_size", f, vp, 2),
            in_channels=_int(v, "in_channels", f, vp, 3),
            merge=_int(v, "spatial_merge_size", f, vp, 2),
            out_hidden=_int(v, "out_hidden_size", f, vp, hidden),
            positions=_int(v, "num_position_embeddings", f, vp),
            deepstack=len(ds), max_pixels=max_pixels(f.parent) if f.name == "config.json"
            else QWEN3_VL_MAX_PIXELS)
        _check_vision(vision, f)
    shape = Shape(
        hidden=hidden, layers=_int(text, "num_hidden_layers", f, tp), heads=heads,
        kv_heads=_kv_heads(text, heads, f, tp),
        # transformers' Qwen3 / Qwen3-VL default, not hidden / heads (Qwen3-8B: 4096 / 32)
        head_dim=_int(text, "head_dim", f, tp, 128),
        intermediate=_int(text, "intermediate_size", f, tp),
        vocab=_int(text, "vocab_size", f, tp), tied=bool(tied),
        attention_bias=bool(text.get("attention_bias", False)), vision=vision)
    return shape, f


def max_pixels(folder: Path) -> int:
    """The image processor's pixel budget (size.longest_edge) in a checkpoint folder, if it
    says; Qwen3-VL's default otherwise. Only config.json is required."""
    for name in ("preprocessor_config.json", "processor_config.json"):
        try:
            doc = json.loads((folder / name).read_bytes())
        except (OSError, ValueError):
            continue
        ip = doc.get("image_processor", doc) if isinstance(doc, dict) else None
        size = ip.get("size") if isinstance(ip, dict) else None
        edge = size.get("longest_edge") if isinstance(size, dict) else None
        if isinstance(edge, int) and edge > 0:
            return edge
    return QWEN3_VL_MAX_PIXELS
