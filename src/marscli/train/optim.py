"""AdamW's options and the learning-rate schedule, as plain data (no torch): validated before
anything heavy loads, so `update --lr -1` is refused at once."""

from __future__ import annotations

import math
from dataclasses import dataclass

from marscli.errors import BadInput, check_range

SCHEDULES = ("constant", "cosine", "linear")  # after warm-up


@dataclass
class OptimConfig:
    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # 0: no clipping
    warmup_steps: int = 0
    schedule: str = "constant"  # one of SCHEDULES
    min_lr_ratio: float = 0.0  # cosine/linear floor, as a fraction of lr

    def check(self, schedule_option: str = "--lr-schedule") -> None:
        """Options out of range → BadInput naming the option (`schedule_option`: the name the
        command gives the schedule)."""
        check_range("--lr", self.lr, 0)
        check_range("--adam-beta1", self.betas[0], 0, 1, hi_open=True)
        check_range("--adam-beta2", self.betas[1], 0, 1, hi_open=True)
        check_range("--adam-eps", self.eps, 0, lo_open=True)
        check_range("--weight-decay", self.weight_decay, 0)
        check_range("--grad-clip", self.grad_clip, 0)
        check_range("--warmup-steps", self.warmup_steps, 0)
        check_range("--min-lr-ratio", self.min_lr_ratio, 0, 1)
        if self.schedule not in SCHEDULES:
            raise BadInput(f"{schedule_option}: unknown schedule {self.schedule!r} — choose one "
                           f"of: {', '.join(SCHEDULES)}")


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
