"""A scripted engine for tests: replays fixed replies, tokenised canonically, so that the
re-tokenisation check can be exact for model segments too (a random model's samples need not
be the canonical encoding of their own text)."""

from __future__ import annotations

from marscli.engines import Generation, GenRequest, SamplingParams
from marscli.qwen.tokens import expand, special_ids


class ScriptedEngine:
    def __init__(self, processor, replies: list[str]) -> None:
        self.processor = processor
        self.replies = replies
        self.ids = special_ids(processor.tokenizer)
        self.header = processor.tokenizer.encode("<|im_start|>assistant\n",
                                                 add_special_tokens=False)
        self.requests: list[GenRequest] = []

    def _turn(self, tokens: list[int]) -> int:
        ids, h = expand(tokens, self.ids.image_pad), self.header
        return sum(ids[i:i + len(h)] == h for i in range(len(ids) - len(h) + 1)) - 1

    def generate(self, requests: list[GenRequest], params: SamplingParams) -> list[Generation]:
        self.requests += requests
        out = []
        for r in requests:
            text = self.replies[min(self._turn(r.tokens), len(self.replies) - 1)]
            toks = self.processor.tokenizer.encode(text, add_special_tokens=False)
            toks.append(self.ids.im_end)
            out.append(Generation(toks, None, "stop"))  # scripted: no log-probs
        return out
