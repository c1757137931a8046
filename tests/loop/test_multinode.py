"""`stages/update.sh` across two Slurm nodes: one sbatch job of 2 nodes, one srun task per node,
each a torchrun agent with one process, the rendezvous on the first node, DeepSpeed ZeRO-3 over
the 2 ranks; its weight update matches a 1-process update of the same rows.

Needs a Slurm cluster of at least 2 nodes (`scripts/slurm-local.sh start --nodes 2` makes one on
this machine; CI starts it before `make test`); skips when none is up."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from helpers import ROOT, idle_nodes, read_jsonl, varied_rows, weights, write_jsonl

pytestmark = [pytest.mark.slurm, pytest.mark.distributed]

# Linear AdamW (eps ≫ |g|, no clipping): the step is lr·g/eps, so the weight delta is the
# gradient itself and any error in its scale or direction shows; 2 minibatches = 2 steps, KL to
# the input policy, several micro-batches per rank.
RUN = {"lr": 1.0, "adam_eps": 100.0, "grad_clip": 0.0, "kl": 0.05, "micro_batch_tokens": 215,
       "seed": 3}
OPTS = [x for k, v in RUN.items() for x in (f"--{k.replace('_', '-')}", str(v))]


@pytest.fixture(scope="module")
def cluster() -> list[str]:
    nodes = idle_nodes()
    if len(nodes) < 2:
        pytest.skip(f"needs a Slurm cluster of 2 nodes (up: {nodes or 'none'}); "
                    "start one with `scripts/slurm-local.sh start --nodes 2`")
    return nodes


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def delta(ckpt: Path, base: dict):
    """The weight change from `base` to `ckpt`, flattened, float64 [n_params]."""
    import torch

    w = weights(ckpt)
    assert w.keys() == base.keys()
    return torch.cat([(w[k].double() - base[k].double()).flatten() for k in sorted(base)])


def test_zero3_update_on_two_slurm_nodes_matches_one_process(cluster, tmp_path, tiny_model):
    import torch

    from marscli.qwen.policy import load_processor
    from marscli.stages.update import run_update

    adv = write_jsonl(tmp_path / "adv.jsonl",
                      varied_rows(tmp_path, load_processor(str(tiny_model)), minibatches=2))
    one = tmp_path / "one"
    run_update(str(adv), str(tiny_model), str(one), ref=str(tiny_model), **RUN)

    two, log = tmp_path / "two", tmp_path / "update-%j.out"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "NPROC": "1", "NNODES": "2",
           "MASTER_PORT": str(free_port()), "MARSCLI": str(Path(sys.executable).parent / "marscli")}
    t0 = time.monotonic()
    r = subprocess.run(["sbatch", "--wait", "--quiet", "--nodes=2", "--ntasks-per-node=1",
                        "--cpus-per-task=1", "--time=15", "-o", str(log), "stages/update.sh",
                        str(adv), str(tiny_model), str(two), "--ref", str(tiny_model),
                        "--deepspeed", "recipes/ds_zero3.json", *OPTS],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False)
    seconds = time.monotonic() - t0
    out = "\n".join(p.read_text() for p in tmp_path.glob("update-*.out"))
    assert r.returncode == 0, (r.stderr + out)[-4000:]
    assert "2 nodes x 1 processes" in out, out[-2000:]
    meta = orjson.loads((two / "marscli.meta.json").read_bytes())
    assert meta["stats"]["ranks"] == 2  # NPROC=1 per node: one rank on each node

    base = weights(tiny_model)
    d1, d2 = delta(one, base), delta(two, base)
    cos = torch.nn.functional.cosine_similarity(d1, d2, dim=0).item()
    worst = (d1 - d2).abs().max().item()
    print(f"2 nodes x 1 process, ZeRO-3: {seconds:.0f} s; cosine of the weight deltas {cos:.7f}, "
          f"max |difference| {worst:.1e} (deltas up to {d1.abs().max().item():.1e})")
    assert d1.abs().max().item() > 1e-4  # the update moved the weights
    assert cos > 0.99
    assert worst < 1e-6  # measured 1.2e-7: the same gradient up to summation order
    for s, t in zip(read_jsonl(two / "metrics.jsonl"), read_jsonl(one / "metrics.jsonl"),
                    strict=True):
        assert abs(s["loss"] - t["loss"]) < 1e-5, (s, t)
