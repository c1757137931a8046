"""`marscli update`: one policy-gradient update of a checkpoint from advantage rows.

    marscli update ADV.jsonl --policy CKPT --out CKPT2 [--loss gspo] [--deepspeed CFG] ...

1. Every row is validated before anything loads (FILE:LINE: field errors, exit 2): a finite
   `advantage`, segments with a model token, images that exist and give the placeholder counts
   the segments hold, token ids inside the policy's vocabulary, no sequence over
   `--micro-batch-tokens`, `minibatch` on all rows or none.
2. Rows are grouped by `minibatch` (ascending; absent: the whole file is one minibatch). Each
   minibatch is sharded over ranks by sequence and bucketed by length into micro-batches.
3. Old log-probs are recomputed with the input policy for every row before the first optimiser
   step (the engine's log-probs stay in the records; their mean absolute difference is reported
   as `logprob_mismatch`). With `--kl C --ref CKPT0`, reference log-probs are computed once too.
4. For each epoch and each minibatch: gradients accumulate over the micro-batches with each
   micro-batch's loss weighted so that the sum equals the loss of the whole minibatch
   (token-mean: n_tokens_micro / n_tokens_minibatch; seq-mean-token-mean: n_seqs_micro /
   n_seqs_minibatch, over all ranks), then one AdamW step. One metrics line per step.
5. Rank 0 writes OUT.tmp-PID (the HF export in `--save-dtype`, the policy's processor and
   tokenizer files, metrics.jsonl, marscli.meta.json, and `train_state/`: see trainstate.py)
   and renames it onto OUT at the end. The training starts from POLICY's fp32 masters
   (POLICY/train_state/master.safetensors when present, else its HF weights), never from a
   16-bit copy: under DeepSpeed bf16 they seed the optimiser's fp32 partitions.

Where marscli departs from the paper or the released code (verl), and why:
1. By default each `update` starts a fresh AdamW. With Adam's normalisation the first steps of
   a fresh optimiser move every weight with a gradient by about lr, noise included (the tiny
   model's sequences all lost likelihood within one iteration at lr 3e-4). `--keep-optimizer`
   carries the state as verl's long-lived trainer does: it loads POLICY/train_state/optimizer
   when present and writes OUT/train_state/optimizer (plain torch: optimizer.pt, any world
   size; DeepSpeed: its own checkpoint, one shard per rank, for the same world size and ZeRO
   stage only — another launch is refused, exit 2). Two float32 copies of the weights on disk.
2. Each iteration is a process of its own, but the state survives as inside one trainer: the
   fp32 masters (saved from the optimiser's partitions, not from the bf16 module) and, when
   asked, the optimiser. The HF folder that engines load is only an export (bf16 on CUDA,
   float32 on CPU by default), so a 1e-6 step is not rounded away between iterations.
3. Old log-probs come from a forward of the input policy, as verl recomputes them, never from
   the rollout engine; the engine's values are only compared.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from marscli.batch import Example, Spec, collate, load_example, plan
from marscli.errors import BadInput, check_range
from marscli.job import Job, TrainOptions, check_paths, deepspeed_config
from marscli.jsonl import get_field, read_rows


@dataclass
class UpdateConfig(TrainOptions):
    loss: str = "gspo"
    agg: str | None = None  # None: the loss's own (losses.Loss.agg)
    clip_low: float = 0.2
    clip_high: float = 0.28
    kl: float = 0.0
    ref: str | None = None
    micro_batch_tokens: int = 32768
    warmup_steps: int = 0
    lr_schedule: str = "constant"
    keep_optimizer: bool = False  # load POLICY/train_state's AdamW if present, write OUT's

    def optim(self):
        return self.adamw(warmup_steps=self.warmup_steps, schedule=self.lr_schedule)


def check_config(cfg: UpdateConfig) -> None:
    """Options out of range → BadInput naming the option (before the model or data load)."""
    check_range("--clip-low", cfg.clip_low, 0, 1, hi_open=True)
    check_range("--clip-high", cfg.clip_high, 0)
    check_range("--kl", cfg.kl, 0)
    check_range("--micro-batch-tokens", cfg.micro_batch_tokens, 1)
    cfg.check_common(cfg.optim(), "--lr-schedule")
    if cfg.kl > 0 and not cfg.ref:
        raise BadInput("--kl: a KL penalty needs the reference policy — add --ref CKPT0")
    if cfg.ref and cfg.kl == 0:
        raise BadInput("--ref: given without --kl — set --kl > 0 or drop --ref")


def load_rows(path: str, spec: Spec, max_tokens: int) -> list[Example]:
    """Validate every advantage row and assemble it (module docstring, point 1)."""
    base = Path.cwd() if path == "-" else Path(path).resolve().parent
    rows = read_rows(path)
    with_mb = [line for line, r in rows if r.get("minibatch") is not None]
    out = []
    for n, (line, row) in enumerate(rows):
        adv = get_field(row, "advantage", (int, float), path, line)
        if not math.isfinite(adv):
            raise BadInput(f"{path}:{line}: advantage: {adv} is not a finite number")
        mb = row.get("minibatch")
        if with_mb and mb is None:
            raise BadInput(f"{path}:{line}: minibatch: missing here but present on line "
                           f"{with_mb[0]} — give every row one, or none")
        if mb is not None and (not isinstance(mb, int) or isinstance(mb, bool) or mb < 0):
            raise BadInput(f"{path}:{line}: minibatch: expected an integer >= 0, got {mb!r}")
        e = load_example(row, path, line, base, spec)
        if len(e) > max_tokens:
            raise BadInput(f"{path}:{line}: segments: {len(e)} tokens, over --micro-batch-tokens "
                           f"{max_tokens} — raise it (a sequence is never split)")
        e.advantage, e.minibatch, e.index = float(adv), mb or 0, n
        out.append(e)
    return out


def run_update(adv: str, policy: str, out: str, cfg: UpdateConfig | None = None,
               **options: Any) -> dict:
    """Run the update; returns the sidecar's statistics. `options` override `cfg` fields."""
    started = time.time()
    cfg = replace(cfg or UpdateConfig(), **options)
    check_config(cfg)
    from marscli.distributed import launch_world
    from marscli.losses import AGGS, LOSSES
    from marscli.policy import check_checkpoint, load_processor
    from marscli.trainstate import check_resumable

    policy = check_checkpoint(policy)
    ref = check_checkpoint(cfg.ref, "--ref") if cfg.ref else None
    check_paths(cfg, out, policy, ref or "")
    loss = LOSSES.get(cfg.loss)
    agg = cfg.agg or loss.agg
    if agg not in AGGS:
        raise BadInput(f"--agg: unknown aggregation {agg!r} — choose one of: {', '.join(AGGS)}")
    ds_cfg = deepspeed_config(cfg, policy)
    if cfg.keep_optimizer:
        check_resumable(policy, ds_cfg, launch_world())
    processor = load_processor(policy)
    spec = Spec.of(processor, policy)
    examples = load_rows(adv, spec, cfg.micro_batch_tokens)
    with Job("update", out, cfg, ds_cfg, [adv], started) as job:
        return _train(job, policy, ref, cfg, agg, loss, processor, spec, examples)


def _train(job: Job, policy, ref, cfg, agg, loss, processor, spec, examples) -> dict:
    from marscli.distributed import all_reduce
    from marscli.optim import lr_at
    from marscli.trainstate import read_state

    d, ds_cfg = job.dist, job.ds_cfg
    groups: dict[int, list[Example]] = {}
    for e in examples:
        groups.setdefault(e.minibatch, []).append(e)
    plans = {}
    for k in sorted(groups):
        mine = plan(groups[k], d.rank, d.world, cfg.micro_batch_tokens)
        n = int(all_reduce([len(mine)], d, "max")[0])
        plans[k] = plan(groups[k], d.rank, d.world, cfg.micro_batch_tokens, n_micro=n)
    model = job.build(policy, optim=cfg.optim(), gradient_checkpointing=cfg.gradient_checkpointing,
                      freeze_vision=cfg.freeze_vision)
    carried = cfg.keep_optimizer and job.load_optimizer(model, policy)
    before = (read_state(policy) or {}).get("steps", 0) if carried else 0
    job.log(f"update: {len(examples)} trajectories in {len(plans)} minibatch(es), "
            f"{d.world} rank(s), {f'ZeRO-{model.zero_stage}' if ds_cfg else 'torch'} "
            f"on {d.device}, {'carried' if carried else 'fresh'} optimiser")
    logps = {"old_logp": score_all(model, plans, spec, d)}
    mismatch = {e.index: _abs_diff(e, logps["old_logp"][e.index]) for e in examples
                if e.index in logps["old_logp"]}
    if cfg.kl > 0:
        ref_model = job.build(ref)
        logps["ref_logp"] = score_all(ref_model, plans, spec, d)
        del ref_model
    total = cfg.epochs * len(plans)
    optim = cfg.optim()
    summary: dict[str, Any] = {}
    with job.output() as writer:
        step = 0
        for epoch in range(cfg.epochs):
            for k, micros in plans.items():
                lr = lr_at(step, total, optim)
                row = _step(model, micros, groups[k], spec, d, cfg, agg, loss, lr, logps,
                            mismatch)
                step += 1
                row = {"step": step, "epoch": epoch + 1, "minibatch": k, **row}
                writer.write(row)
                summary = row
                job.log(f"step {step}/{total}  loss {row['loss']:.5f}  "
                        f"clip {row['clip_frac']:.3f}  grad {row['grad_norm']:.4g}  "
                        f"{row['tokens_per_s']:.0f} tok/s")
        job.save(model, policy, processor, optimizer=cfg.keep_optimizer, steps=before + step)
        pairs = [mismatch[e.index] for e in examples if e.index in mismatch]
        stats = {"steps": step, "trajectories": len(examples),
                 "optimizer": "carried" if carried else "fresh",
                 "minibatches": len(plans), "ranks": d.world,
                 "model_tokens": sum(e.n_model_tokens for e in examples),
                 "logprob_mismatch": _mean_abs(pairs), **job.io_stats(), "last": summary}
        job.sidecar({**asdict(cfg), "policy": policy, "agg": agg, "out": job.out,
                     "deepspeed_resolved": ds_cfg}, stats)
    return stats


def score_all(model, plans, spec, d) -> dict:
    """Log-probs [T] under `model` of every example this rank trains on (and of the fillers),
    by `Example.index`."""
    from marscli.trainer import score

    out = {}
    for micros in plans.values():
        batches = (collate(m.examples, spec, m.weight, d.device) for m in micros)
        for b, lp in score(model, batches):
            for i, e in enumerate(b.examples):
                if b.weight or e.index not in out:
                    out[e.index] = lp[i, :len(e)].clone()
    return out


def _abs_diff(e: Example, old) -> tuple[float, int]:
    """Sum of |engine − recomputed| log-prob over model tokens the engine recorded, and count."""
    old = old.tolist()
    s, n = 0.0, 0
    for t, (m, lp) in enumerate(zip(e.loss_mask, e.engine_logprobs)):
        if m and isinstance(lp, (int, float)):
            s += abs(lp - old[t])
            n += 1
    return s, n


def _mean_abs(pairs: list[tuple[float, int]]) -> float | None:
    n = sum(c for _, c in pairs)
    return sum(s for s, _ in pairs) / n if n else None


def _step(model, micros, group, spec, d, cfg, agg, loss_fn, lr, logps, mismatch) -> dict:
    """One optimiser step over a minibatch; returns its metrics (all ranks reduced)."""
    from marscli import trainer
    from marscli.distributed import all_reduce
    from marscli.job import Timer
    from marscli.losses import add_kl, micro_weight

    n_tok = sum(e.n_model_tokens for e in group)  # the whole minibatch, every rank knows it
    n_seq = len(group)

    def lf(logp, b):
        mask = b.loss_mask  # [B, T]
        pg, m = loss_fn(logp, b.extra["old_logp"], b.extra["advantages"], mask, cfg.clip_low,
                        cfg.clip_high, agg=agg)
        total = pg
        if cfg.kl > 0:
            total, m = add_kl(pg, m, logp, b.extra["ref_logp"], mask, cfg.kl, agg)
        t_frac = micro_weight(mask, "token-mean", n_tok, n_seq)
        r_frac = micro_weight(mask, loss_fn.ratio_agg, n_tok, n_seq)
        w = micro_weight(mask, agg, n_tok, n_seq) * b.weight
        return total * w, {
            "loss": total.item() * w, "pg_loss": pg.item() * w, "kl": m.get("kl_ref", 0.0) * w,
            "clip_frac": m["clip_frac"] * t_frac, "approx_kl": m["kl_old"] * t_frac,
            "ratio_mean": m["ratio_mean"] * r_frac,
            "ratio_min": m["ratio_min"], "ratio_max": m["ratio_max"]}

    with Timer() as tm:
        batches = (collate(m.examples, spec, m.weight, d.device, logps) for m in micros)
        ms, grad_norm, tokens = trainer.train_minibatch(model, batches, len(micros), lf, lr)
    keys = ["loss", "pg_loss", "kl", "clip_frac", "approx_kl", "ratio_mean"]
    mine = [e for m in micros if m.weight for e in m.examples]
    mm = [mismatch.get(e.index, (0.0, 0)) for e in mine]
    sums = all_reduce([sum(x[k] for x in ms) for k in keys]
                      + [tokens, sum(s for s, _ in mm), sum(c for _, c in mm)], d)
    lo = all_reduce([min((x["ratio_min"] for x in ms), default=math.inf)], d, "min")[0]
    hi = all_reduce([max((x["ratio_max"] for x in ms), default=-math.inf)], d, "max")[0]
    secs = all_reduce([tm.s], d, "max")[0]
    row = {k: sums[i] for i, k in enumerate(keys)}
    if cfg.kl == 0:
        row["kl"] = None
    tokens, mm_sum, mm_n = sums[len(keys):]
    row.update(ratio_min=lo, ratio_max=hi, grad_norm=grad_norm, lr=lr, sequences=n_seq,
               model_tokens=n_tok, tokens=int(tokens), micro_batches=len(micros),
               seconds=round(secs, 4), tokens_per_s=tokens / secs if secs > 0 else 0.0,
               logprob_mismatch=mm_sum / mm_n if mm_n else None)
    return row
