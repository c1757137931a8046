"""Training state that survives between processes: fp32 master weights and, when asked, AdamW's
moments and step, kept beside the HF export that engines load.

    CKPT/                          the rollout copy: a plain HF folder in --save-dtype (rollout,
      config.json model.safetensors  eval and vLLM load it; they read top-level files only)
      tokenizer... metrics.jsonl marscli.meta.json
      train_state/                 read by update and sft only
        state.json                 {"v", "engine", "world", "zero_stage", "bf16", "steps",
                                    "master", "optimizer"}
        master.safetensors         fp32 masters by HF name; absent when the export is float32
                                   (the export is then the master itself)
        optimizer/optimizer.pt     plain torch AdamW state_dict (--keep-optimizer)
        optimizer/state/           DeepSpeed's own checkpoint: one optimiser shard per rank,
                                   fp32 partitions, moments and step (--keep-optimizer)

Why: at lr 1e-6 a bf16 copy rounded and reloaded between iterations discards ~98% of an update,
and a fresh AdamW each iteration is not the optimiser a long-lived trainer runs. The masters
come from the optimiser's fp32 partitions (`safe_get_full_fp32_param`), never from the 16-bit
module copy; the next run seeds DeepSpeed's fp32 partitions from them (`safe_set_full_fp32_param`)
after `deepspeed.initialize`. A DeepSpeed optimiser state is tied to its world size and ZeRO
stage: another launch is refused (exit 2) naming both. Plain torch state fits any world size.
Importing this module is cheap: torch loads inside the functions.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from marscli.errors import BadInput

STATE_DIR = "train_state"
MASTER_FILE = "master.safetensors"
TORCH_OPTIMIZER = "optimizer/optimizer.pt"
DS_DIR, DS_TAG = "optimizer", "state"
LEGACY_OPTIMIZER = "optimizer.pt"  # POLICY/optimizer.pt of earlier marscli versions (plain torch)


def read_state(ckpt: str | Path) -> dict | None:
    f = Path(ckpt) / STATE_DIR / "state.json"
    if not f.is_file():
        return None
    try:
        return json.loads(f.read_text())
    except ValueError as e:
        raise BadInput(f"{f}: not valid JSON ({e}) — delete {f.parent} to train from the HF "
                       "weights with a fresh optimiser") from None


def master_file(ckpt: str | Path) -> Path | None:
    """CKPT/train_state/master.safetensors, when the export beside it is not the master."""
    f = Path(ckpt) / STATE_DIR / MASTER_FILE
    return f if f.is_file() else None


def fp32_sources(ckpt: str | Path) -> list[Path]:
    """The files holding the checkpoint's fp32 masters: train_state/master.safetensors, or else
    the HF weights themselves (whose float32 tensors are the masters)."""
    master = master_file(ckpt)
    return [master] if master else sorted(Path(ckpt).glob("*.safetensors"))


@contextmanager
def tensor_reader(paths: list[Path]) -> Iterator[Callable[[str], Any]]:
    """`get(name)`: the tensor stored under `name` in one of the safetensors files (read one at
    a time, memory-mapped), or None."""
    from safetensors import safe_open

    with ExitStack() as stack:
        where = {}
        for p in paths:
            f = stack.enter_context(safe_open(str(p), "pt"))
            where.update(dict.fromkeys(f.keys(), f))
        yield lambda name: where[name].get_tensor(name) if name in where else None


def engine_of(ds_cfg: dict | None) -> dict:
    """How a run trains, as state.json records it."""
    from marscli.train.dsconfig import bf16_enabled, zero_stage

    return {"engine": "deepspeed" if ds_cfg else "torch", "zero_stage": zero_stage(ds_cfg),
            "bf16": bf16_enabled(ds_cfg)}


def _how(st: dict) -> str:
    if st.get("engine") == "deepspeed":
        return f"DeepSpeed ZeRO-{st.get('zero_stage')}{' bf16' if st.get('bf16') else ''}"
    return "plain torch"


def check_resumable(ckpt: str, ds_cfg: dict | None, world: int) -> None:
    """Refuse (BadInput, exit 2) an optimiser state this launch cannot load: saved by another
    engine, ZeRO stage or (DeepSpeed) world size. Runs before anything heavy loads."""
    st = read_state(ckpt)
    if not st or not st.get("optimizer"):
        return
    here = engine_of(ds_cfg)
    where = Path(ckpt) / STATE_DIR
    fix = "or drop --keep-optimizer to start a fresh AdamW from the saved fp32 weights"
    if any(st.get(k) != here[k] for k in ("engine", "zero_stage", "bf16")):
        raise BadInput(f"{where}: optimiser state saved by {_how(st)}, this run uses "
                       f"{_how(here)} — run it the same way, {fix}")
    if here["engine"] == "deepspeed" and st.get("world") != world:
        raise BadInput(f"{where}: optimiser state saved by {st.get('world')} ranks, this run has "
                       f"{world} — launch {st.get('world')} ranks, {fix}")


# ------------------------------------------------------------------------------ saving


def save_all(model: Any, folder: Path, policy: str, processor: Any, dtype: str, *,
             optimizer: bool, steps: int, ds_cfg: dict | None) -> dict:
    """Write the HF export (rank 0) and train_state/ (collective: every rank must call it).
    Returns {"save_seconds", "master_save_seconds", "bytes_written"} (bytes on rank 0: the
    whole folder; master_save_seconds: gathering the fp32 masters and writing
    train_state/master.safetensors, a part of save_seconds)."""
    from marscli.train.checkpoint import save_errors

    with save_errors(folder):  # a full disk: one line, whichever writer meets it
        return _save_all(model, folder, policy, processor, dtype, optimizer=optimizer,
                         steps=steps, ds_cfg=ds_cfg)


def _save_all(model: Any, folder: Path, policy: str, processor: Any, dtype: str, *,
              optimizer: bool, steps: int, ds_cfg: dict | None) -> dict:
    from marscli.train.checkpoint import save_checkpoint
    from marscli.train.distributed import barrier

    d = model.dist
    t0 = time.perf_counter()
    masters = model.master_state_dict()  # collective under DeepSpeed; None off rank 0
    master_seconds = time.perf_counter() - t0
    state = folder / STATE_DIR
    if d.main:
        save_checkpoint(model.lm, masters, folder, policy, dtype, processor)
        state.mkdir(exist_ok=True)
        if dtype != "float32":
            from safetensors.torch import save_file

            t1 = time.perf_counter()
            save_file(masters, str(state / MASTER_FILE), metadata={"format": "pt"})
            master_seconds += time.perf_counter() - t1
    del masters
    barrier(d)  # the folder exists before other ranks write into it
    if optimizer:
        save_optimizer(model, state)
    if d.main:
        info = {"v": 1, **engine_of(ds_cfg), "world": d.world, "steps": steps,
                "master": MASTER_FILE if dtype != "float32" else None,
                "optimizer": (f"{DS_DIR}/{DS_TAG}" if model.engine is not None
                              else TORCH_OPTIMIZER) if optimizer else None}
        (state / "state.json").write_text(json.dumps(info, indent=2) + "\n")
    barrier(d)  # every rank's shard is written
    seconds = time.perf_counter() - t0
    n = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if d.main else 0
    return {"save_seconds": round(seconds, 3), "master_save_seconds": round(master_seconds, 3),
            "bytes_written": n}


def save_optimizer(model: Any, state: Path) -> None:
    """AdamW's state into `state/optimizer/` (collective under DeepSpeed: each rank writes its
    shard)."""
    if model.engine is not None:
        model.engine.save_checkpoint(str(state / DS_DIR), tag=DS_TAG, save_latest=False)
    elif model.dist.main:
        import torch

        (state / TORCH_OPTIMIZER).parent.mkdir(parents=True, exist_ok=True)
        torch.save(model.optimizer.state_dict(), state / TORCH_OPTIMIZER)


# ------------------------------------------------------------------------------ loading


def load_optimizer(model: Any, ckpt: str | Path, *, betas: tuple[float, float], eps: float,
                   weight_decay: float) -> bool:
    """Restore AdamW's moments and step (and, under DeepSpeed, its fp32 partitions) from
    CKPT/train_state (or a legacy CKPT/optimizer.pt); False when there is none (the first
    update after SFT). This run's betas, eps and weight decay replace the saved ones."""
    import pickle

    import torch

    ckpt = Path(ckpt)
    st = read_state(ckpt) or {}
    if model.engine is not None:
        if not st.get("optimizer"):
            return False
        where = ckpt / STATE_DIR / DS_DIR
        path, _ = model.engine.load_checkpoint(str(where), tag=DS_TAG, load_optimizer_states=True,
                                               load_lr_scheduler_states=False)
        if path is None:
            raise BadInput(f"{where}: no DeepSpeed checkpoint '{DS_TAG}' — delete "
                           f"{ckpt / STATE_DIR} to start a fresh optimiser")
    else:
        path = ckpt / STATE_DIR / TORCH_OPTIMIZER
        if not path.is_file():
            path = ckpt / LEGACY_OPTIMIZER
        if not path.is_file():
            return False
        try:
            model.optimizer.load_state_dict(torch.load(path, map_location=model.dist.device,
                                                       weights_only=True))
        except (ValueError, KeyError, RuntimeError, EOFError, pickle.UnpicklingError) as e:
            raise BadInput(f"{path}: does not fit the policy's trainable parameters ({e}) — "
                           "delete it to start a fresh optimiser") from None
    for g in model.optimizer.param_groups:
        g.update(betas=betas, eps=eps, weight_decay=weight_decay)
    return True
