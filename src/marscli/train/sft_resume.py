"""A resumable sft (`--save-every-epoch`): the state saved after an epoch in `OUT.partial`
(weights, optimiser, RNG states, metrics) and the fingerprint a re-run must match to resume it
(stages/sft.py's docstring)."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import sys
from pathlib import Path

from marscli.errors import BadInput
from marscli.records.jsonl import dumps
from marscli.records.outputs import AtomicDir, tmp_path
from marscli.records.provenance import sha256_file, weights_fingerprint
from marscli.train.distributed import barrier
from marscli.train.job import Job

# Options that change the trained weights: a partial state of a run that differs in one of
# these is not resumed. (micro_batch_tokens only regroups the same sums; device, logging and
# output options do not matter.)
_FINGERPRINT = ("epochs", "lr", "warmup_ratio", "lr_schedule", "min_lr_ratio", "batch_size",
                "max_tokens", "adam_beta1", "adam_beta2", "adam_eps", "weight_decay",
                "grad_clip", "freeze_vision", "seed", "skip_bad")


def resume_fingerprint(data, policy, cfg, ds_cfg, base_prompt, examples) -> dict:
    """What must match for a saved partial state to be resumed (stages/sft.py's docstring)."""
    cfg_file = Path(policy) / "config.json"
    if data == "-":  # stdin: the tokens and images of the examples stand for the file
        h = hashlib.sha256()
        for e in examples:
            h.update(json.dumps([e.input_ids, e.loss_mask, [str(p) for p in e.images]]).encode())
        digest = h.hexdigest()
    else:
        digest = sha256_file(data)
    n = len(examples)
    fp = {"data": digest,
          "policy": str(Path(policy).resolve()) if Path(policy).exists() else policy,
          "policy_config": sha256_file(cfg_file) if cfg_file.is_file() else None,
          "policy_files": weights_fingerprint(policy),  # weights, processor, tokenizer, template
          "system_prompt": hashlib.sha256((base_prompt or "").encode()).hexdigest(),
          "examples": n, "engine": "deepspeed" if ds_cfg else "torch",
          "zero_stage": ds_cfg["zero_optimization"].get("stage", 0) if ds_cfg else None}
    fp.update({k: getattr(cfg, k) for k in _FINGERPRINT})
    return fp


def partial_dir(out: str) -> Path:
    p = Path(out)
    return p.with_name(f"{p.name}.partial")


def read_partial(part: Path, fp: dict, force: bool, d) -> dict | None:
    """The saved state to resume from, or None. A state of another run is refused (or, with
    --force, discarded)."""
    f = part / "state.json"
    if not f.is_file():
        return None
    state = json.loads(f.read_text())
    theirs = state.get("fingerprint", {})
    diff = next((k for k in sorted(set(fp) | set(theirs)) if fp.get(k) != theirs.get(k)), None)
    if diff is None:
        return state
    if force:
        barrier(d)
        if d.main:
            print(f"sft: {part}: saved by a different run ({diff}) — discarded (--force)",
                  file=sys.stderr)
            shutil.rmtree(part, ignore_errors=True)
        barrier(d)
        return None
    raise BadInput(f"{part}: resumable state of a different run ({diff}: {theirs.get(diff)!r} "
                   f"there, {fp.get(diff)!r} here) — delete it to start over, or pass --force")


def _rng_state() -> dict:
    import numpy as np
    import torch

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    st = {"python": random.getstate(), "numpy": [kind, keys.tolist(), pos, has_gauss, gauss],
          "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def _set_rng_state(st: dict) -> None:
    import numpy as np
    import torch

    v, internal, gauss = st["python"]
    random.setstate((v, tuple(internal), gauss))
    kind, keys, pos, has_gauss, g = st["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, g))
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def save_partial(job: Job, model, part: Path, policy, processor, fp, epoch, step,
                 history) -> None:
    """Write the resumable state of `epoch` epochs done (stages/sft.py's docstring)
    atomically. Every rank writes into the same `OUT.partial.tmp-PID` (rank 0's pid:
    DeepSpeed's shards, its RNG state)."""
    import torch

    from marscli.errors import save_errors
    from marscli.train.trainstate import save_all

    d = job.dist
    with AtomicDir(part, active=d.main, tmp=tmp_path(part, job.pid)) as ad:
        tmp = ad.tmp
        barrier(d)  # rank 0 made the folder
        save_all(model, tmp, policy, processor, job.export_dtype(policy), optimizer=True,
                 steps=step, ds_cfg=job.ds_cfg)
        with save_errors(tmp):
            torch.save(_rng_state(), tmp / f"rng-{d.rank}.pt")
        if d.main:
            (tmp / "metrics.jsonl").write_bytes(b"".join(dumps(r) for r in history))
            state = {"v": 1, "epoch": epoch, "step": step, "world": d.world, "fingerprint": fp}
            (tmp / "state.json").write_text(json.dumps(state, indent=2))
        barrier(d)  # every rank wrote its part
    if d.main:
        print(f"sft: saved resumable state after epoch {epoch} in {part}", file=sys.stderr)
    barrier(d)


def restore(job: Job, model, part: Path, state: dict) -> list[dict]:
    """Load the optimiser state (the fp32 masters came with the model, built from `part`) and
    the RNG states; returns the metrics rows of the epochs done."""
    import orjson
    import torch

    if not job.load_optimizer(model, str(part)):
        raise BadInput(f"{part}: no optimiser state in train_state/ — delete {part} to start "
                       "over")
    rng = part / f"rng-{job.dist.rank}.pt"
    if rng.is_file():
        _set_rng_state(torch.load(rng, weights_only=True))
    mf = part / "metrics.jsonl"
    if not mf.is_file():
        return []
    return [orjson.loads(x) for x in mf.read_bytes().splitlines() if x.strip()]
