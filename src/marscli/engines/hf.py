"""The `hf` engine: batched sampling with transformers' `generate`, in-process.

Prompts arrive as token ids (compact image placeholders expanded here) with their images'
pixel features; the batch is left-padded, vision placeholder ids are suppressed from sampling
(a sampled placeholder breaks the next forward), generation stops at `<|im_end|>`, and each
sampled token comes back with its log-prob under the raw model distribution — the quantity the
trainer recomputes (`logprobs_mode = "raw"`): the log-softmax of `generate`'s
`output_logits`, which are the logits before temperature, top-k/top-p and the suppression of
vision placeholders. They are the sampling distribution's only at temperature 1 without
top-k/top-p (placeholders aside, which the model gives ~0 mass once trained).

Sampling is per row and batch-invariant: each request's token at step t is drawn with one
uniform hashed from its seed (`--seed`, trajectory id, turn: `engines.request_seed`) and t
(`engines.sampling`), so a trajectory samples the same tokens whatever shares its batch (a
resumed run, a shard, an uninterrupted run). `generate` has one global RNG per batch, so the
sampling happens in a last logits processor (`sampling.RowSampler`) whose one-hot mask greedy
decoding (`do_sample=False`) picks; the checkpoint's own generation_config sampling settings
(a release's top_k=20, say) are therefore never applied behind marscli's back. Different batch
padding changes the logits in their last bits (raw log-probs by ≤ 1e-6), and so could, rarely,
flip a draw (tests/engines/test_sampling.py checks rows alone against a batch of 32).

Streaming (`streams = True`): `generate(..., on_tokens=f)` calls `f(i, ids)` with each new
token of request i as it is generated — the ids its Generation will hold, in order, nothing
past its stop token or its cap.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from marscli.engines import (
    ENGINES,
    Generation,
    GenRequest,
    SamplingParams,
    check_policy,
    request_seeds,
    resolve_device,
)
from marscli.engines.sampling import RowSampler
from marscli.qwen.policy import check_checkpoint, load_model, load_processor
from marscli.qwen.tokens import expand, never_sampled, special_ids


@ENGINES.register("hf")
class HFEngine:
    options: tuple[str, ...] = ()  # no options of its own
    logprobs_mode = "raw"
    streams = True  # generate(..., on_tokens=) hands out tokens as they are sampled
    check_options = staticmethod(check_policy)

    def __init__(self, policy: str, device: str = "auto", dtype: str | None = None,
                 max_batch: int = 32, **_: Any) -> None:
        path = check_checkpoint(policy)
        self.policy = path
        self.processor = load_processor(path)
        self.device = resolve_device(device)
        self.model = load_model(path, device=self.device, dtype=dtype)
        self.ids = special_ids(self.processor.tokenizer)
        self.banned = never_sampled(self.ids, len(self.processor.tokenizer),
                                    self.model.config.get_text_config().vocab_size)
        self.max_batch = max_batch
        # the longest sequence the model takes: a prompt past it is refused (agent), never
        # sampled from silently
        self.max_context = getattr(self.model.config.get_text_config(),
                                   "max_position_embeddings", None)
        self._calls = 0

    def config(self) -> dict:
        """The engine's settings, for the stage's sidecar (`auto` resolved)."""
        return {"device": self.device, "dtype": str(self.model.dtype).removeprefix("torch."),
                "max_batch": self.max_batch}

    def generate(self, requests: list[GenRequest], params: SamplingParams,
                 on_tokens: Callable[[int, list[int]], None] | None = None) -> list[Generation]:
        out: list[Generation] = []
        for i in range(0, len(requests), self.max_batch):
            stream = None if on_tokens is None else _offset(on_tokens, i)
            out += self._generate_batch(requests[i:i + self.max_batch], params, stream)
        return out

    def _seeds(self, requests: list[GenRequest], params: SamplingParams) -> list[int]:
        """Per-request seeds; requests without a key (direct callers) by call and position."""
        call = self._calls
        self._calls += 1
        return request_seeds(requests, params.seed, call)

    def _batch_inputs(self, requests: list[GenRequest]) -> dict[str, Any]:
        import torch

        seqs = [expand(r.tokens, self.ids.image_pad) for r in requests]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.ids.pad, dtype=torch.long)
        attn = torch.zeros((len(seqs), width), dtype=torch.long)
        for b, s in enumerate(seqs):  # left padding: every row ends where generation starts
            ids[b, width - len(s):] = torch.tensor(s)
            attn[b, width - len(s):] = 1
        inputs: dict[str, Any] = {"input_ids": ids, "attention_mask": attn,
                                  "mm_token_type_ids": (ids == self.ids.image_pad).int()}
        feats = [f for r in requests for f in r.images]
        if feats:
            inputs["pixel_values"] = torch.cat([f.pixel_values for f in feats])
            inputs["image_grid_thw"] = torch.stack([f.grid_thw for f in feats])
        return {k: v.to(self.device) for k, v in inputs.items()}

    def _generate_batch(self, requests: list[GenRequest], params: SamplingParams,
                        on_tokens: Callable[[int, list[int]], None] | None = None
                        ) -> list[Generation]:
        import torch
        from transformers import LogitsProcessorList

        from marscli.engines.kv_cache import preallocated_cache

        inputs = self._batch_inputs(requests)
        width = inputs["input_ids"].shape[1]
        caps = [r.max_new_tokens or params.max_new_tokens for r in requests]
        max_new = max(caps)
        seeds = self._seeds(requests, params)
        procs: list[Any] = [FiniteLogits(self.policy)]  # first: before any draw
        if params.temperature > 0:
            procs.append(RowSampler(seeds, params, width))
        streamer = None if on_tokens is None else RowStreamer(on_tokens, caps, self.ids.im_end)
        # the call's longest sequence, allocated once (engines/kv_cache.py)
        cache = preallocated_cache(self.model.config.get_text_config().num_hidden_layers,
                                   width + max_new)
        with torch.no_grad():
            res = self.model.generate(
                **inputs, max_new_tokens=max_new, do_sample=False, temperature=None,
                top_p=None, top_k=None, logits_processor=LogitsProcessorList(procs),
                suppress_tokens=self.banned, eos_token_id=self.ids.im_end,
                pad_token_id=self.ids.pad, output_logits=True, return_dict_in_generate=True,
                streamer=streamer, past_key_values=cache)
        new = res.sequences[:, width:]  # [B, T_new]
        # a step at a time: stacking the raw logits first would copy [B, T_new, V] twice more
        logp = torch.cat([torch.log_softmax(step.float(), dim=-1).gather(1, new[:, t, None])
                          for t, step in enumerate(res.logits)], dim=1)  # [B, T_new]
        gens = []
        for b, cap in enumerate(caps):
            toks, lps = new[b].tolist(), logp[b].tolist()
            end = toks.index(self.ids.im_end) + 1 if self.ids.im_end in toks[:cap] else cap
            end = min(end, len(toks))
            stopped = end > 0 and toks[end - 1] == self.ids.im_end
            gens.append(Generation(toks[:end], [float(x) for x in lps[:end]],
                                   "stop" if stopped else "length"))
        return gens


def _offset(f: Callable[[int, list[int]], None], start: int) -> Callable[[int, list[int]], None]:
    """`f` for a slice of the requests that starts at `start`."""
    return lambda i, ids: f(start + i, ids)


class FiniteLogits:
    """A logits processor that refuses logits of nan or +inf (a diverged checkpoint) in one
    line (RuntimeFailure, exit 1) naming the checkpoint, before the sampler or
    greedy's argmax meets them. -inf is allowed: the suppressed placeholders hold it."""

    def __init__(self, policy: str) -> None:
        self.policy = policy

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        top = scores.amax(-1)  # nan where a row holds one, else +inf where a row holds one
        if bool((top.isnan() | top.isposinf()).any()):
            from marscli.errors import RuntimeFailure

            raise RuntimeFailure(f"--policy: {self.policy}: the model's logits are not finite "
                                 "(nan or inf) — its weights diverged (an update at too high "
                                 "--lr?); sample from an earlier checkpoint")
        return scores


class RowStreamer:
    """A transformers streamer (`put`, `end`) for a batch: `generate` puts the prompt [B, T]
    first, then each step's tokens [B]; each row's tokens go to `on_tokens(row, [id])` up to
    its stop token or its cap, and nothing after (finished rows keep receiving pad)."""

    def __init__(self, on_tokens: Callable[[int, list[int]], None], caps: list[int],
                 stop: int) -> None:
        self.on_tokens, self.caps, self.stop = on_tokens, caps, stop
        self.sent = [0] * len(caps)
        self.done = [False] * len(caps)
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if not self._prompt_seen:  # the prompt ids [B, T]: not generated
            self._prompt_seen = True
            return
        for b, tok in enumerate(value.reshape(-1).tolist()):
            if self.done[b]:
                continue
            self.sent[b] += 1
            self.done[b] = tok == self.stop or self.sent[b] >= self.caps[b]
            self.on_tokens(b, [tok])

    def end(self) -> None:
        pass
