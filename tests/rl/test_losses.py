"""Policy losses against hand derivations, and their invariances (padding, clipping)."""

from __future__ import annotations

import math

import pytest
import torch

from marscli.errors import BadInput
from marscli.rl.losses import LOSSES, add_kl, aggregate, grpo_loss, gspo_loss, kl_k3

F64 = torch.float64
CLIPS = [(3e-4, 4e-4), (0.2, 0.28)]  # GSPO paper; DAPO-style clip-higher


def leaf(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64, requires_grad=True)


# small fixed batch: B = 2, T = 3, the last token of row 0 is padding (with a junk value)
LOGP = [[-1.0, -2.0, 9.9], [-0.5, -1.5, -2.5]]
OLD = [[-1.1, -1.95, 0.0], [-0.45, -1.5, -2.6]]
MASK = [[1, 1, 0], [1, 1, 1]]
ADV = [1.0, -0.5]


def test_registry():
    assert set(LOSSES.names()) == {"gspo", "grpo"}
    with pytest.raises(BadInput, match="gspo"):
        LOSSES.get("ppo")


def test_gspo_loss_and_gradient_by_hand():
    lp = leaf(LOGP)
    loss, m = gspo_loss(lp, torch.tensor(OLD, dtype=F64), torch.tensor(ADV, dtype=F64),
                        torch.tensor(MASK), 0.2, 0.28)
    loss.backward()
    # log s_0 = ((−1 + 1.1) + (−2 + 1.95)) / 2 = 0.025; log s_1 = (−0.05 + 0 + 0.1) / 3 = 1/60
    s0, s1 = math.exp(0.025), math.exp(1 / 60)
    # every token of sequence i carries −A_i s_i; token mean, then mean over the 2 sequences
    assert loss.item() == pytest.approx((-1.0 * s0 + 0.5 * s1) / 2, rel=1e-12)
    # d loss / d logp[i, t] = (1/2) · (−A_i s_i) · (1/n_i) on model tokens, 0 on padding
    want = [[-s0 / 4, -s0 / 4, 0.0], [s1 / 12, s1 / 12, s1 / 12]]
    torch.testing.assert_close(lp.grad, torch.tensor(want, dtype=F64), rtol=1e-12, atol=1e-14)
    assert m["clip_frac"] == 0.0
    assert m["ratio_min"] == pytest.approx(s1) and m["ratio_max"] == pytest.approx(s0)
    assert m["kl_old"] == pytest.approx((-0.1 + 0.05 + 0.05 - 0.0 - 0.1) / 5)


def test_gspo_gradient_equals_sequence_level_gspo():
    torch.manual_seed(0)
    B, T = 5, 7
    old = torch.randn(B, T, dtype=F64) - 2
    mask = torch.rand(B, T) < 0.7
    mask[:, 0] = True
    base = old + 0.01 * torch.randn(B, T, dtype=F64)
    adv = torch.randn(B, dtype=F64)
    lp1, lp2 = base.clone().requires_grad_(), base.clone().requires_grad_()
    gspo_loss(lp1, old, adv, mask, 0.2, 0.28)[0].backward()
    # sequence-level GSPO written independently: mean_i −A_i exp(mean_t(logp − old))
    n = mask.sum(-1)
    s = torch.exp(((lp2 - old) * mask).sum(-1) / n)
    (-(adv * s)).mean().backward()
    torch.testing.assert_close(lp1.grad, lp2.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("clip", CLIPS)
def test_gspo_equals_token_ppo_for_length_one(clip):
    torch.manual_seed(1)
    B = 16
    old = torch.randn(B, 1, dtype=F64)
    base = old + torch.linspace(-1.5, 1.5, B, dtype=F64).unsqueeze(-1) * clip[1]  # some clipped
    adv = torch.randn(B, dtype=F64)
    mask = torch.ones(B, 1)
    a, b = base.clone().requires_grad_(), base.clone().requires_grad_()
    la, ma = gspo_loss(a, old, adv, mask, *clip)
    lb, mb = grpo_loss(b, old, adv, mask, *clip, agg="seq-mean-token-mean")
    la.backward()
    lb.backward()
    torch.testing.assert_close(la, lb)
    torch.testing.assert_close(a.grad, b.grad)
    assert 0 < ma["clip_frac"] == mb["clip_frac"] < 1


@pytest.mark.parametrize("name, agg", [("gspo", None), ("grpo", "seq-mean-token-mean"),
                                       ("grpo", "token-mean")])
def test_padding_columns_and_rows_change_nothing(name, agg):
    fn = LOSSES.get(name)
    torch.manual_seed(2)
    old = torch.randn(3, 4, dtype=F64)
    base = old + 0.05 * torch.randn(3, 4, dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    adv = torch.tensor([0.5, -1.0, 2.0], dtype=F64)
    a = base.clone().requires_grad_()
    la, ma = fn(a, old, adv, mask, 0.2, 0.28, agg=agg)
    la.backward()
    # two junk padding columns (NaN and inf) and a padding row with no model token
    pad = torch.tensor([[float("nan"), float("inf")]] * 3, dtype=F64)
    big = torch.cat([torch.cat([base, pad], 1), torch.full((1, 6), float("nan"), dtype=F64)])
    old_big = torch.cat([torch.cat([old, pad], 1), torch.zeros(1, 6, dtype=F64)])
    mask_big = torch.cat([torch.cat([mask, torch.zeros(3, 2, dtype=mask.dtype)], 1),
                          torch.zeros(1, 6, dtype=mask.dtype)])
    b = big.clone().requires_grad_()
    lb, mb = fn(b, old_big, torch.cat([adv, torch.tensor([9.0], dtype=F64)]), mask_big,
                0.2, 0.28, agg=agg)
    lb.backward()
    torch.testing.assert_close(la, lb)
    torch.testing.assert_close(b.grad[:3, :4], a.grad)
    assert torch.count_nonzero(b.grad[3]) == 0 and torch.count_nonzero(b.grad[:, 4:]) == 0
    assert ma == pytest.approx(mb)


@pytest.mark.parametrize("name", ["gspo", "grpo"])
def test_no_model_tokens_gives_zero_not_nan(name):
    lp = leaf([[0.3, -1.0]])
    loss, m = LOSSES.get(name)(lp, torch.zeros(1, 2, dtype=F64), torch.ones(1, dtype=F64),
                               torch.zeros(1, 2), 0.2, 0.28)
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(lp.grad) == 0
    assert all(math.isfinite(v) for v in m.values())


@pytest.mark.parametrize("clip", CLIPS)
@pytest.mark.parametrize("name", ["gspo", "grpo"])
def test_clipped_sequences_get_no_gradient(name, clip):
    lo, hi = clip
    old = torch.zeros(4, 2, dtype=F64)
    # per-token log ratios with the same value on both tokens, so GSPO and GRPO see one ratio
    lr = [math.log(1 + 2 * hi), math.log(1 - 2 * lo), math.log(1 + hi / 2), math.log(1 + 2 * hi)]
    lp = leaf([[x, x] for x in lr])
    # seq 0: ratio above 1 + hi, A > 0 → clipped; seq 1: below 1 − lo, A < 0 → clipped;
    # seq 2: inside the range → live; seq 3: above 1 + hi but A < 0 → not clipped (pessimistic)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=F64)
    loss, m = LOSSES.get(name)(lp, old, adv, torch.ones(4, 2), lo, hi)
    loss.backward()
    assert torch.count_nonzero(lp.grad[:2]) == 0
    assert (lp.grad[2] < 0).all() and (lp.grad[3] > 0).all()
    assert m["clip_frac"] == pytest.approx(0.5)
    assert (m["ratio_max"] == pytest.approx(1 + 2 * hi)
            and m["ratio_min"] == pytest.approx(1 - 2 * lo))
    # the clipped sequences contribute −A · clip(s) to the loss value
    per_seq = [-(1 + hi), (1 - lo), -(1 + hi / 2), (1 + 2 * hi)]
    assert loss.item() == pytest.approx(sum(per_seq) / 4, rel=1e-12)


def test_grpo_token_mean_by_hand():
    lp = leaf(LOGP)
    loss, _ = grpo_loss(lp, torch.tensor(OLD, dtype=F64), torch.tensor(ADV, dtype=F64),
                        torch.tensor(MASK), 0.2, 0.28)
    loss.backward()
    r = [[math.exp(0.1), math.exp(-0.05)], [math.exp(-0.05), 1.0, math.exp(0.1)]]
    want = (-(r[0][0] + r[0][1]) + 0.5 * (r[1][0] + r[1][1] + r[1][2])) / 5
    assert loss.item() == pytest.approx(want, rel=1e-12)
    g = [[-r[0][0] / 5, -r[0][1] / 5, 0.0], [0.5 * x / 5 for x in r[1]]]
    torch.testing.assert_close(lp.grad, torch.tensor(g, dtype=F64), rtol=1e-12, atol=1e-14)


def test_grpo_rollout_weights_by_hand():
    """Rollout-correction weights multiply each token's loss (a token whose π_old/π_engine is 3
    under cap 2 weighs 2; a masked one 0); the ratio metrics do not see them."""
    w = [[2.0, 0.0, 7.0], [1.0, 0.5, 1.0]]  # the padding column's 7 must change nothing
    lp = leaf(LOGP)
    loss, m = grpo_loss(lp, torch.tensor(OLD, dtype=F64), torch.tensor(ADV, dtype=F64),
                        torch.tensor(MASK), 0.2, 0.28, weights=torch.tensor(w, dtype=F64))
    loss.backward()
    r = [[math.exp(0.1), math.exp(-0.05)], [math.exp(-0.05), 1.0, math.exp(0.1)]]
    want = (-(2 * r[0][0] + 0 * r[0][1]) + 0.5 * (r[1][0] + 0.5 * r[1][1] + r[1][2])) / 5
    assert loss.item() == pytest.approx(want, rel=1e-12)
    g = [[-2 * r[0][0] / 5, 0.0, 0.0], [0.5 * r[1][0] / 5, 0.25 * r[1][1] / 5, 0.5 * r[1][2] / 5]]
    torch.testing.assert_close(lp.grad, torch.tensor(g, dtype=F64), rtol=1e-12, atol=1e-14)
    _, plain = grpo_loss(leaf(LOGP), torch.tensor(OLD, dtype=F64), torch.tensor(ADV, dtype=F64),
                         torch.tensor(MASK), 0.2, 0.28)
    assert m == plain


@pytest.mark.parametrize("name", ["gspo", "grpo"])
def test_unit_weights_change_no_bit(name):
    args = (torch.tensor(OLD, dtype=F64), torch.tensor(ADV, dtype=F64), torch.tensor(MASK),
            0.2, 0.28)
    a, b = leaf(LOGP), leaf(LOGP)
    la, _ = LOSSES.get(name)(a, *args)
    lb, _ = LOSSES.get(name)(b, *args, weights=torch.ones(2, 3, dtype=F64))
    la.backward()
    lb.backward()
    assert la.item() == lb.item() and torch.equal(a.grad, b.grad)


def test_unknown_aggregation():
    with pytest.raises(BadInput, match="seq-mean-token-mean"):
        aggregate(torch.zeros(1, 1), torch.ones(1, 1), "sum")


def test_kl_k3():
    torch.manual_seed(3)
    lp = torch.randn(4, 6, dtype=F64)
    ref = lp + torch.randn(4, 6, dtype=F64)
    mask = torch.rand(4, 6) < 0.6
    k = kl_k3(lp, ref, mask)
    assert (k >= 0).all() and (k[~mask] == 0).all() and (k[mask] > 0).all()
    assert torch.count_nonzero(kl_k3(lp, lp.clone(), torch.ones(4, 6))) == 0
    d = ref[0, 0] - lp[0, 0]
    assert kl_k3(lp, ref, torch.ones(4, 6))[0, 0].item() == pytest.approx(
        (torch.exp(d) - d - 1).item())
    loss, m = add_kl(torch.tensor(1.0, dtype=F64), {"clip_frac": 0.0}, lp, ref, mask, 0.1)
    assert m["kl_ref"] == pytest.approx(k[mask].mean().item())
    assert loss.item() == pytest.approx(1.0 + 0.1 * m["kl_ref"])
    assert m["clip_frac"] == 0.0
