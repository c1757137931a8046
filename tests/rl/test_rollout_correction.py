"""Rollout correction (marscli.rl.rollout_correction) against hand-computed numbers: the weights
of every mode, the bounds, null engine log-probs, and the metrics of a simulated mismatch
(engine log-probs perturbed by known offsets); then `update` end to end on the tiny model's hf
rollouts, as the engine wrote them and perturbed, with `--old-logp engine`, `--rollout-is off`
and masked rows."""

from __future__ import annotations

import math
from pathlib import Path

import orjson
import pytest
import torch

from marscli.errors import BadInput
from marscli.rl.rollout_correction import (
    DEFAULT_CAP,
    DEFAULT_MODE,
    METRICS,
    MODES,
    check,
    correct,
    empty,
    finish,
    merge,
)

from helpers import marscli, max_diff, read_jsonl, trajectory, weights, write_jsonl, write_prompts

LN3, LN2 = math.log(3.0), math.log(2.0)


def run(log_w: list[list[float]], mode: str, cap: float = 2.0, floor: float = 0.0,
        loss_mask=None, has_engine=None):
    """Weights and metrics for given log(π_old/π_engine) [B, T] (old = 0, engine = −log w)."""
    lw = torch.tensor(log_w, dtype=torch.float64)  # [B, T]
    old = torch.zeros_like(lw)
    lm = (torch.ones_like(lw, dtype=torch.bool) if loss_mask is None
          else torch.tensor(loss_mask).bool())
    he = lm if has_engine is None else torch.tensor(has_engine).bool()
    w, totals = correct(old, old - lw, lm, he, mode, cap, floor)
    return w, finish(totals)


# ----------------------------------------------------------------------------- weights


def test_a_ratio_of_3_under_cap_2_weighs_2_truncated_and_nothing_masked():
    w, m = run([[LN3, 0.0]], "token-truncate")
    assert w.tolist() == [[2.0, 1.0]]
    assert m["rollout_truncated_frac"] == 0.5 and m["rollout_masked_frac"] == 0.0
    w, m = run([[LN3, 0.0]], "token-mask")
    assert w.tolist() == [[0.0, 1.0]]
    assert m["rollout_masked_frac"] == 0.5 and m["rollout_truncated_frac"] == 0.0
    assert m["rollout_masked_seq_frac"] == 0.0  # the sequence kept one token


def test_weights_inside_the_bounds_are_the_ratio_itself():
    lw = [[math.log(1.5), math.log(0.5), 0.0]]
    for mode in ("token-truncate", "token-mask"):
        w, _ = run(lw, mode)
        assert w[0].tolist() == pytest.approx([1.5, 0.5, 1.0], abs=1e-15)


def test_floor_clamps_when_truncating_and_drops_when_masking():
    lw = [[math.log(0.25), math.log(0.6), LN3]]
    w, _ = run(lw, "token-truncate", cap=2.0, floor=0.5)
    assert w[0].tolist() == pytest.approx([0.5, 0.6, 2.0], abs=1e-15)
    w, m = run(lw, "token-mask", cap=2.0, floor=0.5)
    assert w[0].tolist() == pytest.approx([0.0, 0.6, 0.0], abs=1e-15)
    assert m["rollout_masked_frac"] == pytest.approx(2 / 3)


def test_sequence_modes_use_the_geometric_mean_of_the_model_tokens():
    # tokens with w = 2 and 8, and a prompt token (off the loss mask) with a wild value:
    # s = exp((ln 2 + ln 8) / 2) = 4 on every model token of the sequence
    lw = [[LN2, math.log(8.0), 50.0], [0.0, math.log(1.21), 0.0]]
    lm = [[1, 1, 0], [1, 1, 0]]
    w, m = run(lw, "sequence-truncate", cap=2.0, loss_mask=lm)
    assert w[0, :2].tolist() == [2.0, 2.0] and w[0, 2] == 1.0
    assert w[1, :2].tolist() == pytest.approx([1.1, 1.1], abs=1e-15)  # sqrt(1.21)
    assert m["rollout_is_seq_max"] == pytest.approx(4.0)
    assert m["rollout_is_seq_min"] == pytest.approx(1.1)
    assert m["rollout_is_seq_mean"] == pytest.approx((4.0 + 1.1) / 2)
    assert m["rollout_truncated_frac"] == 0.5  # the two tokens of sequence 0, of four
    w, m = run(lw, "sequence-mask", cap=5.0, loss_mask=lm)
    assert w[0, :2].tolist() == pytest.approx([4.0, 4.0]) and m["rollout_masked_frac"] == 0.0
    w, m = run(lw, "sequence-mask", cap=3.0, loss_mask=lm)
    assert w[0, :2].tolist() == [0.0, 0.0]
    assert m["rollout_masked_frac"] == 0.5 and m["rollout_masked_seq_frac"] == 0.5


def test_off_is_exactly_one_and_changes_nothing():
    w, m = run([[LN3, -5.0, 7.0]], "off")
    assert w.tolist() == [[1.0, 1.0, 1.0]]
    assert m["rollout_masked_frac"] == 0.0 and m["rollout_truncated_frac"] == 0.0
    assert m["rollout_is_max"] == pytest.approx(math.exp(7.0))  # metrics still measure it


def test_null_engine_logprobs_weigh_one_and_are_not_measured():
    nan = float("nan")
    old = torch.tensor([[-1.0, -2.0, -3.0]], dtype=torch.float64)
    eng = torch.tensor([[-1.0 - LN3, nan, nan]], dtype=torch.float64)  # two tokens have none
    lm = torch.tensor([[1, 1, 0]]).bool()
    he = torch.tensor([[1, 0, 0]]).bool()
    for mode in MODES.names():
        w, t = correct(old, eng, lm, he, mode, 2.0)
        assert torch.isfinite(w).all() and w[0, 1:].tolist() == [1.0, 1.0], mode
    w, t = correct(old, eng, lm, he, "token-truncate", 2.0)
    m = finish(t)
    assert w[0, 0] == 2.0
    assert m["logprob_mismatch"] == pytest.approx(LN3)
    assert m["rollout_is_max"] == pytest.approx(3.0)
    assert m["rollout_truncated_frac"] == 0.5  # one of the two model tokens
    _, t = correct(old, eng, lm, torch.zeros_like(he), "token-mask", 2.0)
    m = finish(t)
    assert all(m[k] is None for k in ("logprob_mismatch", "rollout_kl", "rollout_is_mean",
                                      "rollout_is_max", "rollout_is_seq_mean"))
    assert m["rollout_masked_frac"] == 0.0


# ----------------------------------------------------------------------------- metrics


def test_simulated_mismatch_gives_exact_metrics():
    """Engine log-probs = old − δ with known offsets δ (so w = e^δ): every metric is a formula
    of the δs, computed here by hand."""
    old = torch.tensor([[-0.5, -1.0, -2.0, -0.1], [-3.0, -0.7, -1.5, -9.0]], dtype=torch.float64)
    delta = [[0.1, -0.2, LN3, 0.0], [-0.3, 0.05, 0.0, 0.0]]
    lm = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]).bool()  # the last token: padding
    d = torch.tensor(delta, dtype=torch.float64)
    w, t = correct(old, old - d, lm, lm, "token-truncate", 2.0)
    m = finish(t)
    ds = [0.1, -0.2, LN3, 0.0, -0.3, 0.05, 0.0]  # the seven model tokens
    assert m["logprob_mismatch"] == pytest.approx(sum(abs(x) for x in ds) / 7, abs=1e-12)
    assert m["rollout_kl"] == pytest.approx(sum(math.exp(x) - 1 - x for x in ds) / 7, abs=1e-12)
    assert m["rollout_is_mean"] == pytest.approx(sum(math.exp(x) for x in ds) / 7, abs=1e-12)
    assert m["rollout_is_max"] == pytest.approx(3.0)
    assert m["rollout_is_min"] == pytest.approx(math.exp(-0.3))
    s0, s1 = math.exp((0.1 - 0.2 + LN3) / 4), math.exp((-0.3 + 0.05) / 3)
    assert m["rollout_is_seq_mean"] == pytest.approx((s0 + s1) / 2, abs=1e-12)
    assert m["rollout_truncated_frac"] == pytest.approx(1 / 7)
    assert w[0].tolist() == pytest.approx([math.exp(0.1), math.exp(-0.2), 2.0, 1.0], abs=1e-15)
    assert w[1, 3] == 1.0  # padding: weight 1 (and no loss anyway)


def test_agreement_gives_zero_mismatch_and_unit_weights():
    old = torch.randn(3, 5, dtype=torch.float64).clamp(max=0)
    lm = torch.ones(3, 5, dtype=torch.bool)
    for mode in MODES.names():
        w, t = correct(old, old.clone(), lm, lm, mode, DEFAULT_CAP)
        m = finish(t)
        assert (w == 1).all(), mode
        assert m["logprob_mismatch"] == 0 and m["rollout_kl"] == 0
        assert m["rollout_is_mean"] == 1 and m["rollout_masked_frac"] == 0


def test_totals_merge_over_micro_batches_and_ranks():
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(6, 7, generator=g, dtype=torch.float64) * 3
    eng = old - torch.randn(6, 7, generator=g, dtype=torch.float64)
    lm = torch.rand(6, 7, generator=g) > 0.3
    he = lm & (torch.rand(6, 7, generator=g) > 0.2)
    for mode in MODES.names():
        _, whole = correct(old, eng, lm, he, mode, 1.5, 0.4)
        parts = empty()
        for rows in (slice(0, 2), slice(2, 3), slice(3, 6)):
            part = correct(old[rows], eng[rows], lm[rows], he[rows], mode, 1.5, 0.4)[1]
            parts = merge(parts, part)
        a, b = finish(whole), finish(parts)
        assert set(a) == set(METRICS)
        for k in METRICS:
            same = (a[k] is None and b[k] is None) or a[k] == pytest.approx(b[k], abs=1e-12)
            assert same, (mode, k)


def test_metrics_are_all_none_or_zero_for_an_empty_batch():
    m = finish(empty())
    assert set(m) == set(METRICS) and all(v is None for v in m.values())


# ----------------------------------------------------------------------------- options


def test_the_registry_and_its_checks():
    assert set(MODES.names()) == {"off", "token-truncate", "token-mask", "sequence-truncate",
                                  "sequence-mask"}
    assert DEFAULT_MODE in MODES.names()
    assert MODES.get("off").level is None
    assert MODES.get("sequence-mask").level == "sequence" and MODES.get("sequence-mask").masks
    assert not MODES.get("token-truncate").masks
    with pytest.raises(BadInput, match="choose one of: off, sequence-mask"):
        check("tis", 2.0, 0.0)
    with pytest.raises(BadInput, match=r"--rollout-is-cap: 0\.0 is out of range"):
        check("token-mask", 0.0, 0.0)
    with pytest.raises(BadInput, match=r"--rollout-is-floor: -1\.0 is out of range"):
        check("token-mask", 2.0, -1.0)
    with pytest.raises(BadInput, match=r"--rollout-is-floor: 3\.0 .* must be >= 0 and <= 2\.0"):
        check("token-mask", 2.0, 3.0)
    assert check("token-mask", 5.0, 0.5).masks


# ----------------------------------------------------------------------------- end to end
# rollout (hf, the tiny model) → reward → advantages → update, with engine log-probs as the
# engine wrote them, then perturbed by known offsets.

# Linear AdamW (eps ≫ |g|, no clipping): the step is lr·g/eps, so weights within 1e-6 of 1 give
# a step within 1e-6 of the unweighted one (plain AdamW's first step, sign(g)·lr, would turn a
# relative 1e-6 into a whole lr wherever |g| is near eps).
LINEAR_ADAM = ("--lr", "1", "--adam-eps", "100", "--grad-clip", "0")


def _update(adv: Path, policy: Path, out: Path, *args: str, optim=("--lr", "1e-3")):
    return marscli("update", str(adv), "--policy", str(policy), "--out", str(out), *optim, *args)


def _steps(out: Path) -> list[dict]:
    return [orjson.loads(x) for x in (out / "metrics.jsonl").read_bytes().splitlines()]


@pytest.fixture(scope="module")
def chain(tiny_model, tmp_path_factory) -> Path:
    """Advantage rows of 2 prompts x 4 hf samples; rewards set by hand (the random model never
    answers): samples 0 and 2 get 1, so every group has a signal."""
    tmp = tmp_path_factory.mktemp("chain")
    prompts = write_prompts(tmp / "prompts.jsonl", ["p0", "p1"])
    res = marscli("rollout", str(prompts), "-o", str(tmp / "rollouts.jsonl"), "--policy",
                  str(tiny_model), "-n", "4", "--max-turns", "2", "--max-turn-tokens", "12",
                  "--seed", "1")
    assert res.returncode == 0, res.stderr
    res = marscli("reward", str(tmp / "rollouts.jsonl"), "-o", str(tmp / "scored.jsonl"))
    assert res.returncode == 0, res.stderr
    rows = read_jsonl(tmp / "scored.jsonl")
    assert all(r["logprobs_mode"] == "raw" for r in rows)
    for r in rows:
        r["reward"]["total"] = 1.0 if r["sample"] % 2 == 0 else 0.0
    write_jsonl(tmp / "scored.jsonl", rows)
    res = marscli("advantages", str(tmp / "scored.jsonl"), "-o", str(tmp / "adv.jsonl"),
                  "--estimator", "grpo")
    assert res.returncode == 0, res.stderr
    return tmp / "adv.jsonl"


@pytest.mark.slow
def test_hf_rollouts_agree_with_the_trainer(chain, tiny_model, tmp_path):
    out = tmp_path / "ckpt"
    res = _update(chain, tiny_model, out, "--rollout-is", "token-truncate", optim=LINEAR_ADAM)
    assert res.returncode == 0, res.stderr
    [m] = _steps(out)
    assert set(METRICS) <= set(m)
    assert m["logprob_mismatch"] < 1e-4 and 0 <= m["rollout_kl"] < 1e-8
    assert abs(m["rollout_is_mean"] - 1) < 1e-4 and m["rollout_is_max"] < 1.001
    assert m["rollout_masked_frac"] == 0.0 and m["rollout_truncated_frac"] == 0.0
    meta = orjson.loads((out / "marscli.meta.json").read_bytes())
    assert meta["stats"]["rollout_is"] == "token-truncate"
    assert meta["stats"]["rollout"]["rollout_kl"] == pytest.approx(m["rollout_kl"])
    off = tmp_path / "off"
    assert _update(chain, tiny_model, off, "--rollout-is", "off", optim=LINEAR_ADAM).returncode == 0
    moved = max_diff(weights(off), weights(tiny_model))
    assert moved > 1e-4
    assert max_diff(weights(out), weights(off)) < 1e-4 * moved  # weights 1 ± 1e-6: the same step


def _perturbed(adv: Path, name: str) -> tuple[Path, list[list[float]]]:
    """The rows with engine log-probs shifted: w = π_old/π_engine ≈ 3 on even model tokens of a
    segment, e^−0.5 on odd ones. Returns the file (beside `adv`: image paths are relative to it)
    and each row's offsets δ (log w)."""
    rows, deltas = read_jsonl(adv), []
    for r in rows:
        d = []
        for s in r["segments"]:
            if s["role"] == "model":
                off = [LN3 if j % 2 == 0 else -0.5 for j in range(len(s["tokens"]))]
                s["logprobs"] = [lp - x for lp, x in zip(s["logprobs"], off)]
                d += off
        deltas.append(d)
    return write_jsonl(adv.parent / f"perturbed-{name}.jsonl", rows), deltas


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["token-truncate", "token-mask", "sequence-mask"])
def test_perturbed_engine_logprobs_give_the_offsets_back(mode, chain, tiny_model, tmp_path):
    adv, deltas = _perturbed(chain, tmp_path.name)
    out = tmp_path / "ckpt"
    res = _update(adv, tiny_model, out, "--rollout-is", mode, "--rollout-is-cap", "2")
    assert res.returncode == 0, res.stderr
    [m] = _steps(out)
    flat = [x for d in deltas for x in d]
    n, tol = len(flat), 1e-4  # the engine's own disagreement is ~1e-6
    assert m["logprob_mismatch"] == pytest.approx(sum(abs(x) for x in flat) / n, abs=tol)
    assert m["rollout_kl"] == pytest.approx(sum(math.exp(x) - 1 - x for x in flat) / n, abs=tol)
    assert m["rollout_is_mean"] == pytest.approx(sum(math.exp(x) for x in flat) / n, abs=tol)
    assert m["rollout_is_max"] == pytest.approx(3.0, abs=tol)
    assert m["rollout_is_min"] == pytest.approx(math.exp(-0.5), abs=tol)
    seq = [math.exp(sum(d) / len(d)) for d in deltas]
    assert m["rollout_is_seq_mean"] == pytest.approx(sum(seq) / len(seq), abs=tol)
    high = sum(1 for x in flat if x > 0) / n  # the tokens with w = 3 > cap 2
    if mode == "token-truncate":
        assert m["rollout_truncated_frac"] == pytest.approx(high) and m["rollout_masked_frac"] == 0
    elif mode == "token-mask":
        assert m["rollout_masked_frac"] == pytest.approx(high) and m["rollout_truncated_frac"] == 0
    else:  # whole sequences whose geometric mean is above 2
        cut = [len(d) for d, s in zip(deltas, seq) if s > 2.0]
        assert m["rollout_masked_frac"] == pytest.approx(sum(cut) / n)
        assert m["rollout_masked_seq_frac"] == pytest.approx(len(cut) / len(seq))


@pytest.mark.slow
def test_old_logp_engine_uses_the_rollout_logprobs(chain, tiny_model, tmp_path, processor):
    out = tmp_path / "bypass"
    res = _update(chain, tiny_model, out, "--old-logp", "engine")
    assert res.returncode == 0, res.stderr
    assert "π_old engine, rollout correction off" in res.stderr
    [m] = _steps(out)
    assert all(m[k] is None for k in ("logprob_mismatch", "rollout_kl", "rollout_is_mean"))
    assert abs(m["ratio_mean"] - 1) < 1e-4  # π_θ / π_engine at the first step: they agree
    # perturbed engine log-probs as π_old: the first step's ratio carries the offsets
    adv, _ = _perturbed(chain, tmp_path.name)
    res = _update(adv, tiny_model, tmp_path / "bypass2", "--old-logp", "engine")
    assert res.returncode == 0, res.stderr
    assert abs(_steps(tmp_path / "bypass2")[0]["ratio_mean"] - 1) > 0.1
    # rows without engine log-probs are refused, before anything is written
    rows = write_jsonl(tmp_path / "hand.jsonl", [trajectory(tmp_path, processor, 0)])
    res = _update(rows, tiny_model, tmp_path / "no", "--old-logp", "engine")
    assert res.returncode == 2 and not (tmp_path / "no").exists()
    assert f"{rows}:1: segments[1].logprobs: no engine log-probs" in res.stderr
    res = _update(chain, tiny_model, tmp_path / "no", "--old-logp", "engine",
                  "--rollout-is", "token-mask")
    assert res.returncode == 2 and "--rollout-is token-mask: with --old-logp engine" in res.stderr


@pytest.mark.slow
def test_off_ignores_engine_logprobs_and_masked_rows_are_left_out(tiny_model, tmp_path,
                                                                 processor):
    """`--rollout-is off` trains as if the rows had no engine log-probs (today's numbers); a
    row `advantages --mask-truncated` marked takes no part at all."""
    made_up = [trajectory(tmp_path, processor, 0, answer="red", advantage=1.0, logprob=-1.0),
               trajectory(tmp_path, processor, 1, answer="blue", advantage=-1.0, logprob=-1.0)]
    plain = [trajectory(tmp_path, processor, i, answer=a, advantage=v)
             for i, (a, v) in enumerate([("red", 1.0), ("blue", -1.0)])]
    cut = dict(trajectory(tmp_path, processor, 2, answer="green", advantage=0.0),
               id="t2", masked="truncated")
    runs = {"off": (made_up, ["--rollout-is", "off"]), "default": (made_up, []),
            "plain": (plain, []), "masked": ([*plain, cut], [])}
    outs = {}
    for name, (rows, args) in runs.items():
        f = write_jsonl(tmp_path / f"{name}.jsonl", rows)
        outs[name] = tmp_path / f"ckpt-{name}"
        res = _update(f, tiny_model, outs[name], "--seed", "0", *args)
        assert res.returncode == 0, res.stderr
    w = {k: weights(v) for k, v in outs.items()}
    assert max_diff(w["off"], w["plain"]) == 0.0  # bit for bit
    assert max_diff(w["masked"], w["plain"]) == 0.0
    assert max_diff(w["default"], w["plain"]) > 0  # made-up −1s as π_engine do weigh
    meta = orjson.loads((outs["masked"] / "marscli.meta.json").read_bytes())
    assert meta["stats"]["masked_rows"] == 1 and meta["stats"]["trajectories"] == 2
    [m] = _steps(outs["default"])
    assert m["logprob_mismatch"] > 1 and m["rollout_is_max"] < 1  # the −1s claim too much
