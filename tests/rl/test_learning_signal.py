"""The learning signal, pinned cheaply: a fixed small RL run through the real advantage
estimators and policy losses must raise the reward in every seed, under every estimator.

The task: 16 prompts, each with a 4-token reply (3 "thinking" tokens, then an answer token from
6 choices); reward 1 for the prompt's right answer. The policy is a table of logits per prompt
and position that starts, as a cold-start model would, right about half the time (p = 0.5 on
the right answer). Each iteration samples 8 replies per prompt, scores them, normalises with
`marscli.rl.advantages.compute`, then takes 4 minibatch AdamW steps on the registered loss (old
log-probs from before the first step, so the ratio and its clipping act). The expected reward
is computed exactly from the policy. A broken sign, a lost batch step, a ratio that ignores
the new policy: each of them fails this test (the sign flip is checked below).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from marscli.rl import advantages as A
from marscli.rl.losses import LOSSES

PROMPTS, SAMPLES, LENGTH, CHOICES, ITERS, MINIBATCHES = 16, 8, 4, 6, 5, 4
# (estimator, loss) as `make ablation` pairs them
PAIRS = [("grpo", "grpo"), ("grpo", "gspo"), ("bn-gspo", "gspo"), ("dr-grpo", "gspo"),
         ("rloo", "gspo")]


def start_policy(gold: torch.Tensor) -> torch.nn.Parameter:
    """Logits [P, L, C]: thinking positions near-deterministic, answer p(gold) = 0.5."""
    logits = torch.zeros(PROMPTS, LENGTH, CHOICES)
    logits[:, :-1, 0] = 6.0  # the "thinking" token, p ~ 0.99
    logits[torch.arange(PROMPTS), -1, gold] = float(np.log(0.5 * (CHOICES - 1) / 0.5))
    return torch.nn.Parameter(logits)


def expected_reward(logits: torch.Tensor, gold: torch.Tensor) -> float:
    p = torch.softmax(logits[:, -1], -1)  # [P, C]
    return p[torch.arange(PROMPTS), gold].mean().item()


def rl_run(estimator: str, loss_name: str, seed: int, sign: float = 1.0) -> tuple[float, float]:
    g = torch.Generator().manual_seed(seed)
    gold = torch.randint(0, CHOICES, (PROMPTS,), generator=g)
    logits = start_policy(gold)
    opt = torch.optim.AdamW([logits], lr=0.05, weight_decay=0.0)
    loss_fn = LOSSES.get(loss_name)
    before = expected_reward(logits.detach(), gold)
    prompt = torch.arange(PROMPTS).repeat_interleave(SAMPLES)  # [N]
    for it in range(ITERS):
        with torch.no_grad():
            probs = torch.softmax(logits[prompt], -1)  # [N, L, C]
            y = torch.multinomial(probs.reshape(-1, CHOICES), 1, generator=g).view(-1, LENGTH)
            old = torch.log_softmax(logits[prompt], -1).gather(-1, y[..., None])[..., 0]
        reward = (y[:, -1] == gold[prompt]).double().numpy()  # [N]
        mb = A.assign_minibatches(prompt.numpy(), MINIBATCHES, seed * 100 + it)
        adv = torch.tensor(sign * A.compute(reward, prompt.numpy(), estimator, mb),
                           dtype=torch.float32)
        for k in range(MINIBATCHES):
            rows = torch.from_numpy(np.flatnonzero(mb == k))
            logp = torch.log_softmax(logits[prompt[rows]], -1).gather(
                -1, y[rows][..., None])[..., 0]  # [B, L]
            loss, _ = loss_fn(logp, old[rows], adv[rows], torch.ones_like(logp), 0.2, 0.28)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return before, expected_reward(logits.detach(), gold)


@pytest.mark.parametrize(("estimator", "loss"), PAIRS)
def test_reward_rises_in_every_seed(estimator, loss):
    for seed in range(5):
        before, after = rl_run(estimator, loss, seed)
        assert before == pytest.approx(0.5)
        assert after > before + 0.1, (estimator, loss, seed, after)


def test_the_test_can_fail_a_flipped_advantage_lowers_the_reward():
    before, after = rl_run("bn-gspo", "gspo", 0, sign=-1.0)
    assert after < before - 0.1
