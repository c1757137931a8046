"""The hf engine's sampler and KV cache (engines/sampling.py, engines/kv_cache.py): draws that
follow the probabilities, never a token of probability 0, temperature/top-k/top-p as
transformers applies them, a row's tokens the same alone and in a batch of 32, and a cache
that changes no token and no log-prob."""

from __future__ import annotations

import hashlib
import struct

import pytest
import torch

from marscli.engines import GenRequest, SamplingParams
from marscli.engines.sampling import RowSampler, inverse_cdf, row_uniform

from helpers import ROOT

N_DRAWS = 20_000


def draws(scores: torch.Tensor, params: SamplingParams, n: int = N_DRAWS) -> torch.Tensor:
    """`n` tokens drawn by RowSampler from one row of scores: n rows of seeds 0..n-1, step 0."""
    sampler = RowSampler(list(range(n)), params, prompt_width=3)
    mask = sampler(torch.zeros(n, 3, dtype=torch.long), scores.expand(n, -1).clone())
    assert bool(((mask == 0).sum(-1) == 1).all()), "one token per row, the rest -inf"
    return mask.argmax(-1)


def total_variation(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    freq = torch.bincount(tokens, minlength=len(probs)).double() / len(tokens)
    return 0.5 * float((freq - probs.double()).abs().sum())


# With 20,000 draws over ≤ 8 tokens the expected total variation is ~0.008; 0.025 is > 5 sigma
# away, and a sampler off by one token or ignoring a warper is off by far more.
TV_BOUND = 0.025
SCORES = torch.tensor([2.0, 0.5, float("-inf"), 1.0, -1.0, 0.0, float("-inf"), 1.5])


def test_row_uniform_is_a_hash_of_seed_and_step_alone():
    h = hashlib.blake2b(struct.pack("<QQ", 7, 3), digest_size=8).digest()
    assert row_uniform(7, 3) == (int.from_bytes(h, "little") >> 11) / 2 ** 53
    us = [row_uniform(s, t) for s in range(50) for t in range(40)]
    assert len(set(us)) == len(us) and all(0 <= u < 1 for u in us)
    assert abs(sum(us) / len(us) - 0.5) < 0.02


def test_draws_follow_the_probabilities_and_never_a_zero():
    tokens = draws(SCORES, SamplingParams())
    probs = torch.softmax(SCORES, -1)
    assert total_variation(tokens, probs) < TV_BOUND
    assert not bool(((tokens == 2) | (tokens == 6)).any()), "a token of probability 0 was drawn"


@pytest.mark.parametrize("u", [0.0, 1 - 2 ** -53])
def test_the_ends_of_the_unit_interval_pick_positive_tokens(u):
    """u = 0 and the largest u below 1 land on the first and the last token of positive
    weight, also where zeros lead or trail the row (rounding puts u × sum at the sum)."""
    weights = torch.tensor([[0.0, 0.0, 1e-30, 3.0, 0.0, 2.0, 0.0, 0.0]] * 2)
    weights[1, 2] = 0.0
    picks = inverse_cdf(weights, torch.tensor([u, u], dtype=torch.float64))
    expected = [2, 3] if u == 0 else [5, 5]
    assert picks.tolist() == expected


@pytest.mark.parametrize("params, warper", [
    (SamplingParams(temperature=0.5), lambda s: s / 0.5),
    (SamplingParams(top_k=2), lambda s: s.masked_fill(s < s.topk(2).values[-1], -float("inf"))),
    (SamplingParams(top_p=0.7), None),
])
def test_temperature_top_k_and_top_p_as_transformers_applies_them(params, warper):
    if warper is None:  # top-p 0.7 on SCORES: the two most likely tokens hold 0.67 < 0.7, so
        # the nucleus is the three most likely (transformers keeps the token that crosses p)
        keep = torch.softmax(SCORES, -1).argsort(descending=True)[:3]
        warped = torch.full_like(SCORES, -float("inf"))
        warped[keep] = SCORES[keep]
    else:
        warped = warper(SCORES)
    tokens = draws(SCORES, params)
    probs = torch.softmax(warped, -1)
    assert total_variation(tokens, probs) < TV_BOUND
    assert bool((probs[tokens] > 0).all()), "a token outside the warped support was drawn"


def test_the_step_is_the_length_past_the_prompt():
    """Step t of a row draws row_uniform(seed, t), whatever the prompt's width."""
    weights = torch.ones(1, 1000)
    for width, length in [(3, 3), (3, 10), (50, 57)]:
        sampler = RowSampler([11], SamplingParams(), prompt_width=width)
        pick = int(sampler(torch.zeros(1, length, dtype=torch.long), weights.log()).argmax())
        assert pick == int(row_uniform(11, length - width) * 1000)


# ----------------------------------------------------------------------- on the tiny model


@pytest.fixture(scope="module")
def engine(tiny_model):
    from marscli.engines import make_engine

    return make_engine("hf", str(tiny_model), max_batch=32)


@pytest.fixture(scope="module")
def demo_base():
    """The demo's pre-trained base: unlike the random tiny model, greedy decoding writes on."""
    from marscli.engines import make_engine

    return make_engine("hf", str(ROOT / "recipes" / "tiny-vlm"), max_batch=32)


def requests(engine, n: int) -> list[GenRequest]:
    """n keyed requests with prompts of different lengths (so a batch pads them)."""
    from marscli.qwen.tokens import special_ids

    tok = engine.processor.tokenizer
    ids = special_ids(tok)
    prompts = [tok.encode("word " * (1 + 5 * (k % 7)) + f"question {k}") for k in range(n)]
    return [GenRequest([ids.im_start, *p, ids.im_end], max_new_tokens=12 + k % 5, key=f"t{k}",
                       turn=k % 3) for k, p in enumerate(prompts)]


@pytest.mark.slow
def test_a_row_samples_the_same_alone_and_in_a_batch_of_32(engine):
    reqs = requests(engine, 32)
    params = SamplingParams(temperature=1.0, seed=5)
    batched = engine.generate(reqs, params)
    alone = [engine.generate([r], params)[0] for r in reqs[::4]]
    assert [g.tokens for g in alone] == [g.tokens for g in batched[::4]]
    assert len({tuple(g.tokens) for g in batched}) > 24, "rows must draw apart"
    other_seed = engine.generate(reqs[:8], SamplingParams(temperature=1.0, seed=6))
    assert [g.tokens for g in other_seed] != [g.tokens for g in batched[:8]]


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_preallocated_cache_changes_no_token_and_no_logprob(demo_base, monkeypatch,
                                                                temperature):
    """Against transformers' own DynamicCache (grown by torch.cat): tokens equal, raw
    log-probs within 1e-5."""
    from transformers import DynamicCache

    import marscli.engines.kv_cache as kv_cache

    reqs = requests(demo_base, 8)
    params = SamplingParams(temperature=temperature, seed=1)
    ours = demo_base.generate(reqs, params)
    monkeypatch.setattr(kv_cache, "preallocated_cache", lambda *a: DynamicCache())
    theirs = demo_base.generate(reqs, params)
    assert [g.tokens for g in ours] == [g.tokens for g in theirs]
    diff = max(abs(a - b) for g, h in zip(ours, theirs) for a, b in zip(g.logprobs, h.logprobs))
    assert diff <= 1e-5
    assert sum(len(g.tokens) for g in ours) > 40, "enough tokens to compare"


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nan_or_a_positive_inf_anywhere_in_the_batch_is_refused(bad):
    from marscli.engines.hf import FiniteLogits
    from marscli.errors import RuntimeFailure

    check = FiniteLogits("ckpt-3")
    scores = torch.zeros(4, 10)
    scores[:, 2] = float("-inf")  # suppressed placeholders: allowed
    assert check(None, scores) is scores
    scores[3, 7] = bad
    with pytest.raises(RuntimeFailure, match="ckpt-3: the model's logits are not finite"):
        check(None, scores)
