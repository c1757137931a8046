"""Batch-invariant sampling for the `hf` engine: one uniform per row, an inverse-CDF pick.

A trajectory's tokens must be a function of its request seed (`engines.request_seed`: the
stage's `--seed`, the trajectory id, the turn) and the step alone — the same tokens whether it
is sampled alone, in a batch of 32, in a shard or after a resume. A generator per row gives
that but costs an exponential over the vocabulary and a kernel call per row per step (a third
of the engine's time). Here each row draws one uniform `u = row_uniform(seed, step)`, a
counter-based hash, and the whole batch picks in one pass: the first token whose cumulative
probability exceeds `u` times the row's total mass.

vLLM's model runner V2 (`v1/worker/gpu/sample/gumbel.py`) keeps the same property with
Gumbel-max noise drawn by Philox from (seed, position) for every vocabulary entry, in a fused
GPU kernel; on CPU that is a hash per vocabulary entry per step, where the inverse CDF needs one
hash and one cumulative sum. Both are exact samplers; the inverse CDF is the faster here. The
sum is in float64, so that a token's share of [0, 1) is its probability to within ~1e-16 times
the vocabulary size, and a token of probability 0 owns an empty interval: never drawn.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

from marscli.engines import SamplingParams

_MANTISSA = 2.0 ** -53


def row_uniform(seed: int, step: int) -> float:
    """A uniform in [0, 1) that depends on (seed, step) only: 53 bits of a BLAKE2b hash."""
    h = hashlib.blake2b(struct.pack("<QQ", seed, step), digest_size=8).digest()
    return (int.from_bytes(h, "little") >> 11) * _MANTISSA


def inverse_cdf(weights: Any, uniforms: Any) -> Any:
    """Each row's token: the first index whose cumulative weight exceeds `u` × the row's sum.

    weights [B, V], non-negative and unnormalised (exp of the scores); uniforms [B] float64 in
    [0, 1). Returns [B] long. Where rounding puts `u × sum` at the sum itself, the last token of
    positive weight is taken: the second search maps any index to the first index with the
    same cumulative weight, which is the index itself for every token of positive weight."""
    import torch

    cdf = torch.cumsum(weights, -1, dtype=torch.float64)  # [B, V]
    target = (uniforms.to(cdf.device) * cdf[:, -1])[:, None]  # [B, 1]
    idx = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[-1] - 1)
    return torch.searchsorted(cdf, cdf.gather(1, idx)).squeeze(1)


class RowSampler:
    """`generate`'s last logits processor: draws each row's token (module docstring) and
    returns 0 at it and -inf elsewhere, which greedy decoding (`do_sample=False`) picks.

    Called with the scores after generate's own processors (the suppression of vision
    placeholders), it applies temperature, top-k and top-p with transformers' own warpers, in
    generate's order; the raw logits that `output_logits` records are untouched. The step is
    the number of tokens generated so far (the row's length past the prompt's width), so a turn
    draws the same uniforms whatever batch it is in."""

    def __init__(self, seeds: list[int], params: SamplingParams, prompt_width: int) -> None:
        from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        self.seeds, self.prompt_width = seeds, prompt_width
        self.warpers: list[Any] = []
        if params.temperature != 1.0:
            self.warpers.append(TemperatureLogitsWarper(params.temperature))
        if params.top_k:
            self.warpers.append(TopKLogitsWarper(top_k=params.top_k))
        if params.top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p=params.top_p))

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import torch

        for w in self.warpers:
            scores = w(input_ids, scores)
        step = input_ids.shape[1] - self.prompt_width
        uniforms = torch.tensor([row_uniform(s, step) for s in self.seeds], dtype=torch.float64)
        scores = scores.float()
        weights = torch.sub(scores, scores.amax(-1, keepdim=True)).exp_()
        picks = inverse_cdf(weights, uniforms)
        out = torch.full_like(scores, float("-inf"))
        return out.scatter_(1, picks[:, None], 0.0)
