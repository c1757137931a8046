"""The training machinery `update` and `sft` share: distributed set-up, the policy wrapped for
log-prob forwards, AdamW (plain torch or DeepSpeed ZeRO), gradient accumulation, the LR
schedule, atomic HF checkpoints and the metrics writer. Import it lazily (it imports torch).

A training step over one minibatch (see `train_minibatch`):
    for each micro-batch (the same count on every rank; fillers have weight 0):
        logp = model.logp(batch, grad=True)          # [B, T], 0 off the loss mask
        model.backward(loss_fn(logp, batch))         # losses SUM to the minibatch objective
    grad_norm = model.step(lr)                       # all-reduce, clip, AdamW
The contract for `loss_fn`: the losses it returns, summed over micro-batches *and ranks*, equal
the loss over the whole minibatch; `backward` undoes DeepSpeed's averaging over ranks. So a
2-rank ZeRO run and a 1-process run compute the same gradient (up to summation order).

Launchers: `torchrun --nproc_per_node N -m marscli ...`, `deepspeed --no_local_rank --module
marscli ...`, or `srun` (SLURM_PROCID/SLURM_STEP_NUM_TASKS become RANK/WORLD_SIZE). Without a distributed
environment and without `--deepspeed`: one plain torch process. bf16 on GPU (DeepSpeed's bf16,
or autocast in plain torch with fp32 weights), fp32 on CPU.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import torch
import torch.nn.functional as F
from torch import nn

from marscli.batch import Batch
from marscli.errors import BadInput
from marscli.jsonl import dumps, remove_stale_tmp

SCHEDULES = ("constant", "cosine", "linear")


# ------------------------------------------------------------------------------ distributed


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: str = "cpu"
    backend: str | None = None  # None: not initialised (one process)

    @property
    def main(self) -> bool:
        return self.rank == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slurm_env(env: Mapping[str, str]) -> dict[str, str]:
    """torch.distributed variables for a task started by `srun` (one task per rank); nothing
    when a launcher already set RANK, or outside an srun step of several tasks (a batch
    script's own shell sees SLURM_NTASKS of the whole job, but no SLURM_STEP_NUM_TASKS)."""
    if "RANK" in env or "SLURM_PROCID" not in env or int(env.get("SLURM_STEP_NUM_TASKS", "1")) < 2:
        return {}
    return {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": env["SLURM_STEP_NUM_TASKS"],
            "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
            "MASTER_ADDR": env.get("MASTER_ADDR", env.get("SLURM_LAUNCH_NODE_IPADDR", "127.0.0.1")),
            "MASTER_PORT": env.get("MASTER_PORT", "29500")}


def init_distributed(deepspeed: bool = False, device: str = "auto") -> Dist:
    """Join the process group the launcher describes (torchrun, deepspeed, srun), or none."""
    env = os.environ
    env.update(slurm_env(env))
    world = int(env.get("WORLD_SIZE", "1"))
    if deepspeed and "RANK" not in env:  # DeepSpeed wants a process group even for one process
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", str(free_port()))
    rank, local = int(env.get("RANK", "0")), int(env.get("LOCAL_RANK", "0"))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise BadInput(f"--device {device}: CUDA is not available on this machine")
        device = device if ":" in device else f"cuda:{local}"
        torch.cuda.set_device(torch.device(device))
    d = Dist(rank, world, local, device)
    if deepspeed:
        import deepspeed as ds

        _quiet_deepspeed()
        if not device.startswith("cuda") and not env.get("MARSCLI_DS_SHM"):
            # On CPU, DeepSpeed JIT-compiles a shared-memory all-reduce op on first use (about
            # 2 minutes on 2 cores); gloo is exact and enough here. MARSCLI_DS_SHM=1 keeps it.
            import deepspeed.ops

            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        ds.init_distributed(verbose=False)
        d.backend = torch.distributed.get_backend()
    elif world > 1:
        d.backend = "nccl" if device.startswith("cuda") else "gloo"
        torch.distributed.init_process_group(d.backend)
    return d


def _quiet_deepspeed() -> None:
    import logging
    import warnings

    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)
    # DeepSpeed calls torch.distributed functions that torch 2.14 deprecates, once per bucket
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+` is deprecated",
                            category=FutureWarning)


def close_distributed(d: Dist) -> None:
    if d.backend is not None and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def all_reduce(values: Sequence[float], d: Dist, op: str = "sum") -> list[float]:
    """Reduce a few numbers over ranks (sum, max or min), float64."""
    if d.backend is None:
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64)
    if d.backend == "nccl":
        t = t.to(d.device)
    ops = {"sum": torch.distributed.ReduceOp.SUM, "max": torch.distributed.ReduceOp.MAX,
           "min": torch.distributed.ReduceOp.MIN}
    torch.distributed.all_reduce(t, op=ops[op])
    return t.cpu().tolist()


def barrier(d: Dist) -> None:
    if d.backend is not None:
        torch.distributed.barrier()


def seed_everything(seed: int) -> None:
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# ------------------------------------------------------------------------------ the model


class PolicyLM(nn.Module):
    """A Qwen3-VL `...ForConditionalGeneration` whose forward returns per-token log-probs.

    Only the positions under the loss mask go through the LM head, so the [T, vocab] logits of
    prompt and tool tokens are never materialised. With `touch_visual`, a micro-batch without
    images gets one extra row holding a 1-token blank image (loss mask 0, its output dropped):
    under ZeRO-3 every rank must run the same modules in the same order, or the parameter
    gathers mismatch (a separate call into the vision tower is not enough: gloo aborts with
    "Received data size doesn't match expected size"), and under ZeRO-2 every rank must
    produce gradients for the same parameters.
    """

    def __init__(self, lm: nn.Module, touch_visual: bool = False) -> None:
        super().__init__()
        self.lm = lm
        self.touch_visual = touch_visual

    def forward(self, input_ids, attention_mask, mm_token_type_ids, loss_mask,
                pixel_values=None, image_grid_thw=None):
        n = input_ids.shape[0]
        if pixel_values is None and self.touch_visual:
            (input_ids, attention_mask, mm_token_type_ids, loss_mask, pixel_values,
             image_grid_thw) = self._blank_image_row(input_ids, attention_mask,
                                                     mm_token_type_ids, loss_mask)
        self.lm.model.rope_deltas = None  # never reuse 3-D positions cached by an earlier forward
        out = self.lm.model(input_ids=input_ids, attention_mask=attention_mask,
                            mm_token_type_ids=mm_token_type_ids, pixel_values=pixel_values,
                            image_grid_thw=image_grid_thw, use_cache=False)
        h = out.last_hidden_state[:n]  # [B, T, H]
        sel = loss_mask[:n, 1:] > 0  # [B, T-1]: token t+1 is predicted at position t
        logits = self.lm.lm_head(h[:, :-1][sel]).float()  # [N, V]
        lp = -F.cross_entropy(logits, input_ids[:n, 1:][sel], reduction="none")  # [N]
        full = torch.zeros(sel.shape, dtype=lp.dtype, device=lp.device).masked_scatter(sel, lp)
        return F.pad(full, (1, 0))  # [B, T]

    def _blank_image_row(self, ids, attn, mm, mask):
        cfg = self.lm.config
        vc = cfg.vision_config
        m = vc.spatial_merge_size
        dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
        width = max(ids.shape[1], 3)
        row = torch.zeros((1, width), dtype=ids.dtype, device=ids.device)  # [1, T]
        row[0, :3] = torch.tensor([cfg.vision_start_token_id, cfg.image_token_id,
                                   cfg.vision_end_token_id])
        on = torch.zeros_like(row)
        on[0, :3] = 1

        def cat(x, extra):
            x = F.pad(x, (0, width - x.shape[1]))
            return torch.cat([x, extra.to(x.dtype)])

        pv = torch.zeros((m * m, dim), dtype=torch.float32, device=ids.device)  # [patches, dim]
        grid = torch.tensor([[1, m, m]], device=ids.device)  # one merged token
        return (cat(ids, row), cat(attn, on), cat(mm, (row == cfg.image_token_id).int()),
                cat(mask, torch.zeros_like(row)), pv, grid)


@dataclass
class OptimConfig:
    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # 0: no clipping
    warmup_steps: int = 0
    schedule: str = "constant"  # constant | cosine | linear (after warm-up)
    min_lr_ratio: float = 0.0  # cosine/linear floor, as a fraction of lr

    def check(self) -> None:
        """Options out of range → BadInput naming the option."""
        check_option_range("--lr", self.lr, 0)
        check_option_range("--adam-beta1", self.betas[0], 0, 1, hi_open=True)
        check_option_range("--adam-beta2", self.betas[1], 0, 1, hi_open=True)
        check_option_range("--adam-eps", self.eps, 0, lo_open=True)
        check_option_range("--weight-decay", self.weight_decay, 0)
        check_option_range("--grad-clip", self.grad_clip, 0)
        check_option_range("--warmup-steps", self.warmup_steps, 0)
        check_option_range("--min-lr-ratio", self.min_lr_ratio, 0, 1)
        if self.schedule not in SCHEDULES:
            raise BadInput(f"--lr-schedule: unknown schedule {self.schedule!r} — choose one of: "
                           f"{', '.join(SCHEDULES)}")


def check_option_range(name: str, v: float | None, lo: float | None = None,
                       hi: float | None = None, *, lo_open: bool = False,
                       hi_open: bool = False) -> None:
    """BadInput naming the option when `v` is not finite or outside [lo, hi] (open ends)."""
    if v is None:
        return
    bad = (not math.isfinite(v) or (lo is not None and (v <= lo if lo_open else v < lo))
           or (hi is not None and (v >= hi if hi_open else v > hi)))
    if bad:
        lo_s = "" if lo is None else f"{'>' if lo_open else '>='} {lo}"
        hi_s = "" if hi is None else f"{'<' if hi_open else '<='} {hi}"
        must = " and ".join(x for x in (lo_s, hi_s) if x)
        raise BadInput(f"{name}: {v} is out of range — must be {must}")


def lr_at(step: int, total: int, cfg: OptimConfig) -> float:
    """Learning rate of optimiser step `step` (0-based) of `total`: linear warm-up from
    lr/warmup to lr, then constant, cosine or linear decay to lr·min_lr_ratio."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    span = max(1, total - cfg.warmup_steps - 1)
    p = min(1.0, max(0.0, (step - cfg.warmup_steps) / span))
    floor = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "cosine":
        return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * p))
    return floor + (cfg.lr - floor) * (1 - p)


class TrainModel:
    """The policy as the trainer drives it: log-prob forwards, backward, an optimiser step,
    the full state dict. Plain torch (one process, or several with an all-reduce of
    gradients) or a DeepSpeed engine; without an optimiser it only scores (the reference)."""

    def __init__(self, module: PolicyLM, d: Dist, *, engine: Any = None,
                 optimizer: torch.optim.Optimizer | None = None, grad_clip: float = 0.0,
                 zero_stage: int | None = None, autocast: torch.dtype | None = None) -> None:
        self.module, self.dist, self.engine = module, d, engine
        self.optimizer, self.grad_clip, self.zero_stage = optimizer, grad_clip, zero_stage
        self.autocast = autocast

    @property
    def lm(self) -> nn.Module:
        return self.module.lm

    def train(self, mode: bool = True) -> None:
        (self.engine if self.engine is not None else self.module).train(mode)

    def logp(self, batch: Batch, grad: bool = False) -> torch.Tensor:
        """Per-token log-probs [B, T] (float32), 0 outside the loss mask."""
        kw = dict(batch.tensors, loss_mask=batch.loss_mask)
        run = self.engine if self.engine is not None else self.module
        amp = (torch.autocast(device_type="cuda", dtype=self.autocast)
               if self.autocast is not None else nullcontext())
        with (torch.enable_grad() if grad else torch.no_grad()), amp:
            return run(**kw).float()

    def set_boundary(self, last: bool) -> None:
        """Tell DeepSpeed whether the next backward ends the minibatch (call before forward)."""
        if self.engine is not None:
            self.engine.set_gradient_accumulation_boundary(last)

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate gradients of `loss`; losses sum over micro-batches and ranks."""
        if self.engine is not None:  # DeepSpeed averages gradients over ranks: undo it
            self.engine.backward(loss * self.dist.world, scale_wrt_gas=False)
        else:
            loss.backward()

    def step(self, lr: float) -> float:
        """All-reduce (plain multi-process), clip, AdamW step at `lr`; returns the gradient
        norm before clipping. A non-finite norm skips the step in plain torch."""
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        if self.engine is not None:
            self.engine.step()
            norm = self.engine.get_global_grad_norm()
            return float(norm) if norm is not None else float("nan")
        params = [p for p in self.module.parameters() if p.requires_grad]
        if self.dist.backend is not None:
            _all_reduce_grads(params)
        norm = clip_grad_norm(params, self.grad_clip)
        if math.isfinite(norm):
            self.optimizer.step()
        else:
            print(f"warning: gradient norm is {float(norm)} — step skipped", file=sys.stderr)
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The HF model's full state dict on rank 0 (None elsewhere). Collective under ZeRO-3:
        every rank must call it."""
        if self.engine is not None and self.zero_stage == 3:
            sd = self.engine._zero3_consolidated_16bit_state_dict()
        elif self.dist.main:
            sd = self.module.state_dict()
        else:
            sd = None
        if sd is None:
            return None
        return {k.removeprefix("lm."): v.detach().cpu() for k, v in sd.items()}


def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> float:
    """Scale gradients to norm ≤ max_norm (0: never); returns the norm before clipping.

    The norm is accumulated in float64: torch's fp32 norm of a 3690×128 embedding gradient on
    CPU was off by 2e-4 relative, enough to make runs that agree on every weight disagree on
    the reported norm (DeepSpeed's agrees with float64)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    norm = float(torch.linalg.vector_norm(torch.stack(
        [torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads])))
    if max_norm > 0 and norm > max_norm and math.isfinite(norm):
        coef = max_norm / (norm + 1e-6)
        for g in grads:
            g.mul_(coef)
    return norm


def _all_reduce_grads(params: list[torch.Tensor]) -> None:
    """SUM gradients over ranks in one flat buffer (a missing gradient counts as zeros)."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    torch.distributed.all_reduce(flat)
    i = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[i:i + n].view_as(p.grad))
        i += n


# ------------------------------------------------------------------------------ DeepSpeed config


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


# ------------------------------------------------------------------------------ building


def build_model(policy: str, d: Dist, *, optim: OptimConfig | None = None,
                ds_config: dict | None = None, gradient_checkpointing: bool = False,
                freeze_vision: bool = False) -> TrainModel:
    """Load the policy for training (with `optim`) or scoring only (without: the reference).

    Plain torch keeps fp32 weights (autocast to bf16 on GPU); DeepSpeed with bf16 loads bf16
    weights and keeps its fp32 master copy in the optimiser."""
    from marscli.policy import load_model

    bf16 = bool(ds_config and (ds_config.get("bf16") or {}).get("enabled"))
    lm = load_model(policy, device="cpu", dtype="bfloat16" if bf16 else "float32")
    stage = int(ds_config["zero_optimization"].get("stage", 0)) if ds_config else None
    module = PolicyLM(lm, touch_visual=ds_config is not None and d.world > 1)
    if freeze_vision:
        lm.model.visual.requires_grad_(False)
    if gradient_checkpointing:
        lm.config.use_cache = False
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    amp = torch.bfloat16 if d.device.startswith("cuda") and ds_config is None else None
    if optim is None:
        module.requires_grad_(False)
        if ds_config is not None and stage == 3:  # partition the reference too
            import deepspeed

            cfg = {k: v for k, v in ds_config.items() if k != "gradient_clipping"}
            engine, *_ = deepspeed.initialize(model=module, config=cfg)
            engine.eval()
            return TrainModel(module, d, engine=engine, zero_stage=3)
        module.to(d.device).eval()
        return TrainModel(module, d, autocast=amp)
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=optim.lr, betas=optim.betas, eps=optim.eps,
                            weight_decay=optim.weight_decay)
    if ds_config is not None:
        import deepspeed

        engine, *_ = deepspeed.initialize(model=module, optimizer=opt, config=ds_config)
        return TrainModel(module, d, engine=engine, optimizer=opt, grad_clip=optim.grad_clip,
                          zero_stage=stage)
    module.to(d.device)
    return TrainModel(module, d, optimizer=opt, grad_clip=optim.grad_clip, autocast=amp)


# ------------------------------------------------------------------------------ one step


LossFn = Callable[[torch.Tensor, Batch], tuple[torch.Tensor, dict[str, float]]]


def micro_weight(loss_mask: torch.Tensor, agg: str, n_tokens: int, n_seqs: int) -> float:
    """The factor that turns a loss aggregated over one micro-batch into its share of the loss
    over the whole minibatch (n_tokens model tokens in n_seqs sequences, all ranks):
    token-mean → the micro-batch's model tokens / n_tokens (each token weighs 1/n_tokens);
    seq-mean-token-mean → its sequences / n_seqs (each sequence weighs 1/n_seqs)."""
    if agg == "token-mean":
        return float(loss_mask.sum()) / n_tokens
    if agg == "seq-mean-token-mean":
        return float((loss_mask.sum(-1) > 0).sum()) / n_seqs
    raise BadInput(f"unknown loss aggregation {agg!r} — choose token-mean or seq-mean-token-mean")


def train_minibatch(model: TrainModel, batches: Iterable[Batch], n_batches: int, loss_fn: LossFn,
                    lr: float) -> tuple[list[dict[str, float]], float, int]:
    """Accumulate gradients over a minibatch's micro-batches, then take one optimiser step.

    `loss_fn(logp, batch) -> (loss, metrics)` must return losses that sum, over micro-batches
    and ranks, to the minibatch objective (weight-0 fillers: return loss · 0). Returns the
    per-micro-batch metrics of real micro-batches, the gradient norm and the tokens computed."""
    model.train(True)
    metrics, tokens = [], 0
    for i, b in enumerate(batches):
        model.set_boundary(i == n_batches - 1)
        logp = model.logp(b, grad=True)  # [B, T]
        loss, m = loss_fn(logp, b)
        model.backward(loss)
        if b.weight:
            metrics.append(m)
            tokens += b.n_tokens
    return metrics, model.step(lr), tokens


def score(model: TrainModel, batches: Iterable[Batch]) -> Iterable[tuple[Batch, torch.Tensor]]:
    """Log-probs [B, T] without gradients (old policy, reference), batch by batch."""
    model.train(False)
    for b in batches:
        yield b, model.logp(b, grad=False).cpu()


# ------------------------------------------------------------------------------ output


class AtomicDir:
    """Build a checkpoint in `OUT.tmp-PID`; on success rename it onto OUT (an existing OUT is
    replaced only with `force`, after the new one is complete); on error remove it. Inactive
    (no folder at all) on ranks other than 0."""

    def __init__(self, out: str | Path, force: bool = False, active: bool = True) -> None:
        self.out, self.force, self.active = Path(out), force, active
        self.tmp = self.out.with_name(f"{self.out.name}.tmp-{os.getpid()}")

    def __enter__(self) -> Self:
        if self.active:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            remove_stale_tmp(self.out)  # what a killed run left
            self.tmp.mkdir()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.active:
            return
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        old = None
        if self.out.exists():
            old = self.out.with_name(f"{self.out.name}.old-{os.getpid()}")
            os.replace(self.out, old)
        os.replace(self.tmp, self.out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def check_out(out: str, force: bool, *inputs: str) -> None:
    """Refuse an existing OUT without --force, and an OUT that is one of the inputs."""
    p = Path(out)
    for i in inputs:
        if i and Path(i).exists() and p.resolve() == Path(i).resolve():
            raise BadInput(f"--out: {out}: is an input checkpoint — write to a new folder")
    if p.exists() and not force:
        raise BadInput(f"--out: {out}: already exists — pick a new folder or pass --force")
    if p.exists() and not p.is_dir():
        raise BadInput(f"--out: {out}: exists and is not a folder")


_WEIGHTS = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".pth")
_NOT_COPIED = {"config.json", "metrics.jsonl", "marscli.meta.json", "optimizer.pt"}


def save_checkpoint(model: TrainModel, state_dict: dict | None, folder: Path, policy: str,
                    dtype: str = "float32", processor: Any = None) -> None:
    """Write the HF checkpoint (safetensors, config) into `folder` on rank 0 and copy the
    policy's tokenizer/processor/chat-template files so that AutoProcessor and vLLM load it."""
    if state_dict is None:
        return
    dt = _save_dtype(dtype, policy)
    sd = {k: (v.to(dt) if v.is_floating_point() else v) for k, v in state_dict.items()}
    lm = model.lm
    lm.config.dtype = dt
    lm.save_pretrained(folder, state_dict=sd, max_shard_size="5GB")
    umask = os.umask(0)
    os.umask(umask)
    for f in folder.iterdir():  # transformers writes shards 0600; make them as readable as any file
        f.chmod(0o666 & ~umask)
    src = Path(policy)
    if src.is_dir():
        for f in sorted(src.iterdir()):
            if (f.is_file() and f.name not in _NOT_COPIED and not f.name.endswith(_WEIGHTS)
                    and not (folder / f.name).exists()):
                shutil.copy2(f, folder / f.name)
    elif processor is not None:
        processor.save_pretrained(folder)


def _save_dtype(name: str, policy: str) -> torch.dtype:
    if name == "input":
        cfg_path = Path(policy) / "config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        name = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
    if name not in ("float32", "bfloat16", "float16"):
        raise BadInput(f"--save-dtype: {name!r} — choose float32, bfloat16 or input")
    return getattr(torch, name)


class MetricsWriter:
    """One JSON line per optimiser step, flushed as it is written (watch it with `tail -f`).
    With `atomic`, lines go to `PATH.tmp-PID`, renamed onto PATH by `close(ok=True)`. A writer
    without a path (ranks other than 0) writes nothing."""

    def __init__(self, path: str | Path | None, atomic: bool = True) -> None:
        self.path = Path(path) if path else None
        self.fh = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.tmp = self.path.with_name(f"{self.path.name}.tmp-{os.getpid()}") if atomic else self.path
            remove_stale_tmp(self.path)
            self.fh = self.tmp.open("wb")

    def write(self, row: dict) -> None:
        if self.fh is not None:
            self.fh.write(dumps(row))
            self.fh.flush()

    def close(self, ok: bool) -> None:
        if self.fh is None:
            return
        self.fh.close()
        self.fh = None
        if self.tmp != self.path:
            if ok:
                os.replace(self.tmp, self.path)
            else:
                self.tmp.unlink(missing_ok=True)


def log(d: Dist, msg: str) -> None:
    """A progress line on stderr, from rank 0 only."""
    if d.main:
        print(msg, file=sys.stderr, flush=True)


class Timer:
    def __enter__(self) -> Self:
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.s = time.perf_counter() - self.t0
