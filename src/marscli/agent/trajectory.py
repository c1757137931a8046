"""A trajectory being generated (`Traj`): its prompt and sample, the segments and images so
far, the compact context that is the next prompt, what the rendering mode keeps, and the
counters its record reports. The loop (`loop.Agent`) advances it; the renderer of its mode
(`renderers`) reads it and extends what that mode keeps, and nothing else does.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from marscli.qwen.chat_template import TemplateTurns
from marscli.qwen.tokens import ImageFeatures
from marscli.records.schema import Prompt, Segment
from marscli.tools import ConvImage


@dataclass
class Traj:
    """A trajectory being generated."""

    prompt: Prompt
    sample: int
    images: list[ConvImage]
    feats: list[ImageFeatures]
    segments: list[Segment]
    refs: list[dict]
    context: list[int]  # compact ids so far: the next prompt ([] without a tokenizer)
    files: list[Path] = field(default_factory=list)  # each image's file, as in `images`
    # Kept by the renderer of its mode (renderers.py), and by nothing else:
    messages: list[dict] | None = None  # message-level engines: the conversation so far
    rendered: TemplateTurns | None = None  # --tools-config: the chat template's rendering
    error: str | None = None  # stop == "engine_error" or "prompt_too_long": why
    response_tokens: int = 0
    turns: int = 0
    stop: str | None = None
    final_answer: str | None = None
    tool_calls: Counter = field(default_factory=Counter)
    tool_errors: Counter = field(default_factory=Counter)  # the model's invalid calls
    tool_failures: Counter = field(default_factory=Counter)  # backends that failed
    tool_health: dict[str, Counter] = field(default_factory=dict)  # per tool: HEALTH_KEYS
    format_errors: int = 0
    gen_tokens: int = 0
    ms: Counter = field(default_factory=Counter)

    @property
    def id(self) -> str:
        return f"{self.prompt.id}#{self.sample}"
