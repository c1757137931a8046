"""DeepSpeed JSON configs resolved for marscli's loop (plain JSON, no torch or deepspeed)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from marscli.errors import BadInput

_HF_AUTO = {  # the "auto" values of Hugging Face-style configs that depend on the model size
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
}


def load_ds_config(path: str, *, grad_clip: float, bf16: bool, hidden_size: int) -> dict:
    """Read and resolve a DeepSpeed JSON config for marscli's loop.

    marscli owns the optimiser (AdamW from the CLI options), the schedule and the gradient
    accumulation (one step per minibatch), so batch sizes are set to 1 micro-batch of 1 step,
    `gradient_clipping` and `bf16.enabled` follow `--grad-clip` and the device where they are
    "auto" or absent, and an `optimizer` or `scheduler` section is refused."""
    p = Path(path)
    if not p.is_file():
        raise BadInput(f"--deepspeed: {path}: no such file")
    try:
        cfg = json.loads(p.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise BadInput(f"--deepspeed: {path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise BadInput(f"--deepspeed: {path}: expected a JSON object")
    zero = cfg.setdefault("zero_optimization", {})
    stage = zero.get("stage", 0) if isinstance(zero, dict) else None
    if not isinstance(stage, int) or isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise BadInput(f"--deepspeed: {path}: zero_optimization.stage: {stage!r} is not a ZeRO "
                       "stage — use 0, 1, 2 or 3")
    for key in ("optimizer", "scheduler"):
        if key in cfg:
            raise BadInput(f"--deepspeed: {path}: {key}: marscli builds AdamW and its schedule "
                           "from --lr and the --adam-* options — remove this section")
    if (cfg.get("fp16") or {}).get("enabled") is True:
        raise BadInput(f"--deepspeed: {path}: fp16: not supported (Qwen3-VL overflows in fp16) "
                       "— use bf16")
    cfg.pop("train_batch_size", None)
    cfg["train_micro_batch_size_per_gpu"] = 1
    cfg["gradient_accumulation_steps"] = 1
    if cfg.get("gradient_clipping", "auto") == "auto":
        cfg["gradient_clipping"] = grad_clip
    b = cfg.setdefault("bf16", {})
    if b.get("enabled", "auto") == "auto":
        b["enabled"] = bf16
    for k, fn in _HF_AUTO.items():
        if zero.get(k) == "auto":
            zero[k] = fn(hidden_size)
    left = [k for k, v in _walk(cfg) if v == "auto"]
    if left:
        raise BadInput(f"--deepspeed: {path}: {left[0]}: \"auto\" is not resolved by marscli — "
                       "give a value")
    cfg.setdefault("zero_allow_untested_optimizer", True)
    cfg.setdefault("steps_per_print", 1 << 30)
    return cfg


def zero_stage(cfg: dict | None) -> int | None:
    """The ZeRO stage of a resolved config; None without DeepSpeed."""
    return int(cfg["zero_optimization"].get("stage", 0)) if cfg else None


def bf16_enabled(cfg: dict | None) -> bool:
    return bool(cfg and (cfg.get("bf16") or {}).get("enabled"))


def _walk(d: dict, prefix: str = "") -> Iterable[tuple[str, Any]]:
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _walk(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def hidden_size(policy: str) -> int:
    cfg_path = Path(policy) / "config.json"
    if not cfg_path.is_file():
        return 4096
    cfg = json.loads(cfg_path.read_text())
    return int((cfg.get("text_config") or {}).get("hidden_size") or cfg.get("hidden_size") or 4096)
