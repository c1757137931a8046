"""Rollout correction: how far the rollout engine's probabilities are from the trainer's, and
importance weights that correct the policy gradient for it (torch; import this module lazily).

The rollout engine (vLLM or SGLang in bf16, the HF engine) and the trainer (fp32 masters under
DeepSpeed) give slightly different probabilities to the same tokens, so the trajectories `update`
trains on were sampled from π_engine, not from the π_old whose ratio the loss clips. The weight

    w_t = π_old(y_t) / π_engine(y_t)     (no gradient; log w_t = old_logp − engine_logp)

multiplies each model token's policy loss and turns the sample from π_engine into one from
π_old. Unbounded, w has a heavy tail (a token the engine drew at p = 1e-4 that the trainer gives
0.1 weighs 1000), so every mode bounds or drops it. Every entry of `MODES` is an `ISMode` with one
signature, `mode(log_ratio, mask, cap, floor) -> weights`, log_ratio and mask [B, T] (mask: model
tokens that have engine log-probs), weights [B, T] ≥ 0 and exactly 1 outside the mask:

- `off`: w = 1 everywhere; `update` computes exactly what it did before this module existed.
- `token-truncate` (TIS): w_t clamped to [F, C] (F = 0 by default: min(w_t, C)).
- `token-mask` (IcePop-style): w_t where F ≤ w_t ≤ C, else 0: the token gets no loss.
- `sequence-truncate`: one weight per sequence, s_i = exp(mean_t log w_t) over its model
  tokens (the geometric mean, as GSPO's sequence ratio), clamped to [F, C], on all its tokens.
- `sequence-mask`: s_i where F ≤ s_i ≤ C, else the whole sequence gets no loss.

The entry carries what callers need (`level`: "token", "sequence" or None for off; `masks`:
whether it can drop tokens), so no caller names a mode. Tokens without engine log-probs (the
replay and openai engines write `null`) have log w = 0: weight 1, left out of every metric.

The default is `token-truncate` with C = 2 (`DEFAULT_MODE`, `DEFAULT_CAP`); against verl's and
TRL's defaults:
1. On, not off (verl's `rollout_is` and OpenRLHF's `--enable_vllm_is_correction` are off unless
   asked for). In marscli rollout and update are separate processes by construction, usually on
   different engines and dtypes (vLLM bf16 against fp32 masters), so a mismatch is the normal
   case. When the two agree the weights are 1 to within the agreement (the HF engine in fp32:
   |log w| < 1e-6 on the tiny model) and the default changes nothing; rows without engine
   log-probs get weight 1. `off` stays one option away and reproduces the old numbers exactly.
2. Per token, not per sequence (TRL's default is now `sequence_mask`, cap 3). A MARS trajectory
   holds up to 16k model tokens over 10 turns: the product of its token ratios (verl's
   sequence IS) overflows or vanishes, and masking on it drops the long trajectories first;
   its geometric mean is ≈ 1 for nearly every sequence while one toxic token passes untouched,
   and masking on that throws away a whole 16k-token trajectory for a few tokens. The default
   loss, GSPO, already works at the sequence level; the correction belongs to the tokens the
   engine drew.
3. Truncate, not mask: the weight is bounded (variance ≤ C²) and no sampled token is thrown
   away; masking is for when a few catastrophic tokens must not train at all (`token-mask`
   with a floor, as IcePop's [0.5, 5]).
4. C = 2: the TIS paper's value, TRL's original `vllm_importance_sampling_cap`, verl's
   `rollout_is_threshold` and its token-IS preset. No floor (F = 0), as TIS and TRL.
Masked tokens stay in the loss's denominators (token-mean counts them, as TRL's mask does):
masking shrinks the step instead of re-weighting the surviving tokens of a mismatched batch up.
With `update --old-logp engine` (verl's bypass mode, the released script's) π_old is π_engine,
every weight is 1, and the mode is `off`: the loss's own ratio π_θ/π_engine carries the
mismatch and its clip bounds it. `update` states these defaults again in its torch-free config
(`UpdateConfig.is_mode`, `rollout_is_cap`); keep the two in step.

`correct` gives a batch's weights and the totals of its metrics; totals add up over micro-batches
and ranks (`merge`; `SUM_KEYS` summed, `MAX_KEYS`/`MIN_KEYS` by max/min), and `finish` turns
them into the per-step values, over model tokens with engine log-probs unless said otherwise:
- `logprob_mismatch`: mean |old_logp − engine_logp|.
- `rollout_kl`: k3 estimate of KL(π_engine ‖ π_old) per token, mean of w − 1 − log w (≥ 0;
  the samples are π_engine's, and E_engine[w] = 1).
- `rollout_is_mean`, `rollout_is_min`, `rollout_is_max`: of the raw token weights, before any
  bound (so they mean the same in every mode, `off` included).
- `rollout_is_seq_mean`, `rollout_is_seq_min`, `rollout_is_seq_max`: of the raw sequence
  weights s_i, over sequences with engine log-probs.
- `rollout_masked_frac`: share of all model tokens that got no loss (weight 0);
  `rollout_masked_seq_frac`: share of sequences (with a model token) that got none at all.
- `rollout_truncated_frac`: share of all model tokens whose weight the bound changed.
A metric with nothing to average over (no engine log-probs anywhere) is None.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from marscli.errors import check_range
from marscli.registry import Registry

DEFAULT_MODE = "token-truncate"
DEFAULT_CAP = 2.0
DEFAULT_FLOOR = 0.0
_MAX_LOG_W = 20.0  # exp(20) ≈ 4.9e8: raw weights stay finite in the metrics

# fn(log_ratio [B, T], mask [B, T] bool, cap, floor) -> weights [B, T] (1 outside the mask)
WeightFn = Callable[[torch.Tensor, torch.Tensor, float, float], torch.Tensor]


@dataclass(frozen=True)
class ISMode:
    """A registered rollout-correction mode and the facts about it that callers use."""

    fn: WeightFn
    level: str | None  # "token", "sequence", or None: no correction
    masks: bool  # True: tokens outside [floor, cap] get weight 0; False: weights are clamped

    def __call__(self, log_ratio: torch.Tensor, mask: torch.Tensor, cap: float,
                 floor: float = DEFAULT_FLOOR) -> torch.Tensor:
        return self.fn(log_ratio, mask, cap, floor)


MODES: Registry[ISMode] = Registry("--rollout-is mode")


def register_mode(name: str, *, level: str | None, masks: bool):
    """Register a weight function under `name`."""
    if level not in ("token", "sequence", None):
        raise ValueError(f"mode {name!r}: level {level!r} — use token, sequence or None")

    def deco(fn: WeightFn) -> WeightFn:
        MODES.register(name)(ISMode(fn, level, masks))
        return fn

    return deco


def check(mode: str, cap: float, floor: float) -> ISMode:
    """The mode by name, with cap and floor in range (BadInput naming the option)."""
    entry = MODES.get(mode)
    check_bounds(cap, floor)
    return entry


def check_bounds(cap: float, floor: float) -> None:
    """0 < cap, 0 ≤ floor ≤ cap (BadInput naming the option)."""
    check_range("--rollout-is-cap", cap, 0, lo_open=True)
    check_range("--rollout-is-floor", floor, 0, cap)


# ----------------------------------------------------------------------------- weights


def _zero_off(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _one_off(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return torch.where(m, x, torch.ones((), dtype=x.dtype, device=x.device))


def _log_bounds(cap: float, floor: float) -> tuple[float, float]:
    return math.log(cap), (math.log(floor) if floor > 0 else -math.inf)


def seq_log_weight(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log s_i = mean_t log w_t over each sequence's masked tokens, [B]; 0 without any."""
    m = mask.bool()  # [B, T]
    n = m.sum(-1)  # [B]
    return _zero_off(log_ratio, m).sum(-1) / n.clamp(min=1)  # [B]


@register_mode("off", level=None, masks=False)
def off(log_ratio: torch.Tensor, mask: torch.Tensor, cap: float, floor: float) -> torch.Tensor:
    return torch.ones_like(log_ratio)


@register_mode("token-truncate", level="token", masks=False)
def token_truncate(log_ratio: torch.Tensor, mask: torch.Tensor, cap: float,
                   floor: float) -> torch.Tensor:
    m = mask.bool()
    hi, lo = _log_bounds(cap, floor)
    lw = _zero_off(log_ratio, m).clamp(lo, hi)  # [B, T], clamped in log space: exact at the cap
    w = torch.where(lw >= hi, torch.full_like(lw, cap), torch.exp(lw))
    w = torch.where(lw <= lo, torch.full_like(lw, floor), w) if floor > 0 else w
    return _one_off(w, m)


@register_mode("token-mask", level="token", masks=True)
def token_mask(log_ratio: torch.Tensor, mask: torch.Tensor, cap: float,
               floor: float) -> torch.Tensor:
    m = mask.bool()
    hi, lo = _log_bounds(cap, floor)
    lw = _zero_off(log_ratio, m)  # [B, T]
    keep = (lw <= hi) & (lw >= lo)  # [B, T]
    return _one_off(torch.where(keep, torch.exp(lw.clamp(max=hi)), torch.zeros_like(lw)), m)


@register_mode("sequence-truncate", level="sequence", masks=False)
def sequence_truncate(log_ratio: torch.Tensor, mask: torch.Tensor, cap: float,
                      floor: float) -> torch.Tensor:
    s = seq_log_weight(log_ratio, mask).unsqueeze(-1).expand_as(log_ratio)  # [B, T]
    return token_truncate(s, mask, cap, floor)


@register_mode("sequence-mask", level="sequence", masks=True)
def sequence_mask(log_ratio: torch.Tensor, mask: torch.Tensor, cap: float,
                  floor: float) -> torch.Tensor:
    s = seq_log_weight(log_ratio, mask).unsqueeze(-1).expand_as(log_ratio)  # [B, T]
    return token_mask(s, mask, cap, floor)


def log_ratio_of(old_logp: torch.Tensor, engine_logp: torch.Tensor,
                 has_engine: torch.Tensor) -> torch.Tensor:
    """log w = old − engine on tokens with engine log-probs, 0 elsewhere; float64, [B, T]."""
    m = has_engine.bool()
    d = old_logp.to(torch.float64) - engine_logp.to(torch.float64)
    return _zero_off(d, m)


# ----------------------------------------------------------------------------- metrics

SUM_KEYS = ("n_tok", "n_eng", "abs", "k3", "w", "n_seq", "n_seq_eng", "sw", "masked",
            "masked_seq", "truncated")
MAX_KEYS = ("w_max", "sw_max")
MIN_KEYS = ("w_min", "sw_min")
METRICS = ("logprob_mismatch", "rollout_kl", "rollout_is_mean", "rollout_is_min",
           "rollout_is_max", "rollout_is_seq_mean", "rollout_is_seq_min", "rollout_is_seq_max",
           "rollout_masked_frac", "rollout_masked_seq_frac", "rollout_truncated_frac")


def empty() -> dict[str, float]:
    """Totals of nothing: the identity of `merge`."""
    return {**dict.fromkeys(SUM_KEYS, 0.0), **dict.fromkeys(MAX_KEYS, -math.inf),
            **dict.fromkeys(MIN_KEYS, math.inf)}


def correct(old_logp: torch.Tensor, engine_logp: torch.Tensor, loss_mask: torch.Tensor,
            has_engine: torch.Tensor, mode: str = DEFAULT_MODE, cap: float = DEFAULT_CAP,
            floor: float = DEFAULT_FLOOR) -> tuple[torch.Tensor, dict[str, float]]:
    """The weights [B, T] (float64, no gradient; 1 off the model tokens with engine log-probs)
    of `mode` for π_old/π_engine, and the totals of the metrics over this batch.

    old_logp, engine_logp [B, T]; loss_mask [B, T]: the model tokens; has_engine [B, T]: the
    model tokens that carry an engine log-prob (engine_logp is ignored elsewhere)."""
    entry = MODES.get(mode)
    with torch.no_grad():
        lm = loss_mask.bool()  # [B, T]
        m = has_engine.bool() & lm  # [B, T]
        lw = log_ratio_of(old_logp, engine_logp, m)  # [B, T]
        w = entry(lw, m, cap, floor)  # [B, T]
        raw = _zero_off(torch.exp(lw.clamp(-_MAX_LOG_W, _MAX_LOG_W)), m)  # [B, T]
        k3 = _zero_off(raw - 1 - lw, m)  # [B, T]
        has_seq = m.any(-1)  # [B]
        log_s = seq_log_weight(lw, m)  # [B]
        sw = torch.exp(log_s.clamp(-_MAX_LOG_W, _MAX_LOG_W))[has_seq]  # [B']
        dropped = lm & (w == 0)  # [B, T]
        truncated = torch.zeros_like(m)
        if entry.level is not None and not entry.masks:  # the bound changed the weight
            hi, lo = _log_bounds(cap, floor)
            pre = lw if entry.level == "token" else log_s.unsqueeze(-1).expand_as(lw)
            truncated = m & ((pre > hi) | (pre < lo))
        totals = {
            "n_tok": float(lm.sum()), "n_eng": float(m.sum()),
            "abs": float(lw.abs().sum()), "k3": float(k3.sum()), "w": float(raw.sum()),
            "n_seq": float(lm.any(-1).sum()), "n_seq_eng": float(has_seq.sum()),
            "sw": float(sw.sum()), "masked": float(dropped.sum()),
            "masked_seq": float((lm.any(-1) & ~(lm & ~dropped).any(-1)).sum()),
            "truncated": float(truncated.sum()),
            "w_max": float(raw[m].max()) if m.any() else -math.inf,
            "w_min": float(raw[m].min()) if m.any() else math.inf,
            "sw_max": float(sw.max()) if sw.numel() else -math.inf,
            "sw_min": float(sw.min()) if sw.numel() else math.inf,
        }
    return w, totals


def merge(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """Totals of two batches (micro-batches, or ranks one by one)."""
    out = {k: a[k] + b[k] for k in SUM_KEYS}
    out.update({k: max(a[k], b[k]) for k in MAX_KEYS})
    out.update({k: min(a[k], b[k]) for k in MIN_KEYS})
    return out


def finish(t: dict[str, float]) -> dict[str, float | None]:
    """Totals → the per-step metrics (module docstring); None where nothing was counted."""

    def ratio(num: float, den: float) -> float | None:
        return num / den if den > 0 else None

    def bound(v: float) -> float | None:
        return v if math.isfinite(v) else None

    return {
        "logprob_mismatch": ratio(t["abs"], t["n_eng"]),
        "rollout_kl": ratio(t["k3"], t["n_eng"]),
        "rollout_is_mean": ratio(t["w"], t["n_eng"]),
        "rollout_is_min": bound(t["w_min"]),
        "rollout_is_max": bound(t["w_max"]),
        "rollout_is_seq_mean": ratio(t["sw"], t["n_seq_eng"]),
        "rollout_is_seq_min": bound(t["sw_min"]),
        "rollout_is_seq_max": bound(t["sw_max"]),
        "rollout_masked_frac": ratio(t["masked"], t["n_tok"]),
        "rollout_masked_seq_frac": ratio(t["masked_seq"], t["n_seq"]),
        "rollout_truncated_frac": ratio(t["truncated"], t["n_tok"]),
    }
