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
5. Rank 0 writes OUT.tmp-PID (safetensors, config, the policy's processor and tokenizer files,
   metrics.jsonl, marscli.meta.json) and renames it onto OUT at the end.

Where marscli departs from the paper or the released code (verl), and why:
1. By default each `update` starts a fresh AdamW: every stage's output is a plain HF
   checkpoint that vLLM and transformers load as it is. With Adam's normalisation the first
   steps of a fresh optimiser move every weight with a gradient by about lr, noise included
   (the tiny model's sequences all lost likelihood within one iteration at lr 3e-4).
   `--keep-optimizer` carries the state as verl's trainer does: it loads POLICY/optimizer.pt
   when present and writes OUT/optimizer.pt (two float32 copies of the weights; plain torch
   only, DeepSpeed shards its optimiser state).
2. The checkpoint is saved in float32 by default (`--save-dtype`), so updates of 1e-6 are not
   rounded away by bf16 between iterations (verl keeps fp32 master weights across steps).
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
from marscli.errors import BadInput
from marscli.jsonl import get_field, read_rows

DEFAULT_AGG = {"gspo": "seq-mean-token-mean", "grpo": "token-mean"}
OPTIMIZER_FILE = "optimizer.pt"  # AdamW state beside the weights, with --keep-optimizer
PER_SEQ_RATIO = {"gspo"}  # losses whose ratio metrics are per sequence (else per token)


@dataclass
class UpdateConfig:
    loss: str = "gspo"
    agg: str | None = None  # None: the loss's own (gspo: seq-mean-token-mean, grpo: token-mean)
    clip_low: float = 0.2
    clip_high: float = 0.28
    kl: float = 0.0
    ref: str | None = None
    epochs: int = 1
    micro_batch_tokens: int = 32768
    lr: float = 1e-6
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    warmup_steps: int = 0
    lr_schedule: str = "constant"
    deepspeed: str | None = None
    gradient_checkpointing: bool = False
    freeze_vision: bool = False
    seed: int = 0
    metrics: str | None = None  # None: OUT/metrics.jsonl
    device: str = "auto"
    save_dtype: str = "float32"  # float32 | bfloat16 | input
    keep_optimizer: bool = False  # load POLICY/optimizer.pt if present, write OUT/optimizer.pt
    force: bool = False

    def optim(self):
        from marscli.train import OptimConfig

        return OptimConfig(lr=self.lr, betas=(self.adam_beta1, self.adam_beta2), eps=self.adam_eps,
                           weight_decay=self.weight_decay, grad_clip=self.grad_clip,
                           warmup_steps=self.warmup_steps, schedule=self.lr_schedule)


def check_config(cfg: UpdateConfig) -> None:
    """Options out of range → BadInput naming the option (before the model or data load)."""
    from marscli.train import check_option_range as rng

    rng("--clip-low", cfg.clip_low, 0, 1, hi_open=True)
    rng("--clip-high", cfg.clip_high, 0)
    rng("--kl", cfg.kl, 0)
    rng("--epochs", cfg.epochs, 1)
    rng("--micro-batch-tokens", cfg.micro_batch_tokens, 1)
    cfg.optim().check()
    if cfg.save_dtype not in ("float32", "bfloat16", "input"):
        raise BadInput(f"--save-dtype: {cfg.save_dtype!r} — choose float32, bfloat16 or input")
    if cfg.kl > 0 and not cfg.ref:
        raise BadInput("--kl: a KL penalty needs the reference policy — add --ref CKPT0")
    if cfg.ref and cfg.kl == 0:
        raise BadInput("--ref: given without --kl — set --kl > 0 or drop --ref")
    if cfg.keep_optimizer and cfg.deepspeed:
        raise BadInput("--keep-optimizer: not supported with --deepspeed (DeepSpeed shards the "
                       "optimiser state) — drop one of them")


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
    from marscli.losses import AGGS, LOSSES
    from marscli.policy import check_checkpoint, load_processor
    from marscli.train import check_out, hidden_size, load_ds_config

    policy = check_checkpoint(policy)
    ref = check_checkpoint(cfg.ref, "--ref") if cfg.ref else None
    check_out(out, cfg.force, policy, ref or "")
    if cfg.metrics and Path(out).resolve() in Path(cfg.metrics).resolve().parents:
        raise BadInput(f"--metrics: {cfg.metrics}: inside --out — leave --metrics out to get "
                       f"{out}/metrics.jsonl")
    loss_fn = LOSSES.get(cfg.loss)
    agg = cfg.agg or DEFAULT_AGG.get(cfg.loss, "token-mean")
    if agg not in AGGS:
        raise BadInput(f"--agg: unknown aggregation {agg!r} — choose one of: {', '.join(AGGS)}")
    import torch

    cuda = cfg.device.startswith("cuda") or (cfg.device == "auto" and torch.cuda.is_available())
    ds_cfg = (load_ds_config(cfg.deepspeed, grad_clip=cfg.grad_clip, bf16=cuda,
                             hidden_size=hidden_size(policy)) if cfg.deepspeed else None)
    processor = load_processor(policy)
    spec = Spec.of(processor, policy)
    examples = load_rows(adv, spec, cfg.micro_batch_tokens)
    return _train(adv, policy, ref, out, cfg, agg, loss_fn, ds_cfg, processor, spec, examples,
                  started)


def _train(adv, policy, ref, out, cfg, agg, loss_fn, ds_cfg, processor, spec, examples,
           started) -> dict:
    import torch

    from marscli.jsonl import write_sidecar
    from marscli.train import (
        AtomicDir,
        MetricsWriter,
        all_reduce,
        barrier,
        build_model,
        close_distributed,
        init_distributed,
        log,
        lr_at,
        save_checkpoint,
        seed_everything,
    )

    d = init_distributed(deepspeed=ds_cfg is not None, device=cfg.device)
    try:
        seed_everything(cfg.seed)
        groups: dict[int, list[Example]] = {}
        for e in examples:
            groups.setdefault(e.minibatch, []).append(e)
        plans = {}
        for k in sorted(groups):
            mine = plan(groups[k], d.rank, d.world, cfg.micro_batch_tokens)
            n = int(all_reduce([len(mine)], d, "max")[0])
            plans[k] = plan(groups[k], d.rank, d.world, cfg.micro_batch_tokens, n_micro=n)
        model = build_model(policy, d, optim=cfg.optim(), ds_config=ds_cfg,
                            gradient_checkpointing=cfg.gradient_checkpointing,
                            freeze_vision=cfg.freeze_vision)
        carried = cfg.keep_optimizer and load_optimizer(model, policy, cfg)
        log(d, f"update: {len(examples)} trajectories in {len(plans)} minibatch(es), "
               f"{d.world} rank(s), {f'ZeRO-{model.zero_stage}' if ds_cfg else 'torch'} "
               f"on {d.device}, {'carried' if carried else 'fresh'} optimiser")
        _score_into(model, plans, spec, d, "old_logp")
        if cfg.kl > 0:
            ref_model = build_model(ref, d, ds_config=ds_cfg)
            _score_into(ref_model, plans, spec, d, "ref_logp")
            del ref_model
        total = cfg.epochs * len(plans)
        optim = cfg.optim()
        summary: dict[str, Any] = {}
        with AtomicDir(out, cfg.force, active=d.main) as od:
            mpath = cfg.metrics or od.tmp / "metrics.jsonl"
            writer = MetricsWriter(mpath if d.main else None, atomic=cfg.metrics is not None)
            try:
                step = 0
                for epoch in range(cfg.epochs):
                    for k, micros in plans.items():
                        lr = lr_at(step, total, optim)
                        row = _step(model, micros, groups[k], spec, d, cfg, agg, loss_fn, lr)
                        step += 1
                        row = {"step": step, "epoch": epoch + 1, "minibatch": k, **row}
                        writer.write(row)
                        summary = row
                        log(d, f"step {step}/{total}  loss {row['loss']:.5f}  "
                               f"clip {row['clip_frac']:.3f}  grad {row['grad_norm']:.4g}  "
                               f"{row['tokens_per_s']:.0f} tok/s")
                sd = model.full_state_dict()  # collective under ZeRO-3
                if d.main:
                    save_checkpoint(model, sd, od.tmp, policy, cfg.save_dtype, processor)
                    if cfg.keep_optimizer:  # plain torch: every rank holds the whole state
                        torch.save(model.optimizer.state_dict(), od.tmp / OPTIMIZER_FILE)
                stats = {"steps": step, "trajectories": len(examples),
                         "optimizer": "carried" if carried else "fresh",
                         "minibatches": len(plans), "ranks": d.world,
                         "model_tokens": sum(e.n_model_tokens for e in examples),
                         "logprob_mismatch": _mismatch(examples), "last": summary}
                if d.main:
                    write_sidecar(str(od.tmp / "marscli"), stage="update", seed=cfg.seed,
                                  config={**asdict(cfg), "policy": policy, "agg": agg,
                                          "out": out, "deepspeed_resolved": ds_cfg},
                                  inputs=[adv], stats=stats, started=started)
                writer.close(ok=True)
            except BaseException:
                writer.close(ok=False)
                raise
        barrier(d)
        log(d, f"update: wrote {out}")
        return stats
    finally:
        close_distributed(d)


def load_optimizer(model, policy: str, cfg: UpdateConfig) -> bool:
    """Load POLICY/optimizer.pt into the model's AdamW; False when there is none (the first
    update after SFT). The options of this run (betas, eps, weight decay) replace the saved
    ones; moments and step counts are kept."""
    path = Path(policy) / OPTIMIZER_FILE
    if not path.is_file():
        return False
    import pickle

    import torch

    opt = model.optimizer
    try:
        opt.load_state_dict(torch.load(path, map_location=model.dist.device, weights_only=True))
    except (ValueError, KeyError, RuntimeError, EOFError, pickle.UnpicklingError) as e:
        raise BadInput(f"{path}: does not fit the policy's trainable parameters ({e}) — "
                       "delete it to start a fresh optimiser") from None
    for g in opt.param_groups:
        g.update(betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                 weight_decay=cfg.weight_decay)
    return True


def _score_into(model, plans, spec, d, attr: str) -> None:
    """Fill `old_logp` or `ref_logp` [T] of every example this rank trains on (and of fillers)."""
    from marscli.train import score

    for micros in plans.values():
        batches = (collate(m.examples, spec, m.weight, d.device) for m in micros)
        for b, lp in score(model, batches):
            for i, e in enumerate(b.examples):
                if b.weight or getattr(e, attr) is None:
                    setattr(e, attr, lp[i, :len(e)].clone())
                    if attr == "old_logp":
                        e.extra["mismatch"] = _abs_diff(e)


def _abs_diff(e: Example) -> tuple[float, int]:
    """Sum of |engine − recomputed| log-prob over model tokens the engine recorded, and count."""
    old = e.old_logp.tolist()
    s, n = 0.0, 0
    for t, (m, lp) in enumerate(zip(e.loss_mask, e.engine_logprobs)):
        if m and isinstance(lp, (int, float)):
            s += abs(lp - old[t])
            n += 1
    return s, n


def _mismatch(examples: list[Example]) -> float | None:
    pairs = [e.extra["mismatch"] for e in examples if "mismatch" in e.extra]
    n = sum(c for _, c in pairs)
    return sum(s for s, _ in pairs) / n if n else None


def _step(model, micros, group, spec, d, cfg, agg, loss_fn, lr) -> dict:
    """One optimiser step over a minibatch; returns its metrics (all ranks reduced)."""
    from marscli.losses import add_kl
    from marscli.train import Timer, all_reduce, micro_weight, train_minibatch

    n_tok = sum(e.n_model_tokens for e in group)  # the whole minibatch, every rank knows it
    n_seq = len(group)
    per_seq = cfg.loss in PER_SEQ_RATIO

    def lf(logp, b):
        mask = b.loss_mask  # [B, T]
        pg, m = loss_fn(logp, b.extra["old_logp"], b.extra["advantages"], mask, cfg.clip_low,
                        cfg.clip_high, agg=agg)
        total = pg
        if cfg.kl > 0:
            total, m = add_kl(pg, m, logp, b.extra["ref_logp"], mask, cfg.kl, agg)
        t_frac = micro_weight(mask, "token-mean", n_tok, n_seq)
        s_frac = micro_weight(mask, "seq-mean-token-mean", n_tok, n_seq)
        w = micro_weight(mask, agg, n_tok, n_seq) * b.weight
        return total * w, {
            "loss": total.item() * w, "pg_loss": pg.item() * w, "kl": m.get("kl_ref", 0.0) * w,
            "clip_frac": m["clip_frac"] * t_frac, "approx_kl": m["kl_old"] * t_frac,
            "ratio_mean": m["ratio_mean"] * (s_frac if per_seq else t_frac),
            "ratio_min": m["ratio_min"], "ratio_max": m["ratio_max"]}

    with Timer() as tm:
        batches = (collate(m.examples, spec, m.weight, d.device) for m in micros)
        ms, grad_norm, tokens = train_minibatch(model, batches, len(micros), lf, lr)
    keys = ["loss", "pg_loss", "kl", "clip_frac", "approx_kl", "ratio_mean"]
    mine = [e for m in micros if m.weight for e in m.examples]
    mm = [e.extra.get("mismatch", (0.0, 0)) for e in mine]
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
