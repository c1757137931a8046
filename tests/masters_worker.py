"""Load a checkpoint's training state into a DeepSpeed engine and check it against the files,
then save it again without a step (for tests/test_masters.py; one process, or several under
torchrun).

    python masters_worker.py RESULT.json CKPT DS_CONFIG OUT [CKPT DS_CONFIG OUT ...]

For each job: build the model from CKPT under DS_CONFIG, load AdamW's state, and compare what
the engine holds, read back with DeepSpeed's own gathering API (`safe_get_full_fp32_param`,
`safe_get_full_optimizer_state`: independent of marscli's slicing), with the whole masters and
moments read from CKPT's files; then `save_all` into OUT (masters and moments, bf16 export).
Rank 0 writes {"jobs": [{"world", "master_diff", "moment_diff", "params", "step"}]}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def job(d, ckpt: Path, ds_path: str, out: Path) -> dict:
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
    model = build_model(str(ckpt), d, optim=optim, ds_config=cfg)
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
            "params": len(masters), "step": sorted(steps)}


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
