"""`marscli update`: one policy-gradient update of a checkpoint from advantage rows.

    marscli update ADV.jsonl --policy CKPT --out CKPT2 [--loss gspo] [--deepspeed CFG] ...

1. Every row is validated before anything loads (FILE:LINE: field errors, exit 2): a finite
   `advantage`, segments with a model token, images that exist and give the placeholder counts
   the segments hold, token ids inside the policy's vocabulary, `minibatch` on all rows or none.
2. Rows are grouped by `minibatch` (ascending; absent: the whole file is one minibatch). Each
   minibatch is sharded over ranks by sequence and bucketed by length into micro-batches of
   at most `--micro-batch-tokens` tokens through the model (padded rows: longest x count); a
   row longer than that trains alone (a sequence is never split). The log-probs come from the
   final hidden states `--logp-chunk` positions at a time (train/logprobs.py), so a row of the
   whole context costs one chunk's logits, not the row's.
3. π_old: `--old-logp recompute` (the default) recomputes the log-probs with the input policy
   for every row before the first optimiser step, and corrects for the engine having sampled
   from a slightly different distribution: `--rollout-is MODE` (marscli.rl.rollout_correction:
   token-truncate at `--rollout-is-cap 2` unless told otherwise; `off` for none) weighs each
   model token's policy loss by π_old/π_engine, bounded. `--old-logp engine` takes the rollout
   engine's log-probs as π_old and skips that forward (verl's "bypass" mode, what the released
   SenseNova-MARS script runs): the loss's ratio then carries the mismatch and its clip bounds
   it, so there is no separate weight (the mode must be off) and nothing to compare; rows
   without engine log-probs (`null`: replay, openai) are refused, FILE:LINE, exit 2. Each step
   reports the mismatch (`logprob_mismatch`, `rollout_kl`, `rollout_is_*`,
   `rollout_masked_frac`, ...; null under `engine` or without engine log-probs). With
   `--kl C --ref CKPT0`, reference log-probs are computed once too. Rows that `advantages
   --mask-truncated` marked (`masked`) are left out: no loss, and no share of the token and
   sequence counts the loss is divided by.
4. For each epoch and each minibatch: gradients accumulate over the micro-batches with each
   micro-batch's loss weighted so that the sum equals the loss of the whole minibatch
   (token-mean: n_tokens_micro / n_tokens_minibatch; seq-mean-token-mean: n_seqs_micro /
   n_seqs_minibatch, over all ranks), then one AdamW step. One metrics line per step.
5. Rank 0 writes OUT.tmp-PID (the HF export in `--save-dtype`, the policy's processor and
   tokenizer files, metrics.jsonl, marscli.meta.json, and `train_state/`: see trainstate.py)
   and renames it onto OUT at the end. The training starts from POLICY's fp32 masters
   (POLICY/train_state/'s rank files when present, else its HF weights), never from a 16-bit
   copy: under DeepSpeed each rank seeds its own fp32 partition from its slices of them.

Where marscli departs from the paper or the released code (verl), and why:
1. By default each `update` starts a fresh AdamW. With Adam's normalisation the first steps of
   a fresh optimiser move every weight with a gradient by about lr, noise included (the tiny
   model's sequences all lost likelihood within one iteration at lr 3e-4). `--keep-optimizer`
   carries the state as verl's long-lived trainer does: it loads POLICY/train_state/
   when present and writes OUT/train_state/ (plain torch: optimizer.pt, any world size;
   DeepSpeed: AdamW's moments by parameter name, one file per rank, loaded on any number of
   ranks and any ZeRO stage; plain torch and DeepSpeed states do not cross, exit 2). Two
   float32 copies of the weights on disk.
2. Each iteration is a process of its own, but the state survives as inside one trainer: the
   fp32 masters (saved from the optimiser's partitions, not from the bf16 module) and, when
   asked, the optimiser. The HF folder that engines load is only an export (bf16 on CUDA,
   float32 on CPU by default), so a 1e-6 step is not rounded away between iterations.
3. By default old log-probs come from a forward of the input policy, as verl recomputes them,
   and rollout correction is on (token-truncate, cap 2), where verl's is off unless configured:
   marscli's rollout and update are separate processes, usually on different engines and
   dtypes, so a mismatch is the normal case (rollout_correction.py argues the default).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from marscli.errors import BadInput, check_range
from marscli.records.provenance import check_no_input_inside, note_inputs, stage_inputs
from marscli.train.batch import Spec
from marscli.train.config import UpdateConfig
from marscli.train.job import Job, check_paths, deepspeed_config
from marscli.train.update import load_rows, train

OLD_LOGP = ("recompute", "engine")  # where π_old comes from (--old-logp)


def check_config(cfg: UpdateConfig) -> None:
    """Options out of range → BadInput naming the option (before the model or data load)."""
    check_range("--clip-low", cfg.clip_low, 0, 1, hi_open=True)
    check_range("--clip-high", cfg.clip_high, 0)
    check_range("--kl", cfg.kl, 0)
    check_range("--micro-batch-tokens", cfg.micro_batch_tokens, 1)
    check_range("--logp-chunk", cfg.logp_chunk, 1, cfg.micro_batch_tokens)
    cfg.check_common(cfg.optim())
    if cfg.kl > 0 and not cfg.ref:
        raise BadInput("--kl: a KL penalty needs the reference policy — add --ref CKPT0")
    if cfg.ref and cfg.kl == 0:
        raise BadInput("--ref: given without --kl — set --kl > 0 or drop --ref")
    if cfg.old_logp not in OLD_LOGP:
        raise BadInput(f"--old-logp: unknown source {cfg.old_logp!r} — choose one of: "
                       f"{', '.join(OLD_LOGP)}")
    # as rollout_correction.check_bounds, here without importing torch
    check_range("--rollout-is-cap", cfg.rollout_is_cap, 0, lo_open=True)
    check_range("--rollout-is-floor", cfg.rollout_is_floor, 0, cfg.rollout_is_cap)
    if cfg.old_logp == "engine" and cfg.is_mode != "off":
        raise BadInput(f"--rollout-is {cfg.is_mode}: with --old-logp engine π_old is the "
                       "engine's own, so every weight would be 1 — drop --rollout-is, or use "
                       "--old-logp recompute")


@stage_inputs()
def run_update(adv: str, policy: str, out: str, cfg: UpdateConfig | None = None,
               **options: Any) -> dict:
    """Run the update; returns the sidecar's statistics. `options` override `cfg` fields."""
    started = time.time()
    cfg = replace(cfg or UpdateConfig(), **options)
    check_config(cfg)
    from marscli.qwen.policy import check_checkpoint, load_processor
    from marscli.rl.losses import AGGS, LOSSES
    from marscli.rl.rollout_correction import check as check_rollout_is
    from marscli.train.distributed import launch_world
    from marscli.train.trainstate import check_resumable, check_state

    check_rollout_is(cfg.is_mode, cfg.rollout_is_cap, cfg.rollout_is_floor)

    policy = check_checkpoint(policy)
    check_state(policy)
    ref = check_checkpoint(cfg.ref, "--ref") if cfg.ref else None
    check_paths(cfg, out, policy, ref or "")
    # read by transformers, not the records readers: no output may replace or hold them
    note_inputs(policy, ref, cfg.deepspeed, files_in_folders=True)
    check_no_input_inside(out)
    loss = LOSSES.get(cfg.loss)
    agg = cfg.agg or loss.agg
    if agg not in AGGS:
        raise BadInput(f"--agg: unknown aggregation {agg!r} — choose one of: {', '.join(AGGS)}")
    ds_cfg = deepspeed_config(cfg, policy)
    if cfg.keep_optimizer:
        check_resumable(policy, ds_cfg, launch_world())
    processor = load_processor(policy)
    spec = Spec.of(processor, policy)
    examples, masked = load_rows(adv, spec, cfg.old_logp == "engine")
    with Job("update", out, cfg, ds_cfg, [adv], started, folders=[policy, ref]) as job:
        return train(job, policy, ref, cfg, agg, loss, processor, spec, examples, masked)
