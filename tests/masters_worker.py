"""Load a checkpoint's training state into a DeepSpeed engine and check it against the files,
then save it again without a step (for tests/train/test_masters.py; one process, or several under
torchrun).

    python masters_worker.py RESULT.json CKPT DS_CONFIG OUT [CKPT DS_CONFIG OUT ...]

For each job: build the model from CKPT under DS_CONFIG (noting, under ZeRO-3, whether every
parameter DeepSpeed does not keep whole was already a partition when `deepspeed.initialize`
got the module: built inside `zero.Init`), load AdamW's state, and compare what
the engine holds, read back with DeepSpeed's own gathering API (`safe_get_full_fp32_param`,
`safe_get_full_optimizer_state`: independent of marscli's slicing), with the whole masters and
moments read from CKPT's files; then `save_all` into OUT (masters and moments, bf16 export).
Rank 0 writes {"jobs": [{"world", "master_diff", "moment_diff", "params", "step", "built"}]},
"built": {"partitioned", "whole"}: how many parameters arrived as empty partitions, and how many
arrived whole (besides those ZeRO-3 keeps whole by its persistence threshold).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def built_as(seen: dict):
    """A stand-in for `deepspeed.initialize` that counts how the module's parameters arrive."""
    import deepspeed

    real = deepspeed.initialize

    def spy(*args, model=None, **kw):
        ps = list(model.parameters())
        persist = [getattr(p, "ds_persist", False) for p in ps]
        seen["partitioned"] = sum(p.data.numel() == 0 and hasattr(p, "ds_id")
                                  for p, keep in zip(ps, persist) if not keep)
        seen["whole"] = sum(p.data.numel() > 0 for p, keep in zip(ps, persist) if not keep)
        return real(*args, model=model, **kw)

    return spy


def job(d, ckpt: Path, ds_path: str, out: Path) -> dict:
    import deepspeed
    import torch
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from marscli.qwen.policy import load_processor
    from marscli.train.dsconfig import load_ds_config
    from marscli.train.optim import OptimConfig
    from marscli.train.trainer import build_model
    from marscli.train.trainstate import (
        load_optimizer,
        read_masters,
        read_moments,
        read_state,
        save_all,
    )

    cfg = load_ds_config(ds_path, grad_clip=1.0, bf16=False, hidden_size=128)
    optim = OptimConfig(lr=1e-6)
    seen: dict = {}
    real, deepspeed.initialize = deepspeed.initialize, built_as(seen)
    try:
        model = build_model(str(ckpt), d, optim=optim, ds_config=cfg)
    finally:
        deepspeed.initialize = real
    assert load_optimizer(model, ckpt, betas=optim.betas, eps=optim.eps, weight_decay=0.0)
    masters, moments = read_masters(ckpt), read_moments(ckpt)
    # ZeRO-1/2 link their moments to the parameters at the first step; DeepSpeed's reader needs it
    getattr(model.engine.optimizer, "_lazy_init_hp_params_optimizer_state", lambda: None)()
    worst_master = worst_moment = 0.0
    for name, p in model.module.named_parameters():
        key = name.removeprefix("lm.")
        full = safe_get_full_fp32_param(p)  # collective
        worst_master = max(worst_master, (full.cpu() - masters[key]).abs().max().item())
        for k in ("exp_avg", "exp_avg_sq"):
            m = safe_get_full_optimizer_state(p, k)  # collective
            worst_moment = max(worst_moment, (m.cpu() - moments[f"{k}/{key}"]).abs().max().item())
    steps = {int(s["step"]) for s in model.optimizer.state.values()}
    out.mkdir(parents=True, exist_ok=d.world > 1)
    save_all(model, out, str(ckpt), load_processor(str(ckpt)), "bfloat16", optimizer=True,
             steps=read_state(ckpt)["steps"], ds_cfg=cfg)
    del model
    torch.distributed.barrier()
    return {"world": d.world, "master_diff": worst_master, "moment_diff": worst_moment,
            "params": len(masters), "step": sorted(steps), "built": seen}


def main(argv: list[str]) -> None:
    from marscli.train.distributed import close_distributed, init_distributed

    result, jobs = Path(argv[0]), argv[1:]
    d = init_distributed(deepspeed=True, device="cpu")
    done = [job(d, Path(jobs[i]), jobs[i + 1], Path(jobs[i + 2])) for i in range(0, len(jobs), 3)]
    if d.main:
        result.write_text(json.dumps({"jobs": done}))
    close_distributed(d)


if __name__ == "__main__":
    main(sys.argv[1:])
