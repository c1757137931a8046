"""Log-probs of the taken tokens from the final hidden states, in chunks of positions, so that
the [N, V] logits of a whole micro-batch never exist.

At Qwen's vocabulary (151,936) the fp32 logits of a 32,768-token row are 18.5 GiB, and
`cross_entropy` keeps its softmax for the backward: 55.6 GiB a micro-batch, more than the rest
of an 8B update together. Here the forward forms each chunk's logits [C, V], reduces them to
log-probs and a log-sum-exp per token, and frees them; the backward forms them again, a chunk
at a time, and turns them into the gradients of the hidden states and of the LM head's weight.
The peak is one chunk's logits (about 12 C V bytes) instead of the batch's.

The same approach as Liger-Kernel's fused linear cross-entropy (its `chunk_size`) and verl's
linear-cross-entropy kernels (`verl/utils/kernel/`), in plain torch: it runs on CPU, and it is
the reference a fused CUDA kernel would be checked against. `chunk=None` is the path without
chunks (the logits of every position at once, through `cross_entropy`), kept as the reference
for the equality tests.

Numerics: each chunk's logits are the head's output in the weight's dtype, then float32, as
before. The weight's gradient is each chunk's product accumulated in float32 (cuBLAS's fp32
output for 16-bit inputs), summed over chunks in float32 and cast once, as one matmul over all
positions rounds it once: a 16-bit sum over chunks would round it once per chunk (Liger's
choice; here that measured 0.4% off the whole-batch gradient in bf16 at 7-token chunks).

Import cost: none; torch loads inside the functions.
"""

from __future__ import annotations

from functools import cache
from typing import Any

# Positions whose logits are formed at once. Liger-Kernel's rule (its chunk's logits no larger
# than the head's input, C V ≈ N H) gives 1024 for Qwen3-VL-8B at 32k tokens; a chunk costs
# about 12 C V bytes: 1.74 GiB at V = 151,936, ~2% of an 80 GB GPU, and a matmul of 1,024 rows
# keeps a GPU's tensor cores busy.
DEFAULT_CHUNK = 1024


def token_logprobs(hidden: Any, weight: Any, targets: Any, chunk: int | None) -> Any:
    """log p(targets[i] | hidden[i]) under the head `weight` [V, H]: float32 [N].

    `hidden` [N, H] and `weight` get gradients (when they require them); `targets` [N] are
    token ids. `chunk`: positions per chunk, None for all at once (the reference path)."""
    import torch.nn.functional as F

    if chunk is None:
        logits = F.linear(hidden, weight).float()  # [N, V]
        return -F.cross_entropy(logits, targets, reduction="none")
    return _chunked_logp().apply(hidden, weight, targets, chunk)


@cache
def _chunked_logp() -> type:
    """The autograd Function, built on first use (torch is imported then)."""
    import torch

    class ChunkedLogp(torch.autograd.Function):
        """Forward and backward a chunk of positions at a time (module docstring)."""

        @staticmethod
        def forward(ctx, hidden, weight, targets, chunk):
            n = hidden.shape[0]
            out = torch.empty(n, dtype=torch.float32, device=hidden.device)
            lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
            for a in range(0, n, chunk):
                b = min(a + chunk, n)
                logits = (hidden[a:b] @ weight.t()).float()  # [C, V]
                lse[a:b] = torch.logsumexp(logits, dim=-1)
                out[a:b] = logits.gather(1, targets[a:b, None])[:, 0] - lse[a:b]
                del logits
            ctx.save_for_backward(hidden, weight, targets, lse)
            ctx.chunk = chunk
            return out

        @staticmethod
        def backward(ctx, grad_out):
            hidden, weight, targets, lse = ctx.saved_tensors
            want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
            grad_h = torch.empty_like(hidden) if want_h else None
            grad_w = (torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
                      if want_w else None)
            g = grad_out.float()
            for a in range(0, hidden.shape[0], ctx.chunk):
                b = min(a + ctx.chunk, hidden.shape[0])
                # d logp_t / d logits = onehot(t) - softmax, times the incoming gradient
                d = (hidden[a:b] @ weight.t()).float()  # [C, V]
                d.sub_(lse[a:b, None]).exp_().mul_(-g[a:b, None])
                d.scatter_add_(1, targets[a:b, None], g[a:b, None])
                d = d.to(hidden.dtype)
                if want_h:
                    grad_h[a:b] = d @ weight
                if want_w and weight.dtype == torch.float32:
                    grad_w.addmm_(d.t(), hidden[a:b])
                elif want_w:
                    grad_w.add_(_mm_fp32(d.t(), hidden[a:b]))
                del d
            return (grad_h, grad_w.to(weight.dtype) if want_w else None, None, None)

    return ChunkedLogp


def _mm_fp32(a: Any, b: Any) -> Any:
    """a @ b of 16-bit matrices, accumulated and returned in float32: cuBLAS's own fp32 output
    on CUDA; on CPU, which has no such kernel, the inputs are widened first."""
    import torch

    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


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
