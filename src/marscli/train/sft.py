"""What `marscli sft` does once its options are checked (stages/sft.py's docstring): the rows
validated and assembled, each epoch's order, the schedule, and the cross-entropy steps, with the
state saved after each epoch when asked (`sft_resume.py`). `cfg` is the command's `SftConfig`."""

from __future__ import annotations

import math
import os
import random
import shutil
import signal
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from marscli.errors import BadInput
from marscli.records.jsonl import read_rows
from marscli.train.batch import Example, Spec, load_example
from marscli.train.job import Job, MetricsWriter, Minibatch
from marscli.train.sft_resume import partial_dir, read_partial, restore, save_partial

if TYPE_CHECKING:
    from marscli.train.config import SftConfig
    from marscli.train.optim import OptimConfig
    from marscli.train.trainer import LossFn, TrainModel

KILL_HOOK = "MARSCLI_SFT_KILL_AFTER_EPOCH"


def _located(err: BadInput, src: str, line: int) -> str:
    msg = " ".join(str(err).split("\n"))
    return msg if msg.startswith(f"{src}:") else f"{src}:{line}: {msg}"


def load_sft_rows(path: str, spec: Spec, max_tokens: int, system: str, skip_bad: bool = False
                  ) -> tuple[list[Example], list[str]]:
    """Validate and assemble every row (stages/sft.py's docstring, points 1-2). Returns the examples
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


def train(job: Job, policy, cfg: SftConfig, processor, spec, examples, bad, fp) -> dict:
    d, ds_cfg, out = job.dist, job.ds_cfg, job.out
    if ds_cfg is not None:
        fp = {**fp, "world": d.world}
    per_epoch, total, warmup = schedule_of(len(examples), cfg)
    optim = cfg.optim(warmup)
    part = partial_dir(out)
    state = read_partial(part, fp, cfg.force, d)
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
        history = restore(job, model, part, state)
        job.log(f"sft: resumed from {part} after epoch {done}/{cfg.epochs} "
                f"(step {state['step']})")
    summary: dict[str, Any] = {}
    with job.output() as writer:
        for row in history:
            writer.write(row)
        step = done * per_epoch
        for epoch in range(done, cfg.epochs):
            t0 = time.perf_counter()
            step, summary = _run_epoch(job, model, writer, cfg, spec, examples, optim, epoch,
                                       step, total, history, summary)
            secs = time.perf_counter() - t0
            ep = _epoch_summary(history, epoch + 1)
            job.log(f"sft: epoch {epoch + 1}/{cfg.epochs}  loss {ep['loss']:.5f}  "
                    f"{ep['steps']} steps in {secs:.1f} s ({ep['steps'] / secs:.2f} steps/s)")
            if cfg.save_every_epoch and epoch + 1 < cfg.epochs:
                save_partial(job, model, part, policy, processor, fp, epoch + 1, step, history)
                if os.environ.get(KILL_HOOK) == str(epoch + 1):
                    os.kill(os.getpid(), signal.SIGKILL)
        job.save(model, policy, processor, steps=step)
        stats = _run_stats(job, cfg, examples, bad, kinds, step, done, history, summary)
        job.sidecar({**asdict(cfg), "policy": policy, "out": out, "agg": "token-mean",
                     "warmup_steps": warmup, "deepspeed_resolved": ds_cfg}, stats)
    if d.main and part.exists():
        shutil.rmtree(part, ignore_errors=True)
    return stats


def _run_epoch(job: Job, model: TrainModel, writer: MetricsWriter, cfg: SftConfig, spec: Spec,
               examples: list[Example], optim: OptimConfig, epoch: int, step: int, total: int,
               history: list[dict], summary: dict) -> tuple[int, dict]:
    """The steps of one epoch, each row reported and appended to `history`; returns the step
    count after it and the last step's summary (`summary` as given when the epoch is empty)."""
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
    return step, summary


def _run_stats(job: Job, cfg: SftConfig, examples: list[Example], bad: list[str], kinds: Counter,
               step: int, done: int, history: list[dict], summary: dict) -> dict:
    """The run's statistics for the sidecar: rows read and skipped, tokens, each epoch's loss
    (resumed epochs' from the history read back) and the last step."""
    epochs = [_epoch_summary(history, k) for k in range(1, cfg.epochs + 1)]
    return {"steps": step, "epochs": cfg.epochs, "rows": len(examples) + len(bad),
            "examples": len(examples), "trajectory_rows": kinds["trajectory"],
            "message_rows": kinds["messages"], "skipped_rows": len(bad),
            "skipped": bad[:100], "ranks": job.dist.world,
            "model_tokens": sum(e.n_model_tokens for e in examples),
            "tokens": sum(len(e) for e in examples),
            "resumed_after_epoch": done or None, "epoch_loss": epochs, **job.io_stats(),
            "last": summary}


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
    the step's model tokens (stages/sft.py's docstring, point 4)."""
    from marscli.rl.losses import micro_weight

    def lf(logp, b):
        mask = b.loss_mask  # [B, T]
        ce = -(logp * mask).sum() / mask.sum().clamp(min=1)  # token-mean over the micro-batch
        w = micro_weight(mask, "token-mean", mb.n_tokens, mb.n_seqs) * b.weight
        return ce * w, {"loss": ce.item() * w}

    return lf
