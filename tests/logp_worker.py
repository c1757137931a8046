"""One training step of a checkpoint on one micro-batch, once per log-prob chunk size, under
DeepSpeed (for tests/train/test_logprobs.py; under torchrun, 2 ranks).

    python logp_worker.py RESULT.json CKPT ADV.jsonl DS_CONFIG CHUNK [CHUNK ...]   (0: None)

For each chunk size: build the model with it (trainer.build_model), take one AdamW step at lr 1
with eps 100 and no clipping (so a weight moves by g / (|g| + 100) ≈ g / 100: the step shows
the gradient), and keep every weight's fp32 master before and after (DeepSpeed's own
`safe_get_full_fp32_param`). Under ZeRO-3 it also counts the all-gathers that include the LM
head's weight. Rank 0 writes {"runs": [{"chunk", "gathers", "logp_sum"}]} and the deltas to
RESULT.pt, [chunk index][name] → tensor.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path


def count_head_gathers(model) -> list[int]:
    """Wrap the head weight's ZeRO-3 all-gather; returns the counter (one cell)."""
    w = model.lm.lm_head.weight
    count = [0]
    real = getattr(w, "all_gather_coalesced", None)
    if real is None:  # ZeRO-1/2: never gathered
        return count

    def counted(*args, **kw):
        count[0] += 1
        return real(*args, **kw)

    w.all_gather_coalesced = counted
    return count


def step(d, ckpt: str, batch, ds_cfg: dict, chunk: int | None) -> tuple[dict, dict]:
    import torch
    from deepspeed.utils import safe_get_full_fp32_param

    from marscli.train.optim import OptimConfig
    from marscli.train.trainer import build_model, train_minibatch

    model = build_model(ckpt, d, optim=OptimConfig(lr=1.0, eps=100.0, grad_clip=0.0),
                        ds_config=ds_cfg, logp_chunk=chunk)
    gathers = count_head_gathers(model)
    before = {n: safe_get_full_fp32_param(p).clone() for n, p in model.module.named_parameters()}
    # a fixed weight per token, so that every loss position's gradient differs
    g = torch.Generator().manual_seed(0)
    tok_w = torch.randn(batch.loss_mask.shape, generator=g) * batch.loss_mask
    logp_sum = [0.0]

    def loss_fn(logp, b):
        logp_sum[0] = float((logp * b.loss_mask).sum())
        return -(logp * tok_w).sum(), {}

    train_minibatch(model, [batch], 1, loss_fn, lr=1.0)
    delta = {n: (safe_get_full_fp32_param(p) - before[n]).cpu()
             for n, p in model.module.named_parameters()}
    model.release()
    return {"chunk": chunk, "gathers": gathers[0], "logp_sum": logp_sum[0]}, delta


def main(argv: list[str]) -> None:
    import torch

    from marscli.qwen.policy import load_processor
    from marscli.train.batch import Spec, collate
    from marscli.train.distributed import close_distributed, init_distributed
    from marscli.train.dsconfig import load_ds_config
    from marscli.train.update import load_rows

    result, ckpt, adv, ds_path, *chunks = argv
    d = init_distributed(deepspeed=True, device="cpu")
    spec = Spec.of(load_processor(ckpt), ckpt)
    examples, _ = load_rows(adv, spec)
    batch = collate(examples, spec)
    ds_cfg = load_ds_config(ds_path, grad_clip=0.0, bf16=False, hidden_size=128)
    runs, deltas = [], []
    for c in chunks:
        info, delta = step(d, ckpt, batch, ds_cfg, int(c) or None)
        runs.append(info)
        deltas.append(delta)
    if d.main:
        Path(result).write_text(json.dumps({"runs": runs}))
        torch.save(deltas, Path(result).with_suffix(".pt"))
    # as job.py's exit does: the released engines' cycles (ZeRO-3 parameters, Gloo work) freed
    # while the group is up, and no rank tearing its groups down while another still works
    # (left to interpreter exit, a rank sometimes aborted: "terminate called without an
    # active exception")
    gc.collect()
    torch.distributed.barrier()
    close_distributed(d)


if __name__ == "__main__":
    main(sys.argv[1:])
