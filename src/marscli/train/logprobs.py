"""Log-probs of the taken tokens from the final hidden states, in chunks of positions, so that
the [N, V] logits of a whole micro-batch never exist.

At Qwen's vocabulary (151,936) the fp32 logits of a 32,768-token row are 18.5 GiB, and
`cross_entropy` keeps its log-softmax for the backward: 55.6 GiB a micro-batch, more than the
rest of an 8B update together. Here the forward forms each chunk's logits [C, V], reduces them
to log-probs and frees them; the backward forms them again, a chunk at a time, and turns them
into the gradients of the hidden states and of the LM head's weight. The peak is one chunk's
logits (`BYTES_PER_LOGIT` C V) instead of the batch's.

The same approach as Liger-Kernel's fused linear cross-entropy (its `chunk_size`) and verl's
linear-cross-entropy kernels (`verl/utils/kernel/`), in plain torch: it runs on CPU, and it is
the reference a fused CUDA kernel would be checked against. `chunk=None` is the path without
chunks (the logits of every position at once), kept as the reference for the equality tests.

Numerics. A chunk runs the operations the whole-batch path ran (the head's matmul in the
weight's dtype, `.float()`, `cross_entropy`; in the backward, what their autograd computes,
in place), so one chunk that holds every position gives the same bits as before: the CPU demo, whose
micro-batches fit one chunk, is unchanged. The weight's gradient is each chunk's product
accumulated in float32 (cuBLAS's fp32 output for 16-bit inputs), summed over chunks in float32
and cast once, as one matmul over all positions rounds it once; a 16-bit sum over chunks
(Liger's choice) would round it once per chunk.

Import cost: none; torch loads inside the functions.
"""

from __future__ import annotations

from functools import cache
from typing import Any

# What one chunk of C positions holds at the backward's peak, per logit: the head's output in
# 16 bits (2), its float32 copy (4) and log-softmax (4); then the log-softmax (4) and the
# logits' gradient in float32 (4) and in the weight's dtype (2).
BYTES_PER_LOGIT = 12
LOGITS_BUDGET = 3 << 30  # one chunk's logits, at most: ~4% of an 80 GB GPU


def default_chunk(vocab: int) -> int:
    """The largest power of two whose chunk of logits fits LOGITS_BUDGET: 1024 at Qwen's
    vocabulary (1.7 GiB; Liger-Kernel's own rule gives 1024 for Qwen3-VL-8B at 32k tokens, and
    a 1,024-row matmul keeps a GPU's tensor cores busy), 65,536 at the tiny model's 3,690 (a
    micro-batch of the default 32,768 tokens is one chunk: the same bits as without chunks)."""
    c = max(1, LOGITS_BUDGET // (BYTES_PER_LOGIT * vocab))
    return 1 << (c.bit_length() - 1)


def chunk_size(logp_chunk: int | None, vocab: int, micro_batch_tokens: int) -> int:
    """The chunk update and sft run (and plan counts): --logp-chunk, or default_chunk(vocab)
    at most the micro-batch."""
    return logp_chunk or min(default_chunk(vocab), micro_batch_tokens)


def token_logprobs(hidden: Any, weight: Any, targets: Any, chunk: int | None) -> Any:
    """log p(targets[i] | hidden[i]) under the head `weight` [V, H]: float32 [N].

    `hidden` [N, H] and `weight` get gradients (when they require them); `targets` [N] are
    token ids. `chunk`: positions per chunk, None for all at once (the reference path)."""
    if chunk is None:
        return _logp(hidden, weight, targets)
    return _chunked_logp().apply(hidden, weight, targets, chunk)


def _logp(hidden: Any, weight: Any, targets: Any) -> Any:
    """The head, then log-probs, as the whole-batch path computes them: [N] float32."""
    import torch.nn.functional as F

    logits = F.linear(hidden, weight).float()  # [N, V]
    return -F.cross_entropy(logits, targets, reduction="none")


@cache
def _chunked_logp() -> type:
    """The autograd Function, built on first use (torch is imported then)."""
    import torch

    class ChunkedLogp(torch.autograd.Function):
        """Forward and backward a chunk of positions at a time (module docstring)."""

        @staticmethod
        def forward(ctx, hidden, weight, targets, chunk):
            ctx.save_for_backward(hidden, weight, targets)
            ctx.chunk = chunk
            return torch.cat([_logp(hidden[a:b], weight, targets[a:b])
                              for a, b in _spans(hidden.shape[0], chunk)])

        @staticmethod
        def backward(ctx, grad_out):
            hidden, weight, targets = ctx.saved_tensors
            want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
            grad_h = torch.empty_like(hidden) if want_h else None
            grad_w = None
            for a, b in _spans(hidden.shape[0], ctx.chunk):
                # cross_entropy's own backward (nll's, then log_softmax's kernel, written over
                # its input): g · (onehot − softmax), the same bits as autograd's
                ls = torch.log_softmax((hidden[a:b] @ weight.t()).float(), dim=-1)  # [C, V]
                d = torch.zeros_like(ls).scatter_(1, targets[a:b, None], grad_out[a:b, None])
                torch._log_softmax_backward_data(d, ls, -1, torch.float32, out=d)
                del ls
                d = d.to(hidden.dtype)  # the backward of `.float()`
                if want_h:
                    grad_h[a:b] = d @ weight
                if want_w:
                    grad_w = _accumulate(grad_w, d.t(), hidden[a:b])
                del d
            return grad_h, grad_w.to(weight.dtype) if want_w else None, None, None

    return ChunkedLogp


def _spans(n: int, chunk: int) -> list[tuple[int, int]]:
    return [(a, min(a + chunk, n)) for a in range(0, n, chunk)]


def _accumulate(acc: Any, a: Any, b: Any) -> Any:
    """acc + a @ b in float32 (acc None: a @ b alone, the whole-batch path's own product)."""
    import torch

    if a.dtype == torch.float32:
        return a @ b if acc is None else acc.addmm_(a, b)
    # 16-bit: cuBLAS's float32 output on CUDA; on CPU, which has no such kernel, widened first
    prod = torch.mm(a, b, out_dtype=torch.float32) if a.is_cuda else a.float() @ b.float()
    return prod if acc is None else acc.add_(prod)


def logp_head(lm_head: Any, chunk: int | None) -> Any:
    """A module in place of a causal LM's `lm_head` that holds the same weight (the same
    Parameter: its name, tying and any DeepSpeed partitioning are unchanged) and, given
    `targets`, returns their log-probs through `token_logprobs`.

    The computation happens inside the head module's own forward, so that DeepSpeed ZeRO-3's
    hooks gather the weight once for the whole micro-batch (before the forward, and again
    before the backward), never once per chunk; without `targets` it is the plain linear
    layer."""
    import torch.nn.functional as F
    from torch import nn

    if getattr(lm_head, "bias", None) is not None:
        raise ValueError("an LM head with a bias")

    class LogpHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = lm_head.weight
            self.chunk = chunk

        def forward(self, hidden, targets=None):
            if targets is None:
                return F.linear(hidden, self.weight)
            return token_logprobs(hidden, self.weight, targets, self.chunk)

    return LogpHead()
