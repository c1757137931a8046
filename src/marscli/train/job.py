"""The job skeleton `update` and `sft` share, and the options they share.

    with Job("update", out, cfg, ds_cfg, inputs=[adv], started=t0) as job:   # process group, seed
        model = build_model(...)                                              # the stage's own
        with job.output() as metrics:                                         # OUT.tmp-PID
            ... the stage's loop: metrics.write(row) per optimiser step ...
            job.save(model, policy, processor)              # HF export + train_state/
            job.sidecar(config, stats)                                        # written last
    # OUT.tmp-PID renamed onto OUT, "wrote OUT" logged, the process group closed

`TrainOptions` holds the options both stages take (AdamW, DeepSpeed, seeding, output); each
stage's config adds its own and keeps its own loop. Nothing here imports torch at import time:
options are validated before anything heavy loads.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from marscli.errors import BadInput, check_range
from marscli.records.jsonl import dumps
from marscli.records.outputs import AtomicDir, OutputLock, remove_stale_tmp, tmp_path
from marscli.records.provenance import check_not_input, write_sidecar
from marscli.train.checkpoint import check_out, check_save_dtype, save_dtype_name
from marscli.train.distributed import (
    Dist,
    all_reduce,
    barrier,
    close_distributed,
    init_distributed,
    log,
    seed_everything,
)
from marscli.train.optim import OptimConfig


@dataclass
class TrainOptions:
    """Options `update` and `sft` share (each stage's config adds its own, and may change a
    default: sft trains 3 epochs at 1e-5)."""

    epochs: int = 1
    lr: float = 1e-6
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    deepspeed: str | None = None
    gradient_checkpointing: bool = False
    freeze_vision: bool = False
    seed: int = 0
    metrics: str | None = None  # None: OUT/metrics.jsonl
    device: str = "auto"
    save_dtype: str = "auto"  # of the HF export: auto (bf16 on CUDA, else fp32) | float32 | ...
    force: bool = False
    track: str | None = None  # --track SPEC (None: $MARSCLI_TRACK, then none): trackers.py

    def adamw(self, **schedule: Any) -> OptimConfig:
        """AdamW's options with the stage's schedule (warmup_steps, schedule, min_lr_ratio)."""
        return OptimConfig(lr=self.lr, betas=(self.adam_beta1, self.adam_beta2),
                           eps=self.adam_eps, weight_decay=self.weight_decay,
                           grad_clip=self.grad_clip, **schedule)

    def check_common(self, optim: OptimConfig, schedule_option: str) -> None:
        """The shared options out of range → BadInput naming the option."""
        check_range("--epochs", self.epochs, 1)
        optim.check(schedule_option)
        check_save_dtype(self.save_dtype)
        from marscli.train.trackers import check_tracker

        check_tracker(self.track)


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
                 inputs: list[str], started: float) -> None:
        self.stage, self.out, self.opts, self.ds_cfg = stage, out, opts, ds_cfg
        self.inputs, self.started = inputs, started
        self.dist = Dist()
        self.folder: Path | None = None  # OUT.tmp-PID while output() is open
        self.pid = os.getpid()  # rank 0's pid once output() is open
        self.io = {"load_seconds": 0.0, "save_seconds": 0.0, "bytes_written": 0}

    def __enter__(self) -> Self:
        self.dist = init_distributed(deepspeed=self.ds_cfg is not None, device=self.opts.device)
        try:
            seed_everything(self.opts.seed)
        except BaseException:
            close_distributed(self.dist)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        close_distributed(self.dist)

    def log(self, msg: str) -> None:
        log(self.dist, msg)

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
                                   tracker=self._tracker() if d.main else None)
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
        RUN/OUT (e.g. demo/ckpt-3)."""
        from dataclasses import asdict

        from marscli.train.trackers import open_tracker

        out = Path(self.out)
        return open_tracker(self.opts.track, run=f"{out.parent.name}/{out.name}",
                            config={"stage": self.stage, **asdict(self.opts)})

    def build(self, policy: str, **kw: Any) -> Any:
        """`trainer.build_model` for this job, timed into the sidecar's load_seconds."""
        from marscli.train.trainer import build_model

        t0 = time.perf_counter()
        model = build_model(policy, self.dist, ds_config=self.ds_cfg, **kw)
        self.io["load_seconds"] += time.perf_counter() - t0
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
        the output folder. Collective: every rank calls it."""
        from marscli.train.trainstate import save_all

        io = save_all(model, self.folder, policy, processor, self.export_dtype(policy),
                      optimizer=optimizer, steps=steps, ds_cfg=self.ds_cfg)
        self.io["save_seconds"] += io["save_seconds"]
        self.io["bytes_written"] += io["bytes_written"]

    def io_stats(self) -> dict:
        return {"load_seconds": round(self.io["load_seconds"], 3),
                "save_seconds": round(self.io["save_seconds"], 3),
                "bytes_written": self.io["bytes_written"]}

    def sidecar(self, config: dict, stats: dict) -> None:
        if self.dist.main:
            write_sidecar(str(self.folder / "marscli"), stage=self.stage, seed=self.opts.seed,
                          config=config, inputs=self.inputs, stats=stats, started=self.started)


class MetricsWriter:
    """One JSON line per optimiser step, flushed as it is written (watch it with `tail -f`).
    With `atomic` (a `--metrics FILE` outside OUT), lines go to `PATH.tmp-PID`, renamed onto
    PATH by `close(ok=True)`, and PATH is refused if it is an input and locked while open
    (outputs.OutputLock). A writer without a path (ranks other than 0) writes nothing."""

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
        if self.tracker is not None:
            self.tracker.close()
            self.tracker = None
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
