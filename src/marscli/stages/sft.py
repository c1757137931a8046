"""`marscli sft`: supervised fine-tuning (the cold start) of a checkpoint on trajectories.

    marscli sft DATA.jsonl --policy CKPT --out CKPT2 [--epochs 3] [--lr 1e-5] [--batch-size 32]
        [--save-every-epoch] [--deepspeed CFG] [--skip-bad] ...

1. Input rows are trajectory rows (rollout's token-exact `segments`: trained on exactly those
   ids, the loss on `model` segments) or message rows (a conversation: `messages.py` turns it
   into the same segments with the policy's tokenizer, the loss on assistant turns and their
   `<|im_end|>`). A row with token-carrying `segments` is a trajectory row, otherwise its
   `messages` are used (the openai engine's records carry both). Message rows without a system
   message get marscli's system prompt with the tools block of the three tools
   (`messages.default_system`; `--system-prompt FILE` replaces the base prompt, as in rollout).
2. Every row is validated before anything loads: images exist and give the placeholder counts
   the tokens hold, an assistant turn / model segment, token ids inside the vocabulary, at most
   `--max-tokens` tokens. A bad row is one `FILE:LINE: field: ...` line and exit 2 before any
   output; with `--skip-bad` each is reported on stderr, skipped and counted (sidecar:
   `skipped_rows`).
3. Each epoch visits every row once in an order shuffled by `random.Random("SEED:sft:EPOCH")`;
   consecutive `--batch-size` rows make one optimiser step (the last step of an epoch may be
   smaller). A step is sharded over ranks and bucketed into micro-batches of at most
   `--micro-batch-tokens` padded tokens (batch.plan), as in `update`: a longer row trains
   alone, and its log-probs come `--logp-chunk` positions at a time (train/logprobs.py).
4. The loss of a step is the token-mean cross-entropy over the masked tokens of all its
   sequences (all micro-batches, all ranks): −Σ log p / N_step. Each micro-batch contributes its
   own token-mean times n_tokens_micro / N_step (losses.micro_weight), so long sequences weigh
   by their tokens, the sum over micro-batches is the step's loss, and neither the micro-batch
   split nor the number of ranks changes the gradient. (This is what Hugging Face's Trainer
   does since 4.46 when it normalises by the items in the batch over gradient accumulation;
   older trainers averaged per micro-batch means.)
5. Learning rate: linear warm-up over ceil(`--warmup-ratio` × total steps), then `--schedule`
   (cosine towards `--min-lr-ratio` × lr, 0 by default, LLaMA-Factory's usual choice; constant
   or linear) — optim.lr_at, with the floor reached one step after the last (see `_lr`).
6. Rank 0 writes OUT.tmp-PID (the HF export in `--save-dtype`, the policy's processor and
   tokenizer files, metrics.jsonl, marscli.meta.json, and `train_state/` with the fp32 masters:
   see trainstate.py) and renames it onto OUT at the end.

Resume (`--save-every-epoch`): after each epoch but the last, the state is saved atomically in
`OUT.partial/` (built in `OUT.partial.tmp-PID` by outputs.AtomicDir, renamed over the
previous one): a checkpoint as OUT will be (the HF export, and `train_state/` with the fp32
masters and AdamW's state: plain torch's optimizer.pt, or under DeepSpeed the moments by
parameter name, one file per rank: trainstate.py),
`rng-RANK.pt` (Python, NumPy and torch RNG states), `metrics.jsonl` (the steps so far) and
`state.json` (epochs done, steps done and a fingerprint of the data, the policy and the options
that change the result).
Re-running the same command (with or without `--save-every-epoch`) finds it and continues with
the next epoch: the weights, the optimiser, the RNG and the step counter (so the LR schedule)
are restored, and the epoch order depends only on the seed and the epoch, so no row is skipped
or repeated and the final weights equal those of an uninterrupted run (bitwise on CPU, tested).
A partial state of another run (different data, options or policy) is refused — delete it, or
pass `--force` to start over. The partial folder is removed once OUT is written (the
`OUT.tmp-PID` folder a killed run leaves is removed by AtomicDir on the next run).
A resumed DeepSpeed run needs the same number of ranks and ZeRO stage (both are in the
fingerprint); under bf16 its fp32 partitions come back exactly (DeepSpeed's checkpoint holds
them), so a resumed run matches an uninterrupted one.
`MARSCLI_SFT_KILL_AFTER_EPOCH=K` (a test hook) SIGKILLs the process right after epoch K's
partial state is saved.

Where marscli departs from the paper or DeepEyesV2's recipe, and why:
1. Trajectories are trained as they are, with no truncation: a row over `--max-tokens` is a bad
   row (LLaMA-Factory cuts it at `cutoff_len`, which can cut the answer off).
2. The vision tower trains unless `--freeze-vision` (DeepEyesV2 freezes the tower and the
   projector; `--freeze-vision` freezes both, `model.visual` in Qwen3-VL).
3. The fp32 masters survive the process (train_state/), like update's; the HF export is bf16
   on CUDA and float32 on CPU by default (`--save-dtype`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import signal
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from marscli.errors import BadInput, check_range
from marscli.records.jsonl import dumps, read_rows
from marscli.records.outputs import AtomicDir, tmp_path
from marscli.records.provenance import (
    check_no_input_inside,
    note_inputs,
    sha256_file,
    stage_inputs,
    weights_fingerprint,
)
from marscli.train.batch import Example, Spec, load_example
from marscli.train.distributed import barrier, is_main_process
from marscli.train.job import Job, Minibatch, TrainOptions, check_paths, deepspeed_config

if TYPE_CHECKING:
    from marscli.train.trainer import LossFn

KILL_HOOK = "MARSCLI_SFT_KILL_AFTER_EPOCH"
# Options that change the trained weights: a partial state of a run that differs in one of
# these is not resumed. (micro_batch_tokens only regroups the same sums; device, logging and
# output options do not matter.)
_FINGERPRINT = ("epochs", "lr", "warmup_ratio", "schedule", "min_lr_ratio", "batch_size",
                "max_tokens", "adam_beta1", "adam_beta2", "adam_eps", "weight_decay",
                "grad_clip", "freeze_vision", "seed", "skip_bad")


@dataclass
class SftConfig(TrainOptions):
    epochs: int = 3
    lr: float = 1e-5
    warmup_ratio: float = 0.03
    schedule: str = "cosine"
    min_lr_ratio: float = 0.0
    batch_size: int = 32  # sequences per optimiser step
    max_tokens: int = 32768  # per sequence
    micro_batch_tokens: int | None = None  # None: max_tokens
    system_prompt: str | None = None  # FILE: base prompt for message rows without a system turn
    save_every_epoch: bool = False
    skip_bad: bool = False

    @property
    def mbt(self) -> int:
        return self.micro_batch_tokens or self.max_tokens

    def optim(self, warmup_steps: int = 0):
        return self.adamw(warmup_steps=warmup_steps, schedule=self.schedule,
                          min_lr_ratio=self.min_lr_ratio)


def check_config(cfg: SftConfig) -> None:
    """Options out of range → BadInput naming the option (before the model or data load)."""
    check_range("--warmup-ratio", cfg.warmup_ratio, 0, 1, hi_open=True)
    check_range("--batch-size", cfg.batch_size, 1)
    check_range("--max-tokens", cfg.max_tokens, 2)
    check_range("--micro-batch-tokens", cfg.micro_batch_tokens, 1)
    check_range("--logp-chunk", cfg.logp_chunk, 1, cfg.mbt)  # a chunk ≤ a micro-batch
    cfg.check_common(cfg.optim(), "--schedule")


# ------------------------------------------------------------------------------ data


def _located(err: BadInput, src: str, line: int) -> str:
    msg = " ".join(str(err).split("\n"))
    return msg if msg.startswith(f"{src}:") else f"{src}:{line}: {msg}"


def load_sft_rows(path: str, spec: Spec, max_tokens: int, system: str, skip_bad: bool = False
                  ) -> tuple[list[Example], list[str]]:
    """Validate and assemble every row (module docstring, points 1-2). Returns the examples
    (`extra["kind"]`: trajectory or messages) and the messages of the rows skipped."""
    from marscli.agent.messages import row_kind, to_trajectory

    base = Path.cwd() if path == "-" else Path(path).resolve().parent
    out, bad = [], []
    for n, (line, row) in enumerate(read_rows(path)):
        try:
            kind = row_kind(row, path, line)
            traj = row if kind == "trajectory" else to_trajectory(
                row, path, line, base, spec.processor, system)
            e = load_example(traj, path, line, base, spec)
            if len(e) > max_tokens:
                raise BadInput(f"{path}:{line}: segments: {len(e)} tokens, over --max-tokens "
                               f"{max_tokens} — raise it, or drop the row (--skip-bad)")
        except BadInput as err:
            msg = _located(err, path, line)
            if not skip_bad:
                raise BadInput(msg) from None
            bad.append(msg)
            continue
        e.index, e.extra["kind"] = n, kind
        out.append(e)
    return out, bad


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The row order of one epoch: a function of (seed, epoch) only, so a resumed run visits
    exactly the rows an uninterrupted one would."""
    order = list(range(n))
    random.Random(f"{seed}:sft:{epoch}").shuffle(order)
    return order


def schedule_of(n_examples: int, cfg: SftConfig) -> tuple[int, int, int]:
    """(steps per epoch, total steps, warm-up steps)."""
    per_epoch = math.ceil(n_examples / cfg.batch_size)
    total = per_epoch * cfg.epochs
    return per_epoch, total, math.ceil(total * cfg.warmup_ratio)


# ------------------------------------------------------------------------------ run


@stage_inputs()
def run_sft(data: str, policy: str, out: str, cfg: SftConfig | None = None,
            **options: Any) -> dict:
    """Run SFT; returns the sidecar's statistics. `options` override `cfg` fields."""
    started = time.time()
    cfg = replace(cfg or SftConfig(), **options)
    check_config(cfg)
    from marscli.agent.messages import default_system
    from marscli.agent.protocol import read_system_prompt
    from marscli.qwen.policy import check_checkpoint, load_processor
    from marscli.train.trainstate import check_state

    policy = check_checkpoint(policy)
    check_state(policy)
    check_paths(cfg, out, policy)
    # read by transformers or as text, not the records readers: no output may replace them
    note_inputs(policy, cfg.deepspeed, cfg.system_prompt, files_in_folders=True)
    check_no_input_inside(out)
    base_prompt = read_system_prompt(cfg.system_prompt)
    system = default_system(base_prompt)
    ds_cfg = deepspeed_config(cfg, policy)
    processor = load_processor(policy)
    spec = Spec.of(processor, policy)
    examples, bad = load_sft_rows(data, spec, cfg.max_tokens, system, cfg.skip_bad)
    if bad and is_main_process():
        for msg in bad[:20]:
            print(f"warning: skipped {msg}", file=sys.stderr)
        more = " (first 20 shown)" if len(bad) > 20 else ""
        print(f"sft: skipped {len(bad)} bad row(s){more} (--skip-bad)", file=sys.stderr)
    if not examples:
        raise BadInput(f"{data}: no row to train on ({len(bad)} skipped as bad)")
    fp = resume_fingerprint(data, policy, cfg, ds_cfg, base_prompt, examples)
    with Job("sft", out, cfg, ds_cfg, [data], started, folders=[policy]) as job:
        return _train(job, policy, cfg, processor, spec, examples, bad, fp)


def resume_fingerprint(data, policy, cfg, ds_cfg, base_prompt, examples) -> dict:
    """What must match for a saved partial state to be resumed (module docstring)."""
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


def _train(job: Job, policy, cfg, processor, spec, examples, bad, fp) -> dict:
    d, ds_cfg, out = job.dist, job.ds_cfg, job.out
    if ds_cfg is not None:
        fp = {**fp, "world": d.world}
    per_epoch, total, warmup = schedule_of(len(examples), cfg)
    optim = cfg.optim(warmup)
    part = partial_dir(out)
    state = _read_partial(part, fp, cfg.force, d)
    done = state["epoch"] if state else 0
    model = job.build(str(part) if state else policy, optim=optim,
                      gradient_checkpointing=cfg.gradient_checkpointing,
                      freeze_vision=cfg.freeze_vision,
                      logp_chunk=cfg.chunk(cfg.mbt, spec.vocab_size))
    kinds = Counter(e.extra["kind"] for e in examples)
    job.log(f"sft: {len(examples)} rows ({kinds['trajectory']} trajectory, "
            f"{kinds['messages']} message), {len(bad)} skipped; {total} steps of "
            f"{cfg.batch_size} over {cfg.epochs} epoch(s), warm-up {warmup}; {d.world} "
            f"rank(s), {f'ZeRO-{model.zero_stage}' if ds_cfg else 'torch'} on {d.device}")
    history: list[dict] = []
    if state:
        history = _restore(job, model, part, state)
        job.log(f"sft: resumed from {part} after epoch {done}/{cfg.epochs} "
                f"(step {state['step']})")
    summary: dict[str, Any] = {}
    with job.output() as writer:
        for row in history:
            writer.write(row)
        step = done * per_epoch
        for epoch in range(done, cfg.epochs):
            t0 = time.perf_counter()
            order = epoch_order(len(examples), cfg.seed, epoch)
            for i in range(0, len(order), cfg.batch_size):
                mb = job.minibatch([examples[j] for j in order[i:i + cfg.batch_size]], cfg.mbt)
                lr = _lr(step, total, optim)
                row = _step(job, model, mb, spec, lr)
                step += 1
                summary = {"step": step, "epoch": epoch + 1, **row}
                history.append(summary)
                job.report(writer, summary, total, f"epoch {epoch + 1}  loss {row['loss']:.5f}  "
                                                   f"lr {lr:.3g}")
            secs = time.perf_counter() - t0
            ep = _epoch_summary(history, epoch + 1)
            job.log(f"sft: epoch {epoch + 1}/{cfg.epochs}  loss {ep['loss']:.5f}  "
                    f"{ep['steps']} steps in {secs:.1f} s ({ep['steps'] / secs:.2f} steps/s)")
            if cfg.save_every_epoch and epoch + 1 < cfg.epochs:
                _save_partial(job, model, part, policy, processor, fp, epoch + 1, step, history)
                if os.environ.get(KILL_HOOK) == str(epoch + 1):
                    os.kill(os.getpid(), signal.SIGKILL)
        job.save(model, policy, processor, steps=step)
        epochs = [_epoch_summary(history, k) for k in range(1, cfg.epochs + 1)]
        stats = {"steps": step, "epochs": cfg.epochs, "rows": len(examples) + len(bad),
                 "examples": len(examples), "trajectory_rows": kinds["trajectory"],
                 "message_rows": kinds["messages"], "skipped_rows": len(bad),
                 "skipped": bad[:100], "ranks": d.world,
                 "model_tokens": sum(e.n_model_tokens for e in examples),
                 "tokens": sum(len(e) for e in examples),
                 "resumed_after_epoch": done or None, "epoch_loss": epochs, **job.io_stats(),
                 "last": summary}
        job.sidecar({**asdict(cfg), "policy": policy, "out": out, "agg": "token-mean",
                     "warmup_steps": warmup, "deepspeed_resolved": ds_cfg}, stats)
    if d.main and part.exists():
        shutil.rmtree(part, ignore_errors=True)
    return stats


def _lr(step: int, total: int, optim) -> float:
    """optim.lr_at with the decay spread over one step more, so that, as in Hugging Face's
    schedules, the floor is reached just after the last step (whose lr is above it) rather
    than on it (a last step at lr 0 would be wasted)."""
    from marscli.train.optim import lr_at

    return lr_at(step, total + 1, optim)


def _epoch_summary(history: list[dict], epoch: int) -> dict:
    """Token-weighted mean loss of an epoch's steps (each step's loss before its update)."""
    rows = [r for r in history if r["epoch"] == epoch]
    n = sum(r["model_tokens"] for r in rows)
    loss = sum(r["loss"] * r["model_tokens"] for r in rows) / n if n else float("nan")
    return {"epoch": epoch, "loss": loss, "steps": len(rows),
            "seconds": round(sum(r["seconds"] for r in rows), 4)}


def _step(job: Job, model, mb: Minibatch, spec: Spec, lr: float) -> dict:
    """One optimiser step over `mb`; returns its metrics (all ranks reduced)."""
    s = job.step(model, mb, _ce_loss(mb), lr, spec, sums=("loss",))
    return {"loss": s.metrics["loss"], "lr": lr, "grad_norm": s.grad_norm, **s.counts()}


def _ce_loss(mb: Minibatch) -> LossFn:
    """The loss closure: a micro-batch's token-mean cross-entropy, weighted by its share of
    the step's model tokens (module docstring, point 4)."""
    from marscli.rl.losses import micro_weight

    def lf(logp, b):
        mask = b.loss_mask  # [B, T]
        ce = -(logp * mask).sum() / mask.sum().clamp(min=1)  # token-mean over the micro-batch
        w = micro_weight(mask, "token-mean", mb.n_tokens, mb.n_seqs) * b.weight
        return ce * w, {"loss": ce.item() * w}

    return lf


# ------------------------------------------------------------------------------ resume


def _read_partial(part: Path, fp: dict, force: bool, d) -> dict | None:
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


def _save_partial(job: Job, model, part: Path, policy, processor, fp, epoch, step,
                  history) -> None:
    """Write the resumable state of `epoch` epochs done (module docstring) atomically. Every
    rank writes into the same `OUT.partial.tmp-PID` (rank 0's pid: DeepSpeed's shards, its
    RNG state)."""
    import torch

    from marscli.train.checkpoint import save_errors
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


def _restore(job: Job, model, part: Path, state: dict) -> list[dict]:
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
