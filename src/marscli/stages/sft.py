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
5. Learning rate: linear warm-up over ceil(`--warmup-ratio` × total steps), then `--lr-schedule`
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

import sys
import time
from dataclasses import replace
from typing import Any

from marscli.errors import BadInput, check_range
from marscli.records.provenance import check_no_input_inside, note_inputs, stage_inputs
from marscli.train.batch import Spec
from marscli.train.config import SftConfig
from marscli.train.distributed import is_main_process
from marscli.train.job import Job, check_paths, deepspeed_config
from marscli.train.sft import load_sft_rows, train
from marscli.train.sft_resume import resume_fingerprint


def check_config(cfg: SftConfig) -> None:
    """Options out of range → BadInput naming the option (before the model or data load)."""
    check_range("--warmup-ratio", cfg.warmup_ratio, 0, 1, hi_open=True)
    check_range("--batch-size", cfg.batch_size, 1)
    check_range("--max-tokens", cfg.max_tokens, 2)
    check_range("--micro-batch-tokens", cfg.micro_batch_tokens, 1)
    check_range("--logp-chunk", cfg.logp_chunk, 1, cfg.mbt)  # a chunk ≤ a micro-batch
    cfg.check_common(cfg.optim())


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
        return train(job, policy, cfg, processor, spec, examples, bad, fp)
