"""Log-probs in chunks (train/logprobs.py): values and gradients equal the whole-batch path
(the [N, V] logits through `cross_entropy`, what the trainer ran before), on random tensors at
Qwen's vocabulary, on the tiny model and on the real-vocabulary tiny model, in plain torch
(float32) and under DeepSpeed ZeRO-2 and ZeRO-3 with bf16 on 2 ranks, where the LM head's
weight is gathered as often with 3-token chunks as without chunks (once per forward and once
per backward, never once per chunk). Running out of memory in `update` is one line, exit 1.

Tolerances: float32 results agree to 1e-6 in relative norm (only the order of float32 sums
differs). In bf16 both paths round the gradients to 16 bits, each its own way (measured: 1.5%
of the head's gradient entries differ, and each path is 2.4e-3 from the exact result in
relative norm), so bf16 results are held to the whole-batch path's own distance from the exact
result, and the ZeRO runs' steps to 1e-2 of each other (a wrong chunk is off by O(1)).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, bf16_config, varied_rows, write_jsonl

QWEN_VOCAB = 151_936
TOL = 1e-6


def rel(a, b) -> float:
    """‖a − b‖ / ‖b‖ in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def run_head(hidden, weight, targets, chunk, upstream):
    """(log-probs, grad of hidden, grad of weight) of Σ upstream · logp."""
    from marscli.train.logprobs import token_logprobs

    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    lp = token_logprobs(h, w, targets, chunk)
    (lp * upstream).sum().backward()
    return lp.detach(), h.grad, w.grad


@pytest.fixture(scope="module")
def head_inputs():
    import torch

    g = torch.Generator().manual_seed(0)
    n, hdim = 200, 64
    hidden = torch.randn(n, hdim, generator=g)
    weight = torch.randn(QWEN_VOCAB, hdim, generator=g) * 0.05
    targets = torch.randint(0, QWEN_VOCAB, (n,), generator=g)
    upstream = torch.randn(n, generator=g)
    return hidden, weight, targets, upstream


# Chunks of 64 rows and more: a product of a few rows by the [V, H] head goes through another
# CPU BLAS path whose float32 sums over V are less exact (measured against float64 at 1 and 7
# rows: 5e-6 to 7e-6 on the hidden states' gradient, the whole batch 5e-7; at 64 rows 5e-7).
@pytest.mark.parametrize("chunk", [64, 100, 199, 1000])
def test_chunks_equal_the_whole_batch_in_float32(head_inputs, chunk):
    hidden, weight, targets, upstream = head_inputs
    ref = run_head(hidden, weight, targets, None, upstream)
    got = run_head(hidden, weight, targets, chunk, upstream)
    for name, a, b in zip(("logp", "grad hidden", "grad weight"), got, ref):
        assert rel(a, b) < TOL, (name, chunk, rel(a, b))


def test_one_chunk_is_the_whole_batch_bit_for_bit(head_inputs):
    """A chunk that holds every position runs what the whole-batch path ran: the same bits
    (so the CPU demo, whose micro-batches are one chunk at the tiny vocabulary, is unchanged)."""
    import torch

    hidden, weight, targets, upstream = head_inputs
    ref = run_head(hidden, weight, targets, None, upstream)
    got = run_head(hidden, weight, targets, len(targets), upstream)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_the_default_chunk_follows_the_vocabulary():
    from marscli.train.logprobs import BYTES_PER_LOGIT, LOGITS_BUDGET, default_chunk

    assert default_chunk(QWEN_VOCAB) == 1024  # 1024 x 151,936 x 12 B = 1.7 GiB
    assert default_chunk(3690) == 65536
    c = default_chunk(50_000)
    assert c * 50_000 * BYTES_PER_LOGIT <= LOGITS_BUDGET < 2 * c * 50_000 * BYTES_PER_LOGIT


def test_chunks_in_bf16_are_as_exact_as_the_whole_batch(head_inputs):
    """bf16 inputs: the two paths round differently (the whole batch's 16-bit product, or each
    chunk's float32 one summed), so they are compared by their distance to the exact result
    (float64 on the same bf16 values): the chunks' is no larger."""
    hidden, weight, targets, upstream = head_inputs
    bf = hidden.bfloat16(), weight.bfloat16()
    exact = run_head(bf[0].double(), bf[1].double(), targets, None, upstream.double())
    ref = run_head(*bf, targets, None, upstream)
    got = run_head(*bf, targets, 64, upstream)
    for name, a, r, e in zip(("logp", "grad hidden", "grad weight"), got, ref, exact):
        assert rel(a, e) <= 1.05 * rel(r, e) + TOL, (name, rel(a, e), rel(r, e))


def test_a_bad_chunk_is_refused_in_one_line(tmp_path):
    from typer.testing import CliRunner

    from marscli.cli import app

    for args, msg in ((["--logp-chunk", "0"], "--logp-chunk: 0 is out of range"),
                      (["--logp-chunk", "-2"], "--logp-chunk: -2 is out of range"),
                      (["--logp-chunk", "9", "--micro-batch-tokens", "8"],
                       "--logp-chunk: 9 is out of range — must be >= 1 and <= 8")):
        r = CliRunner().invoke(app, ["update", "a.jsonl", "--policy", "p", "--out",
                                     str(tmp_path / "o"), *args])
        assert r.exit_code == 2 and msg in r.output, r.output
        assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- the policy


def policy_grads(ckpt: Path, batch, chunk):
    """Per-token log-probs and every parameter's gradient of a fixed weighted sum of them."""
    import torch

    from marscli.train.distributed import Dist
    from marscli.train.optim import OptimConfig
    from marscli.train.trainer import build_model

    model = build_model(str(ckpt), Dist(), optim=OptimConfig(lr=1e-3), logp_chunk=chunk)
    w = torch.randn(batch.loss_mask.shape, generator=torch.Generator().manual_seed(1))
    logp = model.logp(batch, grad=True)
    (logp * w * batch.loss_mask).sum().backward()
    return logp.detach(), {n: p.grad.clone() for n, p in model.module.named_parameters()
                           if p.grad is not None}


# At Qwen's vocabulary, chunks of 64 (see the float32 test above for why not of 5)
@pytest.mark.parametrize("which,chunk", [("tiny_model", 5), ("qwen_model", 64)])
def test_policy_logp_and_grads_equal_the_whole_batch(tmp_path, request, which, chunk):
    """PolicyLM in chunks against the whole-batch path: the log-probs of six trajectories
    (images, crops, padding: more loss tokens than one chunk) and every parameter's gradient."""
    from marscli.qwen.policy import load_processor
    from marscli.train.batch import Spec, collate
    from marscli.train.update import load_rows

    ckpt = request.getfixturevalue(which)
    proc = load_processor(str(ckpt))
    adv = write_jsonl(tmp_path / "adv.jsonl", varied_rows(tmp_path, proc))
    spec = Spec.of(proc, str(ckpt))
    examples, _ = load_rows(str(adv), spec)
    batch = collate(examples, spec)
    assert batch.loss_mask.sum() > 2 * chunk
    ref_lp, ref_g = policy_grads(ckpt, batch, None)
    lp, g = policy_grads(ckpt, batch, chunk)
    assert rel(lp, ref_lp) < TOL
    assert g.keys() == ref_g.keys() and len(g) > 10
    worst = max(g, key=lambda n: rel(g[n], ref_g[n]))
    assert rel(g[worst], ref_g[worst]) < TOL, (worst, rel(g[worst], ref_g[worst]))


# ----------------------------------------------------------------------------- DeepSpeed


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_bf16_chunks_equal_the_whole_batch_and_gather_the_head_once(tmp_path, tiny_model,
                                                                        stage):
    """2 ranks, bf16: one step without chunks and one with 3-token chunks move every fp32
    master alike (the step is ~g/100: the gradient itself); under ZeRO-3 the LM head's weight
    is all-gathered as many times either way."""
    import torch

    from marscli.qwen.policy import load_processor
    from marscli.train.distributed import free_port

    adv = write_jsonl(tmp_path / "adv.jsonl", varied_rows(tmp_path, load_processor(
        str(tiny_model))))
    result = tmp_path / "result.json"
    port = str(free_port())
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", "2",
           "--master_port", port, str(ROOT / "tests/logp_worker.py"), str(result),
           str(tiny_model), str(adv), str(bf16_config(tmp_path, stage)), "0", "3"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-4000:]
    whole, chunked = json.loads(result.read_text())["runs"]
    assert chunked["logp_sum"] == pytest.approx(whole["logp_sum"], rel=TOL)
    if stage == 3:
        assert whole["gathers"] >= 2 and chunked["gathers"] == whole["gathers"], (whole, chunked)
    d_whole, d_chunked = torch.load(result.with_suffix(".pt"))
    assert d_whole.keys() == d_chunked.keys()
    flat = [torch.cat([d[n].flatten() for n in sorted(d)]) for d in (d_whole, d_chunked)]
    assert flat[0].abs().max() > 0
    assert rel(flat[1], flat[0]) < 1e-2, rel(flat[1], flat[0])  # bf16 gradients (docstring)


# ----------------------------------------------------------------------------- out of memory


LIMIT = 6 << 30  # address space: torch and the model load in it; [N, V] of 14k tokens not


def update_limited(tmp_path: Path, adv: Path, policy: Path, *args: str):
    """`marscli update` in a process whose address space is capped at LIMIT."""
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, "
            f"({LIMIT}, {LIMIT})); from marscli.cli import main; sys.argv = sys.argv[1:]; main()")
    return subprocess.run([sys.executable, "-c", code, "marscli", "update", str(adv),
                           "--policy", str(policy), "--out", str(tmp_path / "o"), *args],
                          capture_output=True, text=True, timeout=900, check=False,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "2"})


@pytest.fixture(scope="module")
def long_rows(tmp_path_factory, qwen_model):
    """Two trajectories of about 7,000 reply tokens each on the real vocabulary."""
    from marscli.qwen.policy import load_processor

    from helpers import trajectory

    d = tmp_path_factory.mktemp("long")
    proc = load_processor(str(qwen_model))
    rows = [trajectory(d, proc, i, think="look closer at the sign " * 1400, advantage=a)
            for i, a in enumerate((1.0, -1.0))]
    replies = [sum(len(s["tokens"]) for s in r["segments"] if s["role"] == "model")
               for r in rows]
    assert all(6500 < n < 8000 for n in replies), replies
    return write_jsonl(d / "adv.jsonl", rows)


@pytest.mark.slow
def test_rows_of_7000_reply_tokens_train_in_a_few_gb(tmp_path, qwen_model, long_rows):
    """With the default chunk, two 7,000-token replies of the real-vocabulary model train
    inside 6 GiB of address space (whole-batch logits: 8.5 GB for one fp32 copy)."""
    r = update_limited(tmp_path, long_rows, qwen_model, "--lr", "1e-4")
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "o" / "config.json").is_file()


@pytest.mark.slow
def test_out_of_memory_in_update_is_one_line_exit_1(tmp_path, qwen_model, long_rows):
    """The same rows in one 16k-position chunk: the allocation fails; exit 1, one line naming
    the micro-batch's tokens and the options to lower, no traceback, no OUT."""
    r = update_limited(tmp_path, long_rows, qwen_model, "--logp-chunk", "16384")
    assert r.returncode == 1, r.stderr[-3000:]
    err = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "out of memory" in err[0], r.stderr[-3000:]
    assert "2 row(s)" in err[0] and "--micro-batch-tokens" in err[0] and "--logp-chunk" in err[0]
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "o").exists()
