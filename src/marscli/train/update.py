"""What `marscli update` does once its options are checked (stages/update.py's docstring, points
1-4): the advantage rows validated and assembled, π_old (recomputed or the engine's) with its
rollout correction, and the policy-gradient steps over each minibatch's micro-batches. `cfg` is
the command's `UpdateConfig`."""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from marscli.errors import BadInput
from marscli.records.jsonl import get_field, read_rows
from marscli.train.batch import Example, Spec, collate, load_example
from marscli.train.job import Job, Minibatch, Reduce

if TYPE_CHECKING:
    from marscli.train.config import UpdateConfig
    from marscli.train.trainer import LossFn


def load_rows(path: str, spec: Spec,
              engine_logp: bool = False) -> tuple[list[Example], int]:
    """Validate every advantage row and assemble it (stages/update.py's docstring, point 1); with
    `engine_logp`, every model token must carry the engine's log-prob. Returns the examples to
    train on and the number of rows left out because `advantages` masked them."""
    base = Path.cwd() if path == "-" else Path(path).resolve().parent
    rows = read_rows(path)
    with_mb = [line for line, r in rows if r.get("minibatch") is not None]
    out, masked = [], 0
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
        if engine_logp:
            _check_engine_logprobs(row, path, line)
        e.advantage, e.minibatch, e.index = float(adv), mb or 0, n
        if row.get("masked"):
            masked += 1
            continue
        out.append(e)
    if not out:
        raise BadInput(f"{path}: all {masked} rows are `masked` (advantages --mask-truncated) — "
                       "nothing to train on")
    return out, masked


def _check_engine_logprobs(row: dict, path: str, line: int) -> None:
    """--old-logp engine: every model segment carries a number per token."""
    for i, seg in enumerate(row["segments"]):
        if seg.get("role") != "model":
            continue
        lps = seg.get("logprobs")
        if lps is None or not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                  for x in lps):
            raise BadInput(f"{path}:{line}: segments[{i}].logprobs: no engine log-probs (null: "
                           "replay and openai rollouts have none) — --old-logp engine needs them "
                           "on every model token; use --old-logp recompute")


def train(job: Job, policy, ref, cfg: UpdateConfig, agg, loss, processor, spec, examples,
          masked) -> dict:
    from marscli.rl import rollout_correction as rc
    from marscli.train.optim import lr_at
    from marscli.train.trainstate import read_state

    d, ds_cfg = job.dist, job.ds_cfg
    plans = _minibatches(job, examples, cfg.micro_batch_tokens)
    chunk = cfg.chunk(cfg.micro_batch_tokens, spec.vocab_size)
    model = job.build(policy, optim=cfg.optim(), gradient_checkpointing=cfg.gradient_checkpointing,
                      freeze_vision=cfg.freeze_vision, logp_chunk=chunk)
    carried = cfg.keep_optimizer and job.load_optimizer(model, policy)
    before = (read_state(policy) or {}).get("steps", 0) if carried else 0
    job.log(f"update: {len(examples)} trajectories in {len(plans)} minibatch(es)"
            f"{f' ({masked} masked rows left out)' if masked else ''}, "
            f"{d.world} rank(s), {f'ZeRO-{model.zero_stage}' if ds_cfg else 'torch'} "
            f"on {d.device}, {'carried' if carried else 'fresh'} optimiser, "
            f"π_old {cfg.old_logp}, rollout correction {cfg.is_mode}")
    logps, rollout = old_logps(model, plans, spec, d, cfg, examples)
    if cfg.kl > 0:
        ref_model = job.build(ref, logp_chunk=chunk)
        logps["ref_logp"] = score_all(ref_model, plans, spec, d)
        del ref_model
    total = cfg.epochs * len(plans)
    optim = cfg.optim()
    summary: dict[str, Any] = {}
    overall = rc.empty()  # the rollout metrics over every row (each is in one step an epoch)
    with job.output() as writer:
        step = 0
        for epoch in range(cfg.epochs):
            for k, mb in plans.items():
                lr = lr_at(step, total, optim)
                row, totals = train_step(job, model, mb, spec, cfg, agg, loss, lr, logps, rollout)
                if epoch == 0:
                    overall = rc.merge(overall, totals)
                step += 1
                summary = {"step": step, "epoch": epoch + 1, "minibatch": k, **row}
                job.report(writer, summary, total, f"loss {row['loss']:.5f}  "
                                                   f"clip {row['clip_frac']:.3f}")
        job.save(model, policy, processor, optimizer=cfg.keep_optimizer, steps=before + step)
        overall = rc.finish(overall)
        stats = {"steps": step, "trajectories": len(examples), "masked_rows": masked,
                 "optimizer": "carried" if carried else "fresh",
                 "minibatches": len(plans), "ranks": d.world,
                 "model_tokens": sum(e.n_model_tokens for e in examples),
                 "old_logp": cfg.old_logp, "rollout_is": cfg.is_mode,
                 "logprob_mismatch": overall["logprob_mismatch"], "rollout": overall,
                 **job.io_stats(), "last": summary}
        job.sidecar({**asdict(cfg), "policy": policy, "agg": agg, "out": job.out,
                     "deepspeed_resolved": ds_cfg}, stats)
    return stats


def _minibatches(job: Job, examples: list[Example], max_tokens: int) -> dict[int, Minibatch]:
    """The rows grouped by `minibatch` (ascending), each planned once: every epoch, and the
    π_old and reference forwards, go through the same micro-batches."""
    groups: dict[int, list[Example]] = {}
    for e in examples:
        groups.setdefault(e.minibatch, []).append(e)
    return {k: job.minibatch(groups[k], max_tokens) for k in sorted(groups)}


def score_all(model, plans, spec, d) -> dict:
    """Log-probs [T] under `model` of every example this rank trains on (and of the fillers),
    by `Example.index`."""
    from marscli.train.trainer import score

    out = {}
    for mb in plans.values():
        batches = (collate(m.examples, spec, m.weight, d.device) for m in mb.micros)
        for b, lp in score(model, batches):
            for i, e in enumerate(b.examples):
                if b.weight or e.index not in out:
                    out[e.index] = lp[i, :len(e)].clone()
    return out


def old_logps(model, plans, spec, d, cfg: UpdateConfig, examples: list[Example]
              ) -> tuple[dict, dict]:
    """π_old [T] by `Example.index` (stages/update.py's docstring, point 3) as
    `{"old_logp": ...}`, plus `"rollout_is_w"` [T] when a correction mode is on; and the rollout
    metrics' totals of each example (none under `--old-logp engine`: there is nothing to compare
    with)."""
    import torch

    from marscli.rl import rollout_correction as rc

    if cfg.old_logp == "engine":  # bypass: no old-policy forward
        return {"old_logp": {e.index: torch.tensor(e.engine_logp()[0], dtype=torch.float32)
                             for e in examples}}, {}
    old = score_all(model, plans, spec, d)  # this rank's examples and fillers
    by_index = {e.index: e for e in examples}
    weights, totals = {}, {}
    for i, lp in old.items():
        values, present = by_index[i].engine_logp()
        w, t = rc.correct(lp[None], torch.tensor([values], dtype=torch.float64),
                          torch.tensor([by_index[i].loss_mask]), torch.tensor([present]),
                          cfg.is_mode, cfg.rollout_is_cap, cfg.rollout_is_floor)
        weights[i], totals[i] = w[0].float(), t
    logps = {"old_logp": old}
    if rc.MODES.get(cfg.is_mode).level is not None:  # off: the loss gets no weights at all
        logps["rollout_is_w"] = weights
    return logps, totals


# The policy loss's metrics, summed over micro-batches and ranks (each micro-batch's already
# weighted by its share of the minibatch); ratio_min and ratio_max are the extremes.
SUMMED = ("loss", "pg_loss", "kl", "clip_frac", "approx_kl", "ratio_mean")


def train_step(job: Job, model, mb: Minibatch, spec: Spec, cfg: UpdateConfig, agg: str, loss_fn,
               lr: float, logps: dict, rollout: dict) -> tuple[dict, dict]:
    """One optimiser step over a minibatch; returns its metrics (all ranks reduced) and the
    totals of its rollout metrics (rollout_correction.merge)."""
    from marscli.rl import rollout_correction as rc

    s = job.step(model, mb, _policy_loss(mb, cfg, agg, loss_fn), lr, spec, logps=logps,
                 sums=SUMMED, mins=("ratio_min",), maxs=("ratio_max",),
                 extra=_rollout_totals(mb, rollout))
    row = {k: s.metrics[k] for k in SUMMED}
    if cfg.kl == 0:
        row["kl"] = None
    totals = s.extra.flat()
    row.update(ratio_min=s.metrics["ratio_min"], ratio_max=s.metrics["ratio_max"],
               grad_norm=s.grad_norm, lr=lr, **s.counts(), **rc.finish(totals))
    return row, totals


def _policy_loss(mb: Minibatch, cfg: UpdateConfig, agg: str, loss_fn) -> LossFn:
    """The loss closure: the policy loss (plus the KL penalty) of a micro-batch, weighted by
    its share of the minibatch (losses.micro_weight), and its metrics weighted alike."""
    from marscli.rl.losses import add_kl, micro_weight

    n_tok, n_seq = mb.n_tokens, mb.n_seqs

    def lf(logp, b):
        mask = b.loss_mask  # [B, T]
        pg, m = loss_fn(logp, b.extra["old_logp"], b.extra["advantages"], mask, cfg.clip_low,
                        cfg.clip_high, agg=agg, weights=b.extra.get("rollout_is_w"))
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

    return lf


def _rollout_totals(mb: Minibatch, rollout: dict) -> Reduce:
    """The rollout metrics' totals of this rank's real examples (not the fillers), to reduce
    over ranks with the step's metrics."""
    from marscli.rl import rollout_correction as rc

    mine = rc.empty()
    for e in (e for m in mb.micros if m.weight for e in m.examples):
        if e.index in rollout:
            mine = rc.merge(mine, rollout[e.index])
    return Reduce(sum={k: mine[k] for k in rc.SUM_KEYS}, min={k: mine[k] for k in rc.MIN_KEYS},
                  max={k: mine[k] for k in rc.MAX_KEYS})
