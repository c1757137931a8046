"""The job skeleton `update` and `sft` share, and the options they share.

    with Job("update", out, cfg, ds_cfg, inputs=[adv], started=t0) as job:   # process group, seed
        model = job.build(policy, ...)                                        # the stage's own
        with job.output() as metrics:                                         # OUT.tmp-PID
            for each optimiser step:                                          # the stage's loop
                mb = job.minibatch(examples, max_tokens)                      # this rank's share
                s = job.step(model, mb, loss_fn, lr, spec, sums=("loss",))    # reduced metrics
                job.report(metrics, {"step": ..., "loss": s.metrics["loss"], ..., **s.counts()},
                           total, f"loss {...}")                              # a row, a log line
            job.save(model, policy, processor)              # HF export + train_state/
            job.sidecar(config, stats)                                        # written last
    # OUT.tmp-PID renamed onto OUT, "wrote OUT" logged, the process group closed

The options both stages take are `config.TrainOptions`; each stage keeps its own loop, its
loss closure (`trainer.LossFn`) and its metric fields; the step between them (micro-batches,
gradient accumulation, one AdamW step, the metrics reduced over ranks) is `Job.step`'s.
Nothing here imports torch at import time: options are validated before anything heavy loads.
"""

from __future__ import annotations

import gc
import math
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from marscli.errors import BadInput
from marscli.records.jsonl import dumps
from marscli.records.locks import OutputLock
from marscli.records.outputs import AtomicDir, remove_stale_tmp, tmp_path
from marscli.records.provenance import check_not_input
from marscli.records.sidecar import write_sidecar
from marscli.train.batch import Example, Micro, Spec, collate, plan
from marscli.train.checkpoint import check_out, save_dtype_name
from marscli.train.config import TrainOptions
from marscli.train.distributed import (
    Dist,
    all_reduce,
    barrier,
    close_distributed,
    init_distributed,
    log,
    seed_everything,
)

if TYPE_CHECKING:
    from marscli.train.trainer import LossFn, TrainModel


def check_paths(opts: TrainOptions, out: str, *inputs: str) -> None:
    """--out must be new (or --force) and no input; --metrics must not lie inside --out."""
    check_out(out, opts.force, *inputs)
    if opts.metrics and Path(out).resolve() in Path(opts.metrics).resolve().parents:
        raise BadInput(f"--metrics: {opts.metrics}: inside --out — leave --metrics out to get "
                       f"{out}/metrics.jsonl")


def deepspeed_config(opts: TrainOptions, policy: str) -> dict | None:
    """The resolved --deepspeed config (bf16 "auto" means: on CUDA), or None without one."""
    if not opts.deepspeed:
        return None
    import torch

    from marscli.train.dsconfig import hidden_size, load_ds_config

    cuda = opts.device.startswith("cuda") or (opts.device == "auto" and torch.cuda.is_available())
    return load_ds_config(opts.deepspeed, grad_clip=opts.grad_clip, bf16=cuda,
                          hidden_size=hidden_size(policy))


class Job:
    """One training job: joins the process group and seeds on entry, closes it on exit; in
    between, `output()` builds OUT atomically with the metrics writer open, `save` writes the
    checkpoint and `sidecar` the meta file (rank 0 only)."""

    def __init__(self, stage: str, out: str, opts: TrainOptions, ds_cfg: dict | None,
                 inputs: list[str], started: float, folders: Sequence[str | None] = ()) -> None:
        self.stage, self.out, self.opts, self.ds_cfg = stage, out, opts, ds_cfg
        self.inputs, self.started = inputs, started
        self.folders = folders  # the checkpoints it reads: no tracker writes into them
        self.tracker: Any = None  # rank 0's, opened on entry (`_tracker`)
        self.models: list[TrainModel] = []  # built by `build`
        self.dist = Dist()
        self.folder: Path | None = None  # OUT.tmp-PID while output() is open
        self.pid = os.getpid()  # rank 0's pid once output() is open
        self.io = {"load_seconds": 0.0, "master_load_seconds": 0.0, "save_seconds": 0.0,
                   "master_save_seconds": 0.0, "bytes_written": 0}
        self.steps_run = self.steps_skipped = 0  # optimiser steps `step` took / skipped
        self.probe: tuple[Micro, Spec] | None = None  # the last step's first micro-batch

    def __enter__(self) -> Self:
        self.dist = init_distributed(deepspeed=self.ds_cfg is not None, device=self.opts.device)
        try:
            seed_everything(self.opts.seed)
            if self.opts.state_dir:  # before any work, as a tracker that cannot write
                self._check_state_dir()
            if self.dist.main:  # before any work: a tracker that cannot write fails first
                self.tracker = self._tracker()
        except BaseException:
            close_distributed(self.dist)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            if self.tracker is not None:
                self.tracker.close()
                self.tracker = None
        finally:
            try:  # the engines first: their hooks and Gloo work must die before the group
                for model in self.models:
                    model.release()
                self.models.clear()
                gc.collect()
            finally:
                close_distributed(self.dist)

    def log(self, msg: str) -> None:
        log(self.dist, msg)

    def _check_state_dir(self) -> None:
        """--state-dir takes the train_state/ this job will write: writable, with room for it
        (from the policy's parameter count), the same folder on every rank (persist.py)."""
        from marscli.train.persist import check_everywhere, check_state_dir, state_need

        policy = self.folders[0] if self.folders else None
        need = 0
        if policy and Path(policy).is_dir():
            need = state_need(policy, self.export_dtype(policy),
                              bool(getattr(self.opts, "keep_optimizer", False)))
        check_state_dir(self.opts.state_dir, self.out, policy, need)
        if self.dist.world > 1:
            check_everywhere(self.opts.state_dir, self.dist)

    @contextmanager
    def output(self) -> Iterator[MetricsWriter]:
        """OUT.tmp-PID with the metrics writer open; renamed onto OUT when the body ends well,
        removed (with the metrics temporary) when it raises."""
        d = self.dist
        out = Path(self.out)
        pid = int(all_reduce([os.getpid() if d.main else 0], d)[0])  # rank 0's: shared by all
        self.pid = pid  # for other temporaries every rank must name alike (sft's partial state)
        with AtomicDir(out, active=d.main, tmp=tmp_path(out, pid)) as od:
            self.folder = od.tmp
            mpath = self.opts.metrics or od.tmp / "metrics.jsonl"
            writer = MetricsWriter(mpath if d.main else None, atomic=self.opts.metrics is not None,
                                   tracker=self.tracker)
            try:
                yield writer
                writer.close(ok=True)
            except BaseException:
                writer.close(ok=False)
                raise
        barrier(d)
        self.log(f"{self.stage}: wrote {self.out}")

    def _tracker(self) -> Any:
        """The experiment tracker each optimiser step's metrics also go to (rank 0), named
        RUN/OUT (e.g. demo/ckpt-3), opened on entry, before any model loads, and never onto
        the job's inputs, the checkpoints it reads, OUT or --metrics (`open_tracker`)."""
        from dataclasses import asdict

        from marscli.records.trackers import open_tracker

        out = Path(self.out)
        return open_tracker(self.opts.track, run=f"{out.parent.name}/{out.name}",
                            config={"stage": self.stage, **asdict(self.opts)},
                            inputs=[*self.inputs, *self.folders],
                            outputs=[self.out, self.opts.metrics])

    def build(self, policy: str, **kw: Any) -> Any:
        """`trainer.build_model` for this job, timed into the sidecar's load_seconds."""
        from marscli.train.trainer import build_model

        t0 = time.perf_counter()
        model = build_model(policy, self.dist, ds_config=self.ds_cfg, **kw)
        self.models.append(model)  # released on exit, before the process group
        self.io["load_seconds"] += time.perf_counter() - t0
        self.io["master_load_seconds"] += model.master_load_seconds
        return model

    def load_optimizer(self, model: Any, ckpt: str) -> bool:
        """AdamW's state from CKPT/train_state (trainstate.load_optimizer), timed."""
        from marscli.train.trainstate import load_optimizer

        t0 = time.perf_counter()
        o = self.opts
        ok = load_optimizer(model, ckpt, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
                            weight_decay=o.weight_decay)
        self.io["load_seconds"] += time.perf_counter() - t0
        return ok

    def export_dtype(self, policy: str) -> str:
        return save_dtype_name(self.opts.save_dtype, policy, self.dist.device)

    def save(self, model: Any, policy: str, processor: Any, *, optimizer: bool = False,
             steps: int = 0) -> None:
        """The HF export and train_state/ (fp32 masters; AdamW's state with `optimizer`) into
        the output folder (with --state-dir, train_state/ a link to its node-local copy).
        Collective: every rank calls it."""
        from marscli.train.persist import local_path
        from marscli.train.trainstate import save_all

        self.check_finite(model)
        at = local_path(self.opts.state_dir, self.out) if self.opts.state_dir else None
        io = save_all(model, self.folder, policy, processor, self.export_dtype(policy),
                      optimizer=optimizer, steps=steps, ds_cfg=self.ds_cfg, state_at=at,
                      pid=self.pid)
        for k in ("save_seconds", "master_save_seconds", "bytes_written"):
            self.io[k] += io[k]

    def check_finite(self, model: Any) -> None:
        """A diverged model is not saved (RuntimeFailure, exit 1; OUT is not written, an earlier
        OUT stays): every step skipped for a non-finite gradient norm, a non-finite weight, or
        non-finite log-probs of the last step's first micro-batch (weights of 1e30 are finite,
        their forward is not). Collective: every rank runs the forward and the verdict is
        all-reduced, so the ranks raise together."""
        from marscli.errors import RuntimeFailure
        from marscli.train.trainer import is_finite

        fix = f"nothing written to {self.out}; lower --lr (was {self.opts.lr:g}), check the input"
        if self.steps_run and self.steps_skipped == self.steps_run:
            raise RuntimeFailure(f"{self.stage}: all {self.steps_run} optimiser step(s) were "
                                 f"skipped: the loss or gradient norm was not finite — {fix}")
        bad = 0.0 if is_finite(model, self.probe) else 1.0
        if all_reduce([bad], self.dist, "max")[0]:
            raise RuntimeFailure(f"{self.stage}: the training diverged: non-finite weights or "
                                 f"log-probs after the last step — {fix}")

    def io_stats(self) -> dict:
        """Seconds loading and saving checkpoints, and of them the fp32 masters' part
        (train_state/master.safetensors read and copied in, gathered and written out)."""
        return {k: v if k == "bytes_written" else round(v, 3) for k, v in self.io.items()}

    def sidecar(self, config: dict, stats: dict) -> None:
        if self.dist.main:
            write_sidecar(str(self.folder / "marscli"), stage=self.stage, seed=self.opts.seed,
                          config=config, inputs=self.inputs, stats=stats, started=self.started)

    # -------------------------------------------------------------------- one optimiser step

    def minibatch(self, examples: Sequence[Example], max_tokens: int) -> Minibatch:
        """One step's examples (every rank holds them all) and this rank's micro-batches of
        them, as many on every rank: the most any rank plans (one all-reduce), fillers of
        weight 0 on the others, so the ranks run the same forwards and backwards."""
        d = self.dist
        mine = plan(examples, d.rank, d.world, max_tokens)
        n_micro = int(all_reduce([len(mine)], d, "max")[0])
        return Minibatch(list(examples), plan(examples, d.rank, d.world, max_tokens, n_micro),
                         n_tokens=sum(e.n_model_tokens for e in examples), n_seqs=len(examples))

    def step(self, model: TrainModel, mb: Minibatch, loss_fn: LossFn, lr: float, spec: Spec, *,
             logps: Mapping[str, Mapping[int, Any]] | None = None, sums: Sequence[str] = (),
             mins: Sequence[str] = (), maxs: Sequence[str] = (),
             extra: Reduce | None = None) -> StepStats:
        """One optimiser step over `mb` with the stage's loss closure (trainer.train_minibatch;
        `logps` ride along into each batch, collate). The closure's metrics named in `sums`
        are summed over micro-batches and ranks, those in `mins`/`maxs` are the least/greatest;
        `extra` holds this rank's own numbers, reduced alongside. Collective."""
        from marscli.train.trainer import train_minibatch

        d, extra = self.dist, extra or Reduce()
        names = [*sums, *mins, *maxs, "tokens", *extra.sum, *extra.min, *extra.max]
        if len(set(names)) < len(names):  # a stage's bug: fail before the step, not after it
            raise ValueError(f"Job.step: a metric name taken twice: {sorted(names)}")
        with Timer() as tm:
            batches = (collate(m.examples, spec, m.weight, d.device, logps) for m in mb.micros)
            ms, grad_norm, tokens = train_minibatch(model, batches, len(mb.micros), loss_fn, lr)
        self.steps_run += 1
        self.steps_skipped += not math.isfinite(grad_norm)  # trainer.step skipped it
        self.probe = (mb.micros[0], spec) if mb.micros else self.probe
        mine = Reduce(sum={k: sum(m[k] for m in ms) for k in sums},
                      min={k: min((m[k] for m in ms), default=math.inf) for k in mins},
                      max={k: max((m[k] for m in ms), default=-math.inf) for k in maxs})
        metrics, tokens, extra = self._reduce(mine, tokens, extra)
        secs, *peak = all_reduce([tm.s, *gpu_peak(d.device)], d, "max")
        return StepStats(mb, metrics, extra, grad_norm, tokens, secs,
                         *(int(x) if x >= 0 else None for x in peak))

    def _reduce(self, mine: Reduce, tokens: int, extra: Reduce) -> tuple[dict, float, Reduce]:
        """The closure's metrics, the tokens computed and the stage's `extra`, over ranks, in
        one vector per operation laid out as the stages had it (the metrics, the tokens, the
        extra), so that each number is reduced as before (names are distinct: Job.step)."""
        both = Reduce(sum={**mine.sum, "tokens": tokens, **extra.sum},
                      min={**mine.min, **extra.min}, max={**mine.max, **extra.max})
        r = both.reduced(self.dist)
        return r.pick(mine).flat(), r.sum["tokens"], r.pick(extra)

    def report(self, writer: MetricsWriter, row: dict, total: int, detail: str) -> None:
        """Write a step's metrics row and log its line: `detail` (the stage's own fields)
        between the step count and the gradient norm."""
        writer.write(row)
        self.log(f"step {row['step']}/{total}  {detail}  grad {row['grad_norm']:.4g}  "
                 f"{row['tokens_per_s']:.0f} tok/s")


@dataclass
class Minibatch:
    """The examples of one optimiser step (all ranks'; every rank holds them) and this rank's
    micro-batches of them (Job.minibatch). The loss closure divides by the whole step's counts."""

    examples: list[Example]
    micros: list[Micro]
    n_tokens: int  # model tokens of the whole step (counted once: a closure reads it per micro)
    n_seqs: int


@dataclass
class Reduce:
    """Numbers of this rank to reduce over ranks, by name: summed, least, greatest."""

    sum: dict[str, float] = field(default_factory=dict)
    min: dict[str, float] = field(default_factory=dict)
    max: dict[str, float] = field(default_factory=dict)

    def reduced(self, d: Dist) -> Reduce:
        """Each number reduced over ranks: one all-reduce per operation, none for an empty one
        (every rank holds the same names)."""
        def op(values: dict[str, float], how: str) -> dict[str, float]:
            return dict(zip(values, all_reduce(list(values.values()), d, how))) if values else {}

        return Reduce(op(self.sum, "sum"), op(self.min, "min"), op(self.max, "max"))

    def pick(self, names: Reduce) -> Reduce:
        """The numbers of the names `names` holds."""
        return Reduce({k: self.sum[k] for k in names.sum}, {k: self.min[k] for k in names.min},
                      {k: self.max[k] for k in names.max})

    def flat(self) -> dict[str, float]:
        return {**self.sum, **self.min, **self.max}


@dataclass
class StepStats:
    """One optimiser step, reduced over ranks (Job.step)."""

    mb: Minibatch
    metrics: dict[str, float]  # the loss closure's, by name
    extra: Reduce  # the stage's own numbers, reduced
    grad_norm: float
    tokens: float  # real tokens computed, all ranks
    seconds: float  # the slowest rank's
    gpu_peak_allocated: int | None = None  # bytes, the most any rank's process held so far
    gpu_peak_reserved: int | None = None  # the same, with the caching allocator's reserve

    def counts(self) -> dict:
        """The fields every step's metrics row ends with, in this order."""
        secs = self.seconds
        return {"sequences": self.mb.n_seqs, "model_tokens": self.mb.n_tokens,
                "tokens": int(self.tokens), "micro_batches": len(self.mb.micros),
                "seconds": round(secs, 4), "tokens_per_s": self.tokens / secs if secs > 0 else 0.0,
                "gpu_peak_allocated": self.gpu_peak_allocated,
                "gpu_peak_reserved": self.gpu_peak_reserved}


def gpu_peak(device: str) -> tuple[int, int]:
    """(allocated, reserved): the most this process's CUDA caching allocator has held on
    `device` since it started (torch.cuda.max_memory_allocated / max_memory_reserved), in
    bytes; -1 for both off CUDA. Since start, not per step: the π_old and reference forwards
    before the first step count, as `marscli plan`'s peak takes the largest phase. The CUDA
    context and NCCL's buffers are outside the allocator and not in either."""
    if not device.startswith("cuda"):
        return -1, -1
    import torch

    return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)


class MetricsWriter:
    """One JSON line per optimiser step, flushed as it is written (watch it with `tail -f`).
    With `atomic` (a `--metrics FILE` outside OUT), lines go to `PATH.tmp-PID`, renamed onto
    PATH by `close(ok=True)`, and PATH is refused if it is an input and locked while open
    (locks.OutputLock). A writer without a path (ranks other than 0) writes nothing."""

    def __init__(self, path: str | Path | None, atomic: bool = True, tracker: Any = None) -> None:
        self.path = Path(path) if path else None
        self.fh = None
        self.tracker = tracker  # trackers.Tracker or None: each row also logged at its step
        self.lock: OutputLock | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.tmp = tmp_path(self.path) if atomic else self.path
            if atomic:
                check_not_input(self.path)
                self.lock = OutputLock(self.path).__enter__()
            remove_stale_tmp(self.path)
            self.fh = self.tmp.open("wb")

    def write(self, row: dict) -> None:
        if self.fh is not None:
            self.fh.write(dumps(row))
            self.fh.flush()
        if self.tracker is not None:
            self.tracker.log(row, step=int(row.get("step", 0)))

    def close(self, ok: bool) -> None:
        self.tracker = None  # its owner (Job) closes it
        if self.fh is None:
            return
        try:
            self.fh.close()
            self.fh = None
            if self.tmp != self.path:
                if ok:
                    os.replace(self.tmp, self.path)
                else:
                    self.tmp.unlink(missing_ok=True)
        except OSError:
            self.tmp.unlink(missing_ok=True)  # a full disk while flushing: no half file
            raise
        finally:
            if self.lock is not None:
                self.lock.__exit__()
                self.lock = None


class Timer:
    def __enter__(self) -> Self:
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.s = time.perf_counter() - self.t0
