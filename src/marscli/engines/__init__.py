"""Generation engines, registered by name: `hf` (transformers, in-process), later `vllm` and
`openai`. One signature: `generate(requests, params) -> list[Generation]`, token ids in and out,
with the engine's own per-token log-probs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from marscli.registry import Registry


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    max_new_tokens: int = 1024
    seed: int = 0


@dataclass
class GenRequest:
    tokens: list[int]  # compact prompt ids (negative -n: n image placeholders)
    images: list[Any] = field(default_factory=list)  # tokens.ImageFeatures, in order
    max_new_tokens: int | None = None  # per request cap (the trajectory's remaining budget)
    row: dict | None = None  # the prompt row (the replay engine reads its scripted replies)
    turn: int = 0  # 0-based assistant turn this request generates


@dataclass
class Generation:
    tokens: list[int]  # generated ids, ending in <|im_end|> when the model stopped
    logprobs: list[float]  # log p(token) under the raw model distribution (temperature 1)
    finish: str  # "stop" | "length"


class Engine(Protocol):
    processor: Any

    def generate(self, requests: list[GenRequest], params: SamplingParams) -> list[Generation]: ...


ENGINES: Registry[type] = Registry("engine", lazy={
    "hf": "marscli.engines.hf",
    "replay": "marscli.engines.replay",
})


def make_engine(name: str, policy: str, **opts: Any) -> Engine:
    return ENGINES.get(name)(policy, **opts)
