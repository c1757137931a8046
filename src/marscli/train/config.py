"""The options of `update` and `sft`, each declared once as a field of its config.

`TrainOptions` holds what both take (AdamW, DeepSpeed, seeding, output); `UpdateConfig` and
`SftConfig` add their own, and sft changes two defaults (3 epochs at 1e-5). `plan` asks the
same questions of the memory as update's options (`PLAN_SHARED`). The ranges are checked by
the stages (`stages/update.py`, `stages/sft.py`). Light: the CLI imports this for `--help`;
torch and the trainer load when a command runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from marscli.options import option, same_as

if TYPE_CHECKING:
    from marscli.train.optim import OptimConfig


@dataclass
class TrainOptions:
    """Options `update` and `sft` share (each stage's config adds its own, and may change a
    default: sft trains 3 epochs at 1e-5)."""

    epochs: int = option(1, "Passes over the data (update: over the minibatches).")
    lr: float = option(1e-6, "AdamW (peak) learning rate.")
    adam_beta1: float = option(0.9)
    adam_beta2: float = option(0.999)
    adam_eps: float = option(1e-8)
    weight_decay: float = option(0.0)
    grad_clip: float = option(1.0, "Clip the gradient norm (0: off).")
    deepspeed: str | None = option(
        None, "DeepSpeed JSON config (recipes/ds_zero2.json, ds_zero3.json).", metavar="CONFIG")
    gradient_checkpointing: bool = option(False, "Recompute activations in backward.")
    freeze_vision: bool = option(False, "Do not train the vision tower and projector.")
    logp_chunk: int | None = option(
        None, "Loss positions whose logits [C, vocab] are formed at once: the log-probs and "
              "their backward go a chunk at a time (default: the largest power of two whose "
              "logits take at most 3 GiB, 1024 at Qwen's vocabulary, or --micro-batch-tokens "
              "when smaller; at most --micro-batch-tokens).", metavar="C")
    seed: int = option(0, "Shuffling and initialisation seed.")
    metrics: str | None = option(
        None, "Metrics JSONL, one line per step (default: OUT/metrics.jsonl).", metavar="FILE")
    device: str = option("auto", "auto, cpu or cuda.")
    save_dtype: str = option(
        "auto", "Of the HF export engines load: auto (bfloat16 on CUDA, float32 on CPU), "
                "float32, bfloat16 or input. The fp32 masters stay in OUT/train_state/.")
    force: bool = option(False, "Replace an existing OUT (sft: and a stale OUT.partial).")
    state_dir: str | None = option(
        None, "Write train_state/ into DIR/<OUT's name> (node-local storage: /dev/shm, a local "
              "NVMe) and OUT/train_state as a link to it (make rl STATE_DIR=...; `marscli "
              "state` copies it durably).", metavar="DIR")
    track: str | None = option(
        None, "Also send metrics to a tracker: tensorboard:DIR, wandb:PROJECT (offline) or "
              "jsonl:FILE (default: $MARSCLI_TRACK, else none).", metavar="SPEC")

    def adamw(self, **schedule: Any) -> OptimConfig:
        """AdamW's options with the stage's schedule (warmup_steps, schedule, min_lr_ratio)."""
        from marscli.train.optim import OptimConfig

        return OptimConfig(lr=self.lr, betas=(self.adam_beta1, self.adam_beta2),
                           eps=self.adam_eps, weight_decay=self.weight_decay,
                           grad_clip=self.grad_clip, **schedule)

    def chunk(self, micro_batch_tokens: int, vocab: int) -> int:
        """--logp-chunk, or its default: logprobs.default_chunk(vocab), at most the
        micro-batch."""
        from marscli.train.logprobs import chunk_size

        return chunk_size(self.logp_chunk, vocab, micro_batch_tokens)

    def check_common(self, optim: OptimConfig) -> None:
        """The shared options out of range → BadInput naming the option."""
        from marscli.errors import check_range
        from marscli.records.trackers import check_tracker
        from marscli.train.checkpoint import check_save_dtype

        check_range("--epochs", self.epochs, 1)
        optim.check("--lr-schedule")
        check_save_dtype(self.save_dtype)
        check_tracker(self.track)


@dataclass
class UpdateConfig(TrainOptions):
    loss: str = option("gspo", "Policy loss: gspo (the paper's) or grpo.")
    agg: str | None = option(
        None, "token-mean or seq-mean-token-mean (default: the loss's own: gspo "
              "seq-mean-token-mean, grpo token-mean).")
    clip_low: float = option(0.2, "Ratio clip below: 1 - clip_low.")
    clip_high: float = option(0.28, "Ratio clip above: 1 + clip_high.")
    kl: float = option(0.0, "k3 KL coefficient to --ref (0: no reference).")
    ref: str | None = option(None, "Reference checkpoint for --kl.")
    micro_batch_tokens: int = option(
        32768, "Token budget of a micro-batch (longest sequence x count; a longer sequence "
               "trains alone).")
    warmup_steps: int = option(0, "Linear warm-up steps.")
    lr_schedule: str = option("constant", "constant, cosine or linear.")
    keep_optimizer: bool = option(
        False, "Carry AdamW's state across iterations: load it from POLICY/train_state/ when "
               "present, write it to OUT/train_state/ (DeepSpeed: one file per rank, loaded on "
               "any number of ranks and ZeRO stage).")
    old_logp: str = option(
        "recompute", "π_old: recompute (a forward of --policy) or engine (the rollout's "
                     "log-probs, verl's bypass mode; rows without them exit 2).")
    rollout_is: str | None = option(
        None, "Rollout correction, weight π_old/π_engine per token: off, token-truncate, "
              "token-mask, sequence-truncate or sequence-mask (default: token-truncate with "
              "--old-logp recompute, off with engine).", metavar="MODE")
    rollout_is_cap: float = option(
        2.0, "C: truncate modes cap the weight at C, mask modes drop tokens (sequences) above "
             "it.")
    rollout_is_floor: float = option(
        0.0, "F: truncate modes raise the weight to F, mask modes drop tokens (sequences) below "
             "it.")

    @property
    def is_mode(self) -> str:
        """The rollout-correction mode this run uses (`rollout_is` resolved)."""
        if self.rollout_is is not None:
            return self.rollout_is
        return "off" if self.old_logp == "engine" else "token-truncate"

    def optim(self) -> OptimConfig:
        return self.adamw(warmup_steps=self.warmup_steps, schedule=self.lr_schedule)


@dataclass
class SftConfig(TrainOptions):
    epochs: int = option(3, "Passes over the data.")
    lr: float = option(1e-5, "AdamW peak learning rate.")
    warmup_ratio: float = option(
        0.03, "Linear warm-up over this fraction of the steps (rounded up).")
    lr_schedule: str = option(
        "cosine", "After warm-up: cosine, constant or linear.", aliases=("--schedule",))
    min_lr_ratio: float = option(0.0, "cosine/linear floor, as a fraction of --lr.")
    batch_size: int = option(32, "Sequences per optimiser step.")
    max_tokens: int = option(
        32768, "Longest sequence allowed (a longer row is a bad row; never truncated).")
    micro_batch_tokens: int | None = option(
        None, "Token budget of a micro-batch (longest sequence x count; default --max-tokens).")
    system_prompt: str | None = option(
        None, "Base system prompt for message rows without a system turn (as rollout's "
              "--system-prompt).", metavar="FILE")
    save_every_epoch: bool = option(
        False, "Keep a resumable state in OUT.partial/ after each epoch; re-running the command "
               "resumes from it.")
    skip_bad: bool = option(False, "Skip (and count) bad rows instead of exiting 2.")

    @property
    def mbt(self) -> int:
        return self.micro_batch_tokens or self.max_tokens

    def optim(self, warmup_steps: int = 0) -> OptimConfig:
        return self.adamw(warmup_steps=warmup_steps, schedule=self.lr_schedule,
                          min_lr_ratio=self.min_lr_ratio)


@dataclass
class PlanConfig:
    """What `marscli plan` asks of the launch: its shape, update's options of the same names,
    and the engine's."""

    gpus_per_node: int = option(8, "GPUs a node: the trainer's ranks a node.")
    nodes: int = option(1, "Nodes the trainer (update) runs on.")
    zero: int | None = option(
        None, "ZeRO stage: 0 (update without --deepspeed: plain torch), 2 or 3 (the default).")
    deepspeed: str | None = option(
        None, "update's --deepspeed config instead of --zero: its stage, offload and bucket "
              "sizes.", metavar="FILE")
    offload_optimizer: bool = option(False, "DeepSpeed keeps the fp32 states on the host.")
    micro_batch_tokens: int = same_as(UpdateConfig, "micro_batch_tokens")
    gradient_checkpointing: bool = same_as(UpdateConfig, "gradient_checkpointing")
    logp_chunk: int | None = same_as(UpdateConfig, "logp_chunk")
    freeze_vision: bool = same_as(UpdateConfig, "freeze_vision")
    keep_optimizer: bool = same_as(UpdateConfig, "keep_optimizer")
    ref: bool = option(False, "update scores a reference policy (--kl with --ref CKPT).")
    disk_gbps: float = option(
        2.0, "A node's throughput to the run folder in GB/s, for the disk figures; the default "
             "is an assumption for a shared file system, whose clients commonly reach 1-3 GB/s "
             "a node: measure yours with fio or dd.")
    loss_tokens: int | None = option(
        None, "Tokens under the loss in a micro-batch, at most (default: the worst case).")
    image_tokens: int | None = option(
        None, "Image tokens in a micro-batch, at most (default: the worst case).")
    tensor_parallel: int = option(
        1, "The engine's tensor parallelism (rollout's and serve's --tensor-parallel).",
        aliases=("--tp",))
    max_model_len: int = option(32768, "The engine's context length.")
    max_num_seqs: int = option(
        32, "Sequences the engine runs at once (rollout's --batch-size; serve's --max-batch).")
    gpu_memory_utilization: float = option(
        0.85, "The engine's share of a GPU (marscli's vllm engine: 0.85).")
    gpu_memory: str = option("80GiB", "Memory of one GPU: 80GiB, 141GB, ...")
    colocate: bool = option(
        False, "The engine stays up on the trainer's GPUs during the update (make rl SERVE=1 on "
               "the same nodes).")
    sleep_level: int = option(
        0, "With --colocate: 0 the engine stays awake (marscli's serve), 1 or 2 it sleeps "
           "(vLLM's sleep mode) during the update.")


@dataclass
class StateConfig:
    """`marscli state ACTION RUN K`'s options."""

    state: str | None = option(
        None, "This run's node-local working copies (make's RUN_STATE).",
        decls=("--state-dir",), metavar="DIR")
    keep: int = option(1, "prune: states of the last KEEP kept.")
    background: bool = option(False, "persist: copy in a process of its own.")
    lock_fd: int | None = option(None, hidden=True)
