"""The `hf` engine: batched sampling with transformers' `generate`, in-process.

Prompts arrive as token ids (compact image placeholders expanded here) with their images'
pixel features; the batch is left-padded, vision placeholder ids are suppressed from sampling
(a sampled placeholder breaks the next forward), generation stops at `<|im_end|>`, and each
sampled token comes back with its log-prob under the raw model distribution — the quantity the
trainer recomputes (`logprobs_mode = "raw"`): the log-softmax of `generate`'s
`output_logits`, which are the logits before temperature, top-k/top-p and the suppression of
vision placeholders. They are the sampling distribution's only at temperature 1 without
top-k/top-p (placeholders aside, which the model gives ~0 mass once trained).
"""

from __future__ import annotations

from typing import Any

from marscli.engines import (
    ENGINES,
    Generation,
    GenRequest,
    SamplingParams,
    check_policy,
    resolve_device,
)
from marscli.policy import check_checkpoint, load_model, load_processor
from marscli.tokens import expand, special_ids


@ENGINES.register("hf")
class HFEngine:
    options: tuple[str, ...] = ()  # no options of its own
    logprobs_mode = "raw"
    check_options = staticmethod(check_policy)

    def __init__(self, policy: str, device: str = "auto", dtype: str | None = None,
                 max_batch: int = 32, **_: Any) -> None:
        path = check_checkpoint(policy)
        self.processor = load_processor(path)
        self.device = resolve_device(device)
        self.model = load_model(path, device=self.device, dtype=dtype)
        self.ids = special_ids(self.processor.tokenizer)
        self.max_batch = max_batch
        self._calls = 0

    def config(self) -> dict:
        """The engine's settings, for the stage's sidecar (`auto` resolved)."""
        return {"device": self.device, "dtype": str(self.model.dtype).removeprefix("torch."),
                "max_batch": self.max_batch}

    def generate(self, requests: list[GenRequest], params: SamplingParams) -> list[Generation]:
        out: list[Generation] = []
        for i in range(0, len(requests), self.max_batch):
            out += self._generate_batch(requests[i:i + self.max_batch], params)
        return out

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

    def _generate_batch(
        self, requests: list[GenRequest], params: SamplingParams
    ) -> list[Generation]:
        import torch

        inputs = self._batch_inputs(requests)
        max_new = max(r.max_new_tokens or params.max_new_tokens for r in requests)
        # A seed per call keeps the whole run reproducible whatever ran before it.
        torch.manual_seed(params.seed * 1_000_003 + self._calls)
        self._calls += 1
        greedy = params.temperature <= 0
        with torch.no_grad():
            res = self.model.generate(
                **inputs, max_new_tokens=max_new, do_sample=not greedy,
                temperature=None if greedy else params.temperature,
                top_p=None if greedy else params.top_p, top_k=params.top_k or None,
                suppress_tokens=list(self.ids.vision), eos_token_id=self.ids.im_end,
                pad_token_id=self.ids.pad, output_logits=True, return_dict_in_generate=True)
        new = res.sequences[:, inputs["input_ids"].shape[1]:]  # [B, T_new]
        logits = torch.stack(res.logits, dim=1).float()  # [B, T_new, V], raw (unprocessed)
        logp = torch.log_softmax(logits, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        gens = []
        for b, r in enumerate(requests):
            cap = r.max_new_tokens or params.max_new_tokens
            toks, lps = new[b].tolist(), logp[b].tolist()
            end = toks.index(self.ids.im_end) + 1 if self.ids.im_end in toks[:cap] else cap
            end = min(end, len(toks))
            stopped = end > 0 and toks[end - 1] == self.ids.im_end
            gens.append(Generation(toks[:end], [float(x) for x in lps[:end]],
                                   "stop" if stopped else "length"))
        return gens
