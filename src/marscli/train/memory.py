"""Memory per GPU of an RL iteration, from a checkpoint's config.json alone (no torch, no
weights): the trainer (`update`: DeepSpeed ZeRO or plain torch) and the rollout engine (vLLM).
`marscli plan` (stages/plan.py) prints it. Every figure is bytes on one GPU; P is the parameter
count, Pt the trainable part of it, R = nodes x GPUs per node the data-parallel ranks.

Trainer, model states (DeepSpeed's accounting, `estimate_zero{2,3}_model_states_mem_needs`):
  torch (no --deepspeed)  fp32 weights 4P, fp32 grads 4Pt, AdamW moments 8Pt, and the bf16
                          copies autocast keeps of weights that need grads for the backward 2Pt
  ZeRO-2                  bf16 params 2P, and partitioned over R: bf16 grads 2Pt, fp32 grads
                          4Pt, fp32 masters 4Pt, moments 8Pt (DeepSpeed: 2P + 18P/R)
  ZeRO-3                  the largest layer's bf16 params and grads gathered whole 4L, and
                          partitioned: bf16 params 2P, then the 18Pt of ZeRO-2 (DeepSpeed's own
                          figure, 4L + 18P/R, leaves out the bf16 parameter partition 2P/R that
                          its offload figure keeps: it is on the GPU with or without offload)
  --offload-optimizer     the fp32 and optimiser parts (and ZeRO-2's grads) live on the host
Plus DeepSpeed's communication buckets (bf16) and a CUDA context.

Trainer, activations of one micro-batch of M tokens in rows padded to the longest, T tokens:
what autograd keeps for the backward in transformers' Qwen3-VL modules under SDPA (no [T, T]
scores), as tests/train/test_plan.py measures them on CPU. w is the compute dtype's bytes: 2 (bf16,
what update runs on GPUs, and what the plan prints), 4 (fp32, update on CPU: the tests measure
both). Per token and decoder layer, with h hidden, q = heads x head_dim, kv = kv_heads x
head_dim, f intermediate:
  2 RMSNorms: a 4-byte fp32 input, the scaled and the output (the projections' input)
                                                                  2 x (4 + 2w) h
  q/k norms (4 fp32 + w scaled), q after RoPE, attention output   (4 + 3w) q + (4 + w) kv
  K and V as attention gets them                                  2w kv, or 2w q when padded
  SwiGLU: gate, up, silu(gate), their product                     4w f
  attention log-sum-exp and the norms' 1/rms (fp32)               4 x (2 heads + kv_heads + 2)
  the [B, 1, T, T] mask SDPA converts to the compute dtype, when padded     w T
(bf16: 16h + 10q + 6kv + 4kv + 8f + ...), and RoPE's cos and sin, which every layer shares:
2w head_dim a token. Padded rows (several per micro-batch) are the worst case: transformers
then hands SDPA a mask, repeats K/V to every head, and SDPA keeps a copy of the mask; the plan
takes T = min(M / 2, max_model_len), and the boolean [B, 1, T, T] mask itself (M x T bytes)
lives through the whole step. A row longer than M trains alone in its micro-batch (update
never splits nor refuses a row), so when max_model_len > M the plan also takes one unpadded row
of max_model_len tokens. With --gradient-checkpointing only each layer's input (w h) stays,
and the backward recomputes one layer at a time (its activations plus ~2w (h + f) of
gradients in flight).
The loss: only the N loss tokens go through the LM head, and train/logprobs.py forms their
logits C = --logp-chunk positions at a time (default logprobs.default_chunk(V), at most the
micro-batch), so the [N, V] logits never exist. Saved for the backward: the final norm's
(4 + 2w) h a token, the head's input w h and its log-prob (4 bytes) a loss token. Beyond that,
with C no more than N and, after the first chunk, S = 4 V H the head weight's gradient summed
in fp32 over the chunks so far:
  forward    a chunk's fp32 logits and their log-softmax (the 16-bit head output is freed
             before the log-softmax exists)                                 8 C V
  backward   the head input's gradient [N, H], w N H, plus the highest of
               a chunk's fp32 log-softmax and its gradient (formed in place)     S + 8 C V
               16-bit: the chunk's gradient, 2 C V, beside its [V, H] product
                 with the chunk's inputs (cuBLAS's fp32 output)            S + 4 V H + 2 C V
               fp32: the chunk's gradient, 4 C V, and the sum (addmm_ in place)  4 V H + 4 C V
               the sum and its cast to the weight's dtype (none in fp32)     4 V H + 2 V H
(Checked on CPU in fp32; on CPU a 16-bit product is widened before the matmul, which costs
more than cuBLAS's fp32 output: the plan counts CUDA's.) At Qwen3-VL-8B (V = 151,936, H =
4,096, C = 1,024) the forward holds 1.2 GiB and the backward 4.9 GiB, nearly all the two
[V, H] fp32 buffers; the [N, V] fp32 logits formed whole, as update did before logprobs.py,
peak at 12 V bytes a loss token (cross-entropy's saved softmax and two gradients): 55.6 GiB at
32,768 loss tokens.
The vision tower (trained unless --freeze-vision; bf16 figures), for I image tokens = I m^2
patches of width hv (mlp fv, heads hh): per patch and block 22hv + 4fv + 4hh + 16 (2 LayerNorm
inputs, qkv output, q/k after RoPE, attention input and output, GELU MLP, statistics), or 2hv
with checkpointing (plus one block recomputed); each patch merger keeps 8 hv m^2 a token.
The worst micro-batch is the larger of: every token under the loss, every token an image
token (the cost is linear in each, so a mix is never worse); --loss-tokens / --image-tokens
pin one.
Scoring (π_old recomputed, the --ref forward): no grad, so one layer's activations at a time,
or the head: the final norm's 4h a token, the head's input and one chunk's 8 C V, beside the
reference's weights.

Disk, per iteration (the run folder, at --disk-gbps a node): update writes the HF export (2P,
bf16, from rank 0: its node), the fp32 masters (4Pt) and with --keep-optimizer AdamW's moments
(8Pt), each rank its 1/R share (ZeRO; plain torch: rank 0 all of it); the next update reads
them back, with its input export (2P) and the reference's with --ref (2P), read on rank 0's
node under ZeRO-3 (rank 0 reads the files) and once a node otherwise (its ranks share the page
cache). The plan counts rank 0's node, the busiest. Each engine reads the export (2P) when it
starts, apart from update's I/O.

Engine (vLLM), per GPU of a tensor-parallel group of T:
  weights      2P / T (bf16; the vision tower is sharded too, vLLM's default)
  KV cache     2 (K, V) x layers x max(kv_heads / T, 1) x head_dim x 2 bytes a token
  overhead     CUDA context, CUDA graphs (1 GiB each, assumed), the profile forward of
               max_num_batched_tokens (vLLM's default for the LLM class: 16384 on GPUs of
               70 GiB or more, else 8192) or of the largest image, the encoder cache and the
               sampler's [max_num_seqs, V] fp32 logits
vLLM claims gpu_memory_utilization x the GPU and fills what weights and overhead leave with
KV cache; it refuses to start if that holds no full max_model_len sequence.

Colocation (trainer and engine on the same GPUs). marscli's stages are processes: `make rl`
runs rollout, then update, each exiting before the next, so the two never share a GPU at once
(not colocated, as far as memory goes). `make rl SERVE=1` keeps one `marscli serve` up for the
whole run; on the trainer's GPUs it holds its full budget during the update (marscli's server
has no sleep mode): the trainer must fit beside it. With a sleep mode (vLLM's `sleep(level)`:
level 1 moves the weights to host memory and drops the KV cache, level 2 drops both) the
sleeping engine keeps its CUDA context only (1 GiB assumed).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from marscli.train.logprobs import chunk_size  # no torch at its import

GiB = 1 << 30
CUDA_CONTEXT = 1 * GiB  # a process's non-torch memory: CUDA context, cuBLAS and NCCL workspaces
CUDA_GRAPHS = 1 * GiB  # vLLM's captured graphs (its logs: 0.3 to 1.5 GiB at 8B)
SLEEPING_ENGINE = CUDA_CONTEXT  # what a vLLM engine asleep (level 1 or 2) keeps on the GPU
# Qwen3-VL's image processor: size.longest_edge, the most pixels one image keeps (16384
# tokens after the 2x2 merge of 16-pixel patches).
QWEN3_VL_MAX_PIXELS = 16_777_216
# The recipes' DeepSpeed buckets (recipes/ds_zero2.json; ds_zero3.json's "auto" values, which
# train/dsconfig.py resolves from the hidden size h), in elements.
ZERO2_BUCKETS = {"reduce_bucket_size": 200_000_000, "allgather_bucket_size": 200_000_000}
ZERO3_AUTO = {"reduce_bucket_size": lambda h: h * h,
              "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h)}
STAGES = ("torch", 0, 1, 2, 3)  # "torch": update without --deepspeed
# An assumed throughput of one node to the run folder on a shared file system (NFS and
# parallel file system clients commonly reach 1-3 GB/s a node); measure yours (fio, dd).
DISK_GBPS = 2.0


# ------------------------------------------------------------------------------ the model


@dataclass(frozen=True)
class Vision:
    hidden: int
    intermediate: int
    depth: int
    heads: int
    patch: int
    temporal_patch: int
    in_channels: int
    merge: int
    out_hidden: int
    positions: int
    deepstack: int  # DeepStack mergers (len(deepstack_visual_indexes))
    max_pixels: int = QWEN3_VL_MAX_PIXELS

    @property
    def patches_per_token(self) -> int:
        return self.merge * self.merge

    @property
    def max_image_tokens(self) -> int:
        return max(1, self.max_pixels // (self.patch * self.merge) ** 2)


@dataclass(frozen=True)
class Shape:
    """A Qwen3 / Qwen3-VL dense model, as its config.json gives it."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool = False
    attention_bias: bool = False
    vision: Vision | None = None

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.kv_heads * self.head_dim


def param_counts(s: Shape) -> dict[str, int]:
    """Parameters as transformers' Qwen3VLForConditionalGeneration holds them: `total`,
    `text`, `vision`, and `largest_layer` (DeepSpeed's: the most parameters one module holds
    itself, here the embedding or the LM head)."""
    h, q, kv, f, v = s.hidden, s.q, s.kv, s.intermediate, s.vocab
    bias = (q + 2 * kv + h) if s.attention_bias else 0
    layer = h * (q + 2 * kv) + q * h + bias + 3 * h * f + 2 * h + 2 * s.head_dim
    text = v * h + s.layers * layer + h + (0 if s.tied else v * h)
    modules = [v * h, h * q + (q if s.attention_bias else 0), h * f]
    vision = 0
    if s.vision:
        vis = s.vision
        hv, fv, wide = vis.hidden, vis.intermediate, vis.hidden * vis.patches_per_token
        conv = hv * vis.in_channels * vis.temporal_patch * vis.patch ** 2 + hv
        block = 4 * hv + (3 * hv * hv + 3 * hv) + (hv * hv + hv) + 2 * hv * fv + fv + hv
        fc1, fc2 = wide * wide + wide, wide * vis.out_hidden + vis.out_hidden
        merger = 2 * hv + fc1 + fc2  # the final merger normalises each patch (width hv)
        deepstack = vis.deepstack * (2 * wide + fc1 + fc2)  # these normalise merged tokens
        vision = conv + vis.positions * hv + vis.depth * block + merger + deepstack
        modules += [conv, vis.positions * hv, 3 * hv * hv + 3 * hv, hv * fv + fv, fc1, fc2]
    return {"total": text + vision, "text": text, "vision": vision,
            "largest_layer": max(modules)}


# ------------------------------------------------------------------------------ options


@dataclass(frozen=True)
class Options:
    """What `marscli plan` takes (defaults: update's and marscli's vllm engine's)."""

    gpus_per_node: int = 8
    nodes: int = 1
    zero: int | str = 3  # STAGES
    offload_optimizer: bool = False
    offload_params: bool = False
    buckets: dict[str, int] | None = None  # DeepSpeed buckets (elements); None: the recipes'
    overlap_comm: bool = False
    micro_batch_tokens: int = 32_768
    gradient_checkpointing: bool = False
    logp_chunk: int | None = None  # None: update's default (chunk())
    freeze_vision: bool = False
    ref: bool = False  # update scores a reference policy (--kl with --ref)
    loss_tokens: int | None = None  # None: the worst split (module docstring)
    image_tokens: int | None = None
    tp: int = 1
    max_model_len: int = 32_768
    max_num_seqs: int = 32  # rollout's --batch-size (serve: --max-batch 256)
    gpu_memory_utilization: float = 0.85
    max_num_batched_tokens: int | None = None  # None: vLLM's default for the GPU's size
    gpu_memory: int = 80 * GiB
    colocate: bool = False
    sleep_level: int = 0  # 0: the engine stays awake (marscli's serve), 1 or 2: vLLM's sleep
    keep_optimizer: bool = False  # update writes (and the next reads) AdamW's moments
    disk_gbps: float = DISK_GBPS  # a node's throughput to the run folder, GB/s
    # The compute dtype's bytes: 2 (bf16, update on GPUs); 4 (fp32, update on CPU, what the
    # tests measure). Not an option of plan: a plan is for GPUs.
    dtype_bytes: int = 2

    @property
    def ranks(self) -> int:
        return self.gpus_per_node * self.nodes

    def chunk(self, vocab: int) -> int:
        """Loss positions a chunk (train/logprobs.py): --logp-chunk, or update's default for
        the vocabulary, at most --micro-batch-tokens."""
        return chunk_size(self.logp_chunk, vocab, self.micro_batch_tokens)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ------------------------------------------------------------------------------ trainer


def model_states(total: int, trainable: int, largest: int, stage: int | str, ranks: int, *,
                 offload_optimizer: bool = False, offload_params: bool = False
                 ) -> dict[str, int]:
    """The trainer's model states per GPU by part (module docstring). Partitions round up,
    as every rank holds ceil(P/R) elements."""
    P, Pt, R = total, trainable, ranks
    if stage == "torch":
        return {"fp32 weights": 4 * P, "fp32 grads": 4 * Pt, "AdamW moments (fp32)": 8 * Pt,
                "bf16 autocast weight copies": 2 * Pt}  # autocast caches trainable leaves
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage {stage!r}")
    part = (lambda n: _cdiv(n, R)) if stage else (lambda n: n)
    out: dict[str, int] = {}
    if stage == 3:
        out["bf16 params + grads, largest layer gathered"] = 4 * largest
        if offload_params:
            return out
        out["bf16 params (partition)"] = 2 * part(P)
    else:
        out["bf16 params"] = 2 * P
    if offload_optimizer:  # DeepSpeed copies the grads out as they are reduced
        return out
    out["bf16 grads" + (" (partition)" if stage >= 2 else "")] = (
        2 * part(Pt) if stage >= 2 else 2 * Pt)
    out["fp32 grads" + (" (partition)" if stage else "")] = 4 * part(Pt)
    out["fp32 master weights" + (" (partition)" if stage else "")] = 4 * part(Pt)
    out["AdamW moments" + (" (partition)" if stage else "")] = 8 * part(Pt)
    return out


def host_offload(total: int, largest: int, stage: int | str, o: Options) -> int:
    """Host memory per node for the offloaded states: DeepSpeed's own estimate (its 1.5 buffer
    factor; ZeRO-3 with zero.Init, as its estimator's default)."""
    if stage == 2 and o.offload_optimizer:
        return int(total * max(4 * o.ranks, 16) * 1.5)
    if stage == 3 and (o.offload_optimizer or o.offload_params):
        return int(total * (18 if o.offload_params else 16) / o.nodes * 1.5)
    return 0


def host_per_node(total: int, largest: int, stage: int | str, o: Options) -> dict[str, int]:
    """Host memory a trainer node needs: the model as update loads it on the CPU (bf16 under
    DeepSpeed's bf16, fp32 in plain torch; whole in every rank, except under ZeRO-3, which
    builds it partitioned: each rank its share), what rank 0 holds while it writes the HF
    export (one parameter at a time: the largest gathered in fp32 and its bf16 copy; the fp32
    masters and moments are written by each rank slice by slice, never gathered), and the
    offloaded states."""
    per_param = 4 if stage == "torch" else 2
    load = o.gpus_per_node * per_param * total
    return {"model load (every rank)" if stage != 3 else "model load (partitioned)":
            load if stage != 3 else -(-load // o.ranks),
            "HF export, a parameter at a time (rank 0)": 6 * largest,
            "offloaded states": host_offload(total, largest, stage, o)}


def zero_buffers(stage: int | str, hidden: int, o: Options) -> int:
    """DeepSpeed's bf16 communication buckets on each GPU."""
    b = o.buckets
    if stage == 2 or stage == 1:
        b = b if b is not None else ZERO2_BUCKETS
        reduce = b.get("reduce_bucket_size", 500_000_000) * (2 if o.overlap_comm else 1)
        return 2 * (reduce + b.get("allgather_bucket_size", 500_000_000))
    if stage == 3:
        b = b if b is not None else {k: fn(hidden) for k, fn in ZERO3_AUTO.items()}
        return 2 * (b.get("reduce_bucket_size", 500_000_000)
                    + b.get("stage3_prefetch_bucket_size", 50_000_000))
    return 0


def reference_weights(total: int, largest: int, stage: int | str, ranks: int) -> int:
    """The reference policy update scores with --kl: bf16 (fp32 in plain torch), partitioned
    under ZeRO-3 (plus its largest layer gathered)."""
    if stage == "torch":
        return 4 * total
    if stage == 3:
        return 2 * _cdiv(total, ranks) + 2 * largest
    return 2 * total


def row_length(o: Options, tokens: int) -> int | None:
    """T, the padded row length of the worst micro-batch (module docstring); None for a
    1-token micro-batch (one row, nothing padded)."""
    return min(tokens // 2, o.max_model_len) if tokens >= 2 else None


def layer_bytes(s: Shape, row: int | None = None, w: int = 2) -> int:
    """Saved for the backward, per token, by one decoder layer (module docstring): in rows
    padded to `row` tokens, or None for one unpadded row; `w` the compute dtype's bytes."""
    kv_in = s.q if row else s.kv  # padded: transformers repeats K/V to every head for SDPA
    return (2 * (4 + 2 * w) * s.hidden + (4 + 3 * w) * s.q + (4 + w) * s.kv + 2 * w * kv_in
            + 4 * w * s.intermediate + 4 * (2 * s.heads + s.kv_heads + 2)
            + (w * row if row else 0))


def vision_block_bytes(v: Vision) -> int:
    """Saved for the backward, per patch, by one vision block (module docstring)."""
    return 22 * v.hidden + 4 * v.intermediate + 4 * v.heads + 16


# The parts of the activations' table that the chunked log-probs add.
LOGITS = "logits of one chunk [C, V] fp32"
HEAD_GRAD = "LM head weight gradient [V, H] fp32"
INPUT_GRAD = "LM head input gradient [N, H]"
MASK = "attention mask [B, 1, T, T]"


def logp_moments(s: Shape, o: Options, loss: int) -> dict[str, dict[str, int]]:
    """What the chunked log-probs of `loss` positions (train/logprobs.py) hold beyond the
    head's saved input, at the highest point of their forward and of their backward (module
    docstring)."""
    if loss <= 0:
        return {"loss forward": {}, "loss backward": {}}
    w, C = o.dtype_bytes, min(o.chunk(s.vocab), loss)
    cv, vh = C * s.vocab, s.vocab * s.hidden
    acc = 4 * vh if loss > C else 0  # the fp32 sum of the earlier chunks' products
    product = ({LOGITS: 4 * cv, HEAD_GRAD: 4 * vh} if w >= 4  # addmm_ into the sum
               else {LOGITS: w * cv, HEAD_GRAD: acc + 4 * vh})  # cuBLAS's fp32 product
    backward = max(({LOGITS: 8 * cv, HEAD_GRAD: acc}, product,
                    {LOGITS: 0, HEAD_GRAD: 4 * vh + (w * vh if w < 4 else 0)}),  # the cast
                   key=lambda m: sum(m.values()))
    return {"loss forward": {LOGITS: 8 * cv},
            "loss backward": {**backward, INPUT_GRAD: w * loss * s.hidden}}


def activations(s: Shape, o: Options, tokens: int, loss: int, images: int, *,
                lone: bool = False) -> dict[str, Any]:
    """Training activations of one micro-batch of `tokens` tokens (`lone`: one unpadded row,
    longer than --micro-batch-tokens), `loss` of them under the loss and `images` of them
    image tokens: the parts held at each moment that can be highest (the loss's forward and
    backward; with checkpointing, a layer's recompute; the vision tower's backward), the
    highest, and what it holds."""
    h, L, w = s.hidden, s.layers, o.dtype_bytes
    row = None if lone else row_length(o, tokens)
    mask = tokens * row if row else 0
    per_layer = layer_bytes(s, row, w)
    rope = tokens * 2 * w * s.head_dim  # cos and sin, which every layer shares
    stored = rope + tokens * L * (w * h if o.gradient_checkpointing else per_layer)
    decoder = "decoder" + (" (layer inputs)" if o.gradient_checkpointing else "")
    head = tokens * (4 + 2 * w) * h + loss * (w * h + 4)  # final norm; head input, log-prob
    vision, vision_block = vision_activations(s, o, images)
    lp = logp_moments(s, o, loss)
    moments = {k: {decoder: stored, "final norm + LM head input": head, **lp[k],
                   "vision tower": vision, MASK: mask} for k in ("loss forward", "loss backward")}
    if o.gradient_checkpointing:
        recompute = tokens * (per_layer + 2 * w * (h + s.intermediate))
        moments["layer recompute"] = {decoder: stored, "decoder layer recomputed": recompute,
                                      "vision tower": vision, MASK: mask}
    moments["vision backward"] = {"vision tower": vision, "vision block recomputed": vision_block,
                                  MASK: mask}  # the tower's backward comes last
    totals = {k: sum(v.values()) for k, v in moments.items()}
    at = max(totals, key=lambda k: totals[k])
    return {"tokens": tokens, "loss_tokens": loss, "image_tokens": images, "row": row,
            "lone": lone, "parts": {k: v for k, v in moments[at].items() if v},
            "peak": totals[at], "peak_at": at, "moments": totals}


def vision_activations(s: Shape, o: Options, images: int) -> tuple[int, int]:
    """The vision tower's part of a micro-batch with `images` image tokens: what it keeps
    through the step, and (with checkpointing) the one block its backward recomputes."""
    v = s.vision
    if not v or images <= 0:
        return 0, 0
    out = images * v.out_hidden * 2 * (1 + v.deepstack)  # the features the decoder takes
    if o.freeze_vision:
        return out, 0
    patches = images * v.patches_per_token
    block = patches * vision_block_bytes(v)
    blocks = patches * v.depth * 2 * v.hidden if o.gradient_checkpointing else v.depth * block
    mergers = images * (1 + v.deepstack) * 8 * v.hidden * v.patches_per_token
    conv_input = patches * 2 * v.in_channels * v.temporal_patch * v.patch ** 2
    return out + blocks + mergers + conv_input, block if o.gradient_checkpointing else 0


def scoring_activations(s: Shape, o: Options, tokens: int, loss: int, images: int, *,
                        lone: bool = False) -> int:
    """No-grad forward (π_old, the reference): one layer, or the head and one chunk's
    logits, or one vision block at a time."""
    row = None if lone else row_length(o, tokens)
    patches = images * s.vision.patches_per_token if s.vision and images else 0
    vis = patches * vision_block_bytes(s.vision) if patches else 0
    head = (tokens * 4 * s.hidden + loss * (o.dtype_bytes * s.hidden + 8)
            + 8 * min(o.chunk(s.vocab), loss) * s.vocab)
    return (tokens * row if row else 0) + max(
        tokens * layer_bytes(s, row, o.dtype_bytes), head, vis)


def splits(s: Shape, o: Options, tokens: int) -> list[tuple[int, int]]:
    """(loss tokens, image tokens) micro-batches to take the worst of: both extremes unless
    --loss-tokens or --image-tokens pins the split (the other gets the rest)."""
    images = o.image_tokens if s.vision else 0
    if o.loss_tokens is None and images is None:
        return [(tokens, 0), (0, tokens)]
    if o.loss_tokens is None:
        img = min(images, tokens)
        return [(tokens - img, img)]
    loss = min(o.loss_tokens, tokens)
    return [(loss, tokens - loss if images is None else min(images, tokens - loss))]


def micro_batches(o: Options, tokens: int, lone_rows: bool) -> list[tuple[int, bool]]:
    """(tokens, lone) of the micro-batches to plan: `tokens` in padded rows and, when
    max_model_len is longer (and `lone_rows`), a row of max_model_len alone."""
    lone = [(o.max_model_len, True)] if lone_rows and o.max_model_len > tokens else []
    return [(tokens, False), *lone]


def trainer(s: Shape, o: Options, counts: dict[str, int], tokens: int | None = None, *,
            lone_rows: bool = True) -> dict[str, Any]:
    """The trainer's peak per GPU: its phases (a training micro-batch; scoring; the torch
    optimiser step) and their parts. `tokens`: the micro-batch budget (default
    --micro-batch-tokens); `lone_rows`: also a row of max_model_len alone, when longer."""
    tokens = o.micro_batch_tokens if tokens is None else tokens
    P, L = counts["total"], counts["largest_layer"]
    Pt = P - counts["vision"] if o.freeze_vision else P
    stage = o.zero
    states = model_states(P, Pt, L, stage, o.ranks, offload_optimizer=o.offload_optimizer,
                          offload_params=o.offload_params)
    st = sum(states.values())
    buffers = zero_buffers(stage, s.hidden, o)
    ref = reference_weights(P, L, stage, o.ranks) if o.ref else 0
    batches = [(m, lone, n, i) for m, lone in micro_batches(o, tokens, lone_rows)
               for n, i in splits(s, o, m)]
    acts = [activations(s, o, m, n, i, lone=lone) for m, lone, n, i in batches]
    act = max(acts, key=lambda a: a["peak"])
    score = max(scoring_activations(s, o, m, n, i, lone=lone) for m, lone, n, i in batches)
    base = CUDA_CONTEXT + st + buffers
    phases = {"training micro-batch": base + act["peak"], "scoring (no grad)": base + ref + score}
    if stage == "torch":  # AdamW's foreach temporaries (or the flat all-reduce buffer)
        phases["optimiser step"] = CUDA_CONTEXT + st - states["bf16 autocast weight copies"] \
            + 4 * Pt
    phase = max(phases, key=lambda k: phases[k])
    return {"model_states": st, "activations": act["peak"], "reference": ref,
            "buffers": buffers, "context": CUDA_CONTEXT, "total": phases[phase],
            "peak_phase": phase, "phases": phases, "model_state_parts": states,
            "activation_parts": act["parts"], "activation_split": {
                "tokens": act["tokens"], "row": act["row"], "lone_row": act["lone"],
                "loss_tokens": act["loss_tokens"], "image_tokens": act["image_tokens"],
                "logp_chunk": o.chunk(s.vocab), "peak_at": act["peak_at"],
                "moments": act["moments"], "parts_at_peak": list(act["parts"])},
            "splits": [{"tokens": a["tokens"], "lone_row": a["lone"],
                        "loss_tokens": a["loss_tokens"], "image_tokens": a["image_tokens"],
                        "activations": a["peak"]} for a in acts],
            "scoring_activations": score, "trainable_params": Pt, "stage": stage,
            "host_per_node": host_per_node(P, L, stage, o)}


def disk(counts: dict[str, int], o: Options, trainable: int) -> dict[str, Any]:
    """Bytes an iteration moves through the run folder on rank 0's node, the busiest: what
    update writes, what the next update reads back, and the seconds each takes at
    o.disk_gbps; apart, what each engine reads when it starts (module docstring)."""
    P, Pt = counts["total"], trainable
    whole = o.zero in ("torch", 0)  # one rank writes it all (stage 0 partitions nothing)

    def node(n: int) -> int:  # rank 0's node's share of a state each rank writes 1/R of
        return n if whole else _cdiv(n, o.ranks) * o.gpus_per_node

    state = {"fp32 masters": node(4 * Pt),
             "AdamW moments (--keep-optimizer)": node(8 * Pt) if o.keep_optimizer else 0}
    written = {"HF export (bf16)": 2 * P, **state}
    read = {"input HF export (bf16)": 2 * P, "reference HF export (--ref)": 2 * P if o.ref else 0,
            **state}
    bps = o.disk_gbps * 1e9
    w, r = sum(written.values()), sum(read.values())
    return {"gbps": o.disk_gbps, "written": written, "read": read, "write_bytes": w,
            "read_bytes": r, "write_seconds": w / bps, "read_seconds": r / bps,
            "engine_read_bytes": 2 * P, "engine_read_seconds": 2 * P / bps}


# ------------------------------------------------------------------------------ engine


def kv_bytes_per_token(s: Shape, tp: int) -> int:
    """K and V of every layer for one token, on one GPU of a tensor-parallel group (a KV head
    is replicated when the group is larger than the KV head count)."""
    return 2 * s.layers * max(s.kv_heads // tp, 1) * s.head_dim * 2


def batched_tokens(o: Options) -> int:
    if o.max_num_batched_tokens is not None:
        return o.max_num_batched_tokens
    return 16_384 if o.gpu_memory >= 70 * GiB else 8_192


def engine(s: Shape, o: Options, counts: dict[str, int]) -> dict[str, Any]:
    """vLLM on one GPU of its tensor-parallel group: its budget, weights, overhead, and the
    KV cache the rest holds."""
    T = o.tp
    weights = 2 * _cdiv(counts["total"], T)
    B = batched_tokens(o)
    text = B * (4 * s.hidden + (6 * s.intermediate + 2 * (s.q + 2 * s.kv)) // T)
    vis, cache = 0, 0
    if s.vision:
        v = s.vision
        patches = v.max_image_tokens * v.patches_per_token
        vis = patches * (4 * v.hidden + (8 * v.hidden + 4 * v.intermediate) // T)
        cache = max(B, v.max_image_tokens) * v.out_hidden * 2 * (1 + v.deepstack)
    sampler = o.max_num_seqs * s.vocab * 4 * 3
    overhead = {"CUDA context": CUDA_CONTEXT, "CUDA graphs": CUDA_GRAPHS,
                "profile forward": max(text, vis), "encoder cache": cache, "sampler": sampler}
    budget = int(o.gpu_memory_utilization * o.gpu_memory)
    kv = budget - weights - sum(overhead.values())
    per_token = kv_bytes_per_token(s, T)
    full = o.max_model_len * per_token
    return {"weights": weights, "kv_cache": max(kv, 0), "overhead": sum(overhead.values()),
            "total": budget, "overhead_parts": overhead, "kv_bytes_per_token": per_token,
            "kv_tokens": max(kv, 0) // per_token, "kv_needed": o.max_num_seqs * full,
            "full_sequences": round(max(kv, 0) / full, 2), "starts": kv >= full,
            "min_utilization": (weights + sum(overhead.values()) + full) / o.gpu_memory,
            "max_num_batched_tokens": B}


# ------------------------------------------------------------------------------ the plan


def trainer_budget(o: Options) -> tuple[int, str]:
    """What the trainer may use of a GPU, and why."""
    G = o.gpu_memory
    if not o.colocate:
        return G, "not colocated: the trainer has the GPU to itself"
    if o.sleep_level:
        return G - SLEEPING_ENGINE, (f"colocated, the engine asleep (level {o.sleep_level}) "
                                     "during the update: its CUDA context stays")
    held = int(o.gpu_memory_utilization * G)
    return G - held, "colocated, the engine awake during the update: it keeps its budget"


def largest(fits: Callable[[int], bool], lo: int, hi: int) -> int | None:
    """The largest n in [lo, hi] with fits(n) (fits is monotone), None if none."""
    if not fits(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def plan(s: Shape, o: Options) -> dict[str, Any]:
    """The whole plan: trainer, engine, whether both fit, the largest gpu_memory_utilization
    and micro-batch that do, and notes."""
    counts = param_counts(s)
    t = trainer(s, o, counts)
    e = engine(s, o, counts)
    G = o.gpu_memory
    budget, why = trainer_budget(o)
    trainer_fits = t["total"] <= budget
    fits = trainer_fits and e["starts"]
    min_u = math.ceil(e["min_utilization"] * 100) / 100
    if o.colocate and not o.sleep_level:
        hi = math.floor((G - t["total"]) / G * 100) / 100
        max_u = hi if hi >= min_u else None
        u_basis = "the trainer's peak beside the awake engine"
    else:
        max_u = math.floor((G - CUDA_CONTEXT) / G * 100) / 100
        u_basis = ("the GPU less the engine's own CUDA context (vLLM wants U x the GPU free "
                   "when it starts)")
        max_u = max_u if max_u >= min_u else None

    def micro_fits(m: int) -> bool:  # m tokens in padded rows (a longer row: trainer's own)
        return trainer(s, o, counts, m, lone_rows=False)["total"] <= budget

    max_m = largest(micro_fits, 1, 1 << 20)
    # a longer row trains alone: what a row of max_model_len needs beside the largest budget
    lone = (trainer(s, o, counts, max_m)["total"]
            if max_m is not None and max_m < o.max_model_len else None)
    notes = _notes(s, o, t, e, max_m, G - t["total"] if not o.colocate else budget - t["total"],
                   lone, budget)
    return {"inputs": {**{k: v for k, v in asdict(o).items() if k != "buckets"},
                       "buckets": o.buckets, "ranks": o.ranks},
            "model": {**counts, **{k: v for k, v in asdict(s).items() if k != "vision"},
                      "vision_config": asdict(s.vision) if s.vision else None},
            "trainer": t, "engine": e, "disk": disk(counts, o, t["trainable_params"]),
            "fits": fits, "trainer_fits": trainer_fits, "engine_fits": e["starts"],
            "trainer_budget": budget, "mode": why,
            "max_gpu_memory_utilization": max_u, "min_gpu_memory_utilization": min_u,
            "max_gpu_memory_utilization_basis": u_basis, "max_micro_batch_tokens": max_m,
            "notes": notes,
            "assumptions": {"cuda_context": CUDA_CONTEXT, "cuda_graphs": CUDA_GRAPHS,
                            "sleeping_engine": SLEEPING_ENGINE,
                            "max_image_pixels": s.vision.max_pixels if s.vision else None}}


def _notes(s: Shape, o: Options, t: dict, e: dict, max_m: int | None, room: int,
           lone: int | None, budget: int) -> list[str]:
    notes = []
    sp = t["activation_split"]
    logits = t["activation_parts"].get(LOGITS, 0)
    if logits and logits >= t["activations"] / 2:
        notes.append(f"one chunk's logits are {logits / GiB:.1f} GiB of the activations "
                     f"({sp['peak_at']}, --logp-chunk {o.chunk(s.vocab):,} x vocabulary "
                     f"{s.vocab:,}): a smaller --logp-chunk lowers them")
    if sp["lone_row"]:
        notes.append(f"the largest micro-batch is one row of max_model_len {o.max_model_len:,}"
                     f" tokens: a row longer than --micro-batch-tokens {o.micro_batch_tokens:,}"
                     " trains alone" + ("" if t["total"] <= budget else
                                        ", so no smaller --micro-batch-tokens helps"))
    if max_m is not None and max_m < o.micro_batch_tokens:
        notes.append(f"--micro-batch-tokens {max_m:,} at most fits in padded rows; a longer "
                     "row trains alone" + ("" if lone is None else (
                         f", and one of max_model_len {o.max_model_len:,} then needs "
                         f"{lone / GiB:.2f} GiB: "
                         + ("it fits" if lone <= budget else "it does not fit either"))))
    if max_m is None:
        notes.append("even a 1-token micro-batch does not fit: " + (
            "a smaller --gpu-memory-utilization, a sleeping engine or separate GPUs"
            if o.colocate and not o.sleep_level else
            "more GPUs (ZeRO-3 partitions by their number) or --offload-optimizer"))
    if e["starts"] and e["full_sequences"] < o.max_num_seqs:
        notes.append(f"the KV cache holds {e['full_sequences']} sequences of max_model_len "
                     f"(max_num_seqs {o.max_num_seqs}): shorter ones share it, and vLLM "
                     "preempts when it runs out")
    if 0 <= room < 0.08 * o.gpu_memory:
        notes.append(f"only {room / GiB:.1f} GiB to spare: allocator fragmentation often "
                     "costs 5-10% of the GPU")
    return notes
