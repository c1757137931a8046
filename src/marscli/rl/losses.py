"""Policy losses for `update` (torch; import this module lazily).

Every entry of `LOSSES` is a `Loss`: called with one signature,
`loss(logp, old_logp, advantages, mask, clip_low, clip_high, agg=None, weights=None) -> (loss,
metrics)`, with logp, old_logp, mask [B, T] (mask 1 on model tokens, 0 on prompt, tool and
padding tokens), advantages [B] (one per trajectory), loss a scalar tensor and metrics plain
floats. `weights` [B, T] (no gradient), when given, multiplies each token's policy loss before
aggregation: the rollout-correction weights of `marscli.rl.rollout_correction`; None leaves the loss
exactly as it was (the ratio and clip metrics never see the weights). The entry
carries what callers need to know about the loss, so no caller names one: `agg`, its default
aggregation (the default of its function's `agg` parameter), and `ratio`, the level of its
ratio metrics ("sequence" or "token"). `micro_weight` turns an aggregate over one micro-batch
into its share of the minibatch's.

- `gspo` (the paper's BN-GSPO loss, with the BN in `marscli.rl.advantages`): the sequence ratio
  s_i = exp(mean_t(logp − old_logp)) over model tokens, applied in the GSPO-token form
  s_it = sg(s_i) · π(y_t) / sg(π(y_t)), clipped to [1 − clip_low, 1 + clip_high] PPO-style.
  Its gradient equals that of −A_i·s_i (GSPO paper, eq. 10 vs 14) while the ratio is unclipped.
- `grpo`: token ratios exp(logp − old_logp), same clipping (PPO / DAPO clip-higher).

Where marscli departs from the paper or the released code (verl `core_algos.py`), and why:
1. Masked positions are zeroed with `torch.where` before any arithmetic, not multiplied by the
   mask afterwards, so NaN or inf in padding cannot leak into the loss or the gradient.
2. "seq-mean-token-mean" averages over sequences that have at least one model token; rows
   without one (padding, a trajectory cut before the model spoke) are left out, not counted as
   zeros, so padding rows never change the loss.
3. "token-mean" divides by the model tokens of this call. Normalising by the token count of the
   whole step across gradient accumulation and data-parallel ranks is the trainer's job.
4. The GSPO sequence length |y_i| counts model tokens only: in a multi-turn trajectory the tool
   responses are not the policy's actions (the released multi-turn code masks them the same way).
5. `clip_frac` counts tokens where the clipped branch wins, on either side (verl's GSPO loss
   reports a lower-side clip fraction of 0); ratio metrics are per sequence for GSPO and per token
   for GRPO.
6. A KL penalty to a reference policy is optional (`add_kl`, k3 estimator); recipes choose the
   coefficient, and 0 skips the reference model.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from marscli.errors import BadInput
from marscli.registry import Registry

AGGS = ("token-mean", "seq-mean-token-mean")
RATIO_LEVELS = {"token": "token-mean", "sequence": "seq-mean-token-mean"}  # level → weighting
_MAX_LOG_RATIO = 10.0  # as the released code: exp(10) ≈ 2.2e4 keeps the loss finite


@dataclass(frozen=True)
class Loss:
    """A registered policy loss and the facts about it that callers use."""

    fn: Callable[..., tuple[torch.Tensor, dict[str, float]]]
    ratio: str  # "sequence" or "token": what one ratio metric (ratio_mean, min, max) is over

    @property
    def agg(self) -> str:
        """The default aggregation: the default of the function's `agg` parameter."""
        return inspect.signature(self.fn).parameters["agg"].default

    @property
    def ratio_agg(self) -> str:
        """The aggregation that weighs ratio metrics over micro-batches (per sequence or per
        token)."""
        return RATIO_LEVELS[self.ratio]

    def __call__(self, logp, old_logp, advantages, mask, clip_low, clip_high, agg=None,
                 weights=None):
        return self.fn(logp, old_logp, advantages, mask, clip_low, clip_high,
                       agg=agg or self.agg, weights=weights)


LOSSES: Registry[Loss] = Registry("loss")


def register_loss(name: str, *, ratio: str):
    """Register a loss function under `name` (its ratio metrics at level `ratio`)."""
    if ratio not in RATIO_LEVELS:
        raise ValueError(f"loss {name!r}: ratio level {ratio!r} — use one of {list(RATIO_LEVELS)}")

    def deco(fn):
        LOSSES.register(name)(Loss(fn, ratio))
        return fn

    return deco


def _prep(logp: torch.Tensor, other: torch.Tensor, mask: torch.Tensor):
    """Bool mask [B, T] and both log-prob tensors zeroed outside it, in at least float32."""
    m = mask.bool()  # [B, T]
    dt = torch.promote_types(logp.dtype, torch.float32)
    zero = torch.zeros((), dtype=dt, device=logp.device)
    return m, torch.where(m, logp.to(dt), zero), torch.where(m, other.to(dt), zero)


def aggregate(values: torch.Tensor, mask: torch.Tensor, agg: str) -> torch.Tensor:
    """Reduce per-token values [B, T] over the model tokens: "token-mean" or
    "seq-mean-token-mean"."""
    m = mask.bool()  # [B, T]
    v = torch.where(m, values, torch.zeros((), dtype=values.dtype, device=values.device))
    if agg == "token-mean":
        return v.sum() / m.sum().clamp(min=1)
    if agg == "seq-mean-token-mean":
        n = m.sum(-1)  # [B]
        seq = v.sum(-1) / n.clamp(min=1)  # [B]
        return seq.sum() / (n > 0).sum().clamp(min=1)
    raise BadInput(f"unknown loss aggregation {agg!r} — choose one of: {', '.join(AGGS)}")


def micro_weight(loss_mask: torch.Tensor, agg: str, n_tokens: int, n_seqs: int) -> float:
    """The factor that turns a loss aggregated over one micro-batch into its share of the loss
    over the whole minibatch (n_tokens model tokens in n_seqs sequences, all ranks):
    token-mean → the micro-batch's model tokens / n_tokens (each token weighs 1/n_tokens);
    seq-mean-token-mean → its sequences / n_seqs (each sequence weighs 1/n_seqs)."""
    if agg == "token-mean":
        return float(loss_mask.sum()) / n_tokens
    if agg == "seq-mean-token-mean":
        return float((loss_mask.sum(-1) > 0).sum()) / n_seqs
    raise BadInput(f"unknown loss aggregation {agg!r} — choose one of: {', '.join(AGGS)}")


def _clipped(ratio: torch.Tensor, adv: torch.Tensor, m: torch.Tensor, clip_low: float,
             clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO token losses max(−A·r, −A·clip(r)) [B, T] and the bool map of clipped tokens."""
    a = adv.to(ratio.dtype).unsqueeze(-1)  # [B, 1]
    l1 = -a * ratio  # [B, T]
    l2 = -a * ratio.clamp(1 - clip_low, 1 + clip_high)  # [B, T]
    return torch.maximum(l1, l2), (l2 > l1) & m


def _weighted(losses: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """Token losses [B, T] times the (detached) per-token weights [B, T], if any."""
    return losses if weights is None else losses * weights.detach().to(losses.dtype)


def _stats(r: torch.Tensor) -> dict[str, float]:
    if r.numel() == 0:
        return {"ratio_mean": 1.0, "ratio_min": 1.0, "ratio_max": 1.0}
    return {"ratio_mean": r.mean().item(), "ratio_min": r.min().item(), "ratio_max": r.max().item()}


def _metrics(clipped: torch.Tensor, m: torch.Tensor, lp: torch.Tensor, old: torch.Tensor,
             ratios: torch.Tensor) -> dict[str, float]:
    n = m.sum().clamp(min=1)
    with torch.no_grad():
        return {"clip_frac": (clipped.sum() / n).item(),
                "kl_old": ((old - lp).sum() / n).item(),  # zero outside the mask already
                **_stats(ratios.detach())}


@register_loss("gspo", ratio="sequence")
def gspo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, clip_low: float, clip_high: float,
              agg: str = "seq-mean-token-mean", weights: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO-token loss; `agg` defaults to "seq-mean-token-mean" (the GSPO objective)."""
    m, lp, old = _prep(logp, old_logp, mask)
    n = m.sum(-1)  # [B]
    log_s = (lp - old).sum(-1) / n.clamp(min=1)  # [B] log s_i, 0 for rows without model tokens
    log_st = (log_s.detach().unsqueeze(-1) + lp - lp.detach()).clamp(max=_MAX_LOG_RATIO)  # [B, T]
    losses, clipped = _clipped(torch.exp(log_st), advantages, m, clip_low, clip_high)
    loss = aggregate(_weighted(losses, weights), m, agg)
    return loss, _metrics(clipped, m, lp, old, torch.exp(log_s[n > 0]))


@register_loss("grpo", ratio="token")
def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, clip_low: float, clip_high: float,
              agg: str = "token-mean", weights: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip loss on token ratios; `agg` defaults to "token-mean"."""
    m, lp, old = _prep(logp, old_logp, mask)
    ratio = torch.exp((lp - old).clamp(max=_MAX_LOG_RATIO))  # [B, T]
    losses, clipped = _clipped(ratio, advantages, m, clip_low, clip_high)
    loss = aggregate(_weighted(losses, weights), m, agg)
    return loss, _metrics(clipped, m, lp, old, ratio[m])


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(π‖π_ref): exp(ref − logp) − (ref − logp) − 1 ≥ 0, [B, T],
    zero outside the mask."""
    m, lp, ref = _prep(logp, ref_logp, mask)
    d = (ref - lp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)  # [B, T]
    return torch.where(m, torch.exp(d) - d - 1, torch.zeros((), dtype=d.dtype, device=d.device))


def add_kl(loss: torch.Tensor, metrics: dict[str, float], logp: torch.Tensor,
           ref_logp: torch.Tensor, mask: torch.Tensor, coef: float,
           agg: str = "token-mean") -> tuple[torch.Tensor, dict[str, float]]:
    """loss + coef · k3 KL to the reference, aggregated like the policy loss; adds `kl_ref`."""
    kl = aggregate(kl_k3(logp, ref_logp, mask), mask, agg)
    return loss + coef * kl, {**metrics, "kl_ref": kl.item()}
