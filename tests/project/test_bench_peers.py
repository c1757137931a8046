"""The peers benchmark's equivalence check (bench/bench_peers.py) refuses what differs: a
flipped sign in the loss or the gradient, advantages off by more than float tolerance, other
prompt ids. Pure numbers, so it runs without TRL; the check's inputs come from both sides'
real code in the benchmark itself."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "bench_peers", Path(__file__).resolve().parents[2] / "bench" / "bench_peers.py")
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)


def side() -> dict:
    return {"prompt_ids": [[1, 2, 3], [1, 2, 4]], "advantages": [0.5, -0.5, 0.0, 1.0],
            "loss": -0.25, "grad": [0.1, -0.2, 0.3, 0.0]}


def test_the_same_step_passes():
    ours = side()
    ours["advantages"] = [a + 1e-8 for a in ours["advantages"]]  # float noise only
    ours["loss"] += 1e-7
    ours["grad"] = [g * (1 + 1e-5) for g in ours["grad"]]
    assert bench.equivalence_failures(side(), ours) == []


@pytest.mark.parametrize("change, message", [
    (lambda s: s.update(loss=-s["loss"]), "first micro-batch loss"),
    (lambda s: s.update(grad=[-g for g in s["grad"]]), "gradients differ"),
    (lambda s: s.update(advantages=[-a for a in s["advantages"]]), "advantages differ"),
    (lambda s: s.update(advantages=[a + 1e-4 for a in s["advantages"]]), "advantages differ"),
    (lambda s: s.update(advantages=s["advantages"][:3]), "advantages: 4 vs 3 rows"),
    (lambda s: s.update(grad=s["grad"][:3]), "gradients differ"),
    (lambda s: s.update(prompt_ids=[[1, 2, 3], [1, 2, 5]]),
     "prompt ids differ (first at prompt 1)"),
])
def test_a_difference_fails(change, message):
    ours = side()
    change(ours)
    failures = bench.equivalence_failures(side(), ours)
    assert len(failures) == 1 and failures[0].startswith(message), failures


def test_flipped_sign_of_the_real_gspo_loss_is_caught():
    """marscli's own gspo loss against itself with the advantages' sign flipped: the check
    sees the loss and the gradient move (the mistake a port of TRL's loss could make)."""
    torch = pytest.importorskip("torch")
    from marscli.rl.losses import LOSSES

    def run(sign: float) -> dict:
        logits = torch.linspace(-2, 2, 12).reshape(2, 6).requires_grad_()
        logp = torch.log_softmax(logits, -1)
        mask = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 0, 0, 1, 1, 0]], dtype=torch.float32)
        adv = sign * torch.tensor([1.0, 0.5])
        loss, _ = LOSSES.get("gspo")(logp, logp.detach(), adv, mask, 0.2, 0.28)
        loss.backward()
        return {"prompt_ids": [[1]], "advantages": adv.tolist(), "loss": float(loss),
                "grad": logits.grad.reshape(-1).tolist()}

    assert bench.equivalence_failures(run(1.0), run(1.0)) == []
    failures = bench.equivalence_failures(run(1.0), run(-1.0))
    assert [f.split(" ")[0] for f in failures] == ["advantages", "first", "gradients"]
