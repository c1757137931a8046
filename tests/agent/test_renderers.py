"""The agent's rendering modes (agent/renderers.py): which renderer a run gets, and the release
data's opening rules, on stand-ins (no model). Token exactness of each mode is checked end to end
in test_agent.py, test_template_render.py and test_openai_engine.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from marscli.agent.protocol import SYSTEM_PROMPT
from marscli.agent.renderers import (
    MessageRenderer,
    OwnRenderer,
    TemplateRenderer,
    choose_renderer,
    release_opening,
)
from marscli.errors import BadInput
from marscli.records.schema import Prompt
from marscli.tools import build_tools

SPECIAL = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|image_pad|>", "<|video_pad|>",
           "<|vision_start|>", "<|vision_end|>"]


class Tokenizer:
    pad_token_id = None

    def convert_tokens_to_ids(self, token: str) -> int:
        return SPECIAL.index(token)


class Processor:
    tokenizer = Tokenizer()


class Engine:
    def __init__(self, processor: object | None, message_level: bool = False) -> None:
        self.processor, self.message_level = processor, message_level


def test_a_token_level_engine_gets_marscli_s_own_layout():
    renderer, tools = choose_renderer(Engine(Processor()), build_tools(), None, None)
    assert isinstance(renderer, OwnRenderer)
    assert renderer.system.startswith(SYSTEM_PROMPT) and "# Tools" in renderer.system
    assert list(tools) == [t.name for t in build_tools()]


def test_a_message_level_engine_gets_messages_with_or_without_a_tokenizer():
    bare, _ = choose_renderer(Engine(None, message_level=True), [], "Be brief.", None)
    assert isinstance(bare, MessageRenderer) and bare.tok is None and bare.system == "Be brief."
    tokenised, _ = choose_renderer(Engine(Processor(), message_level=True), [], None, None)
    assert isinstance(tokenised, MessageRenderer) and tokenised.ids.im_end == 1


def test_tools_config_gets_the_chat_template_and_needs_a_token_level_engine():
    renderer, tools = choose_renderer(Engine(Processor()), [], "Be brief.", [])
    assert isinstance(renderer, TemplateRenderer) and renderer.schemas is None and tools == {}
    assert renderer.system == "Be brief."  # the opening's, when the row brings none
    with pytest.raises(BadInput, match="needs a token-level engine"):
        choose_renderer(Engine(None, message_level=True), [], None, [])
    with pytest.raises(ValueError, match="needs a processor"):
        choose_renderer(Engine(None), [], None, None)


def _prompt(**extra) -> Prompt:
    return Prompt(id="q", question="What <image> is it?", images=["a.png", "b.png"],
                  answer=["x"], base=Path("."), extra=extra)


def test_release_opening_follows_the_dataset_s_rules():
    args = {"arguments": {"system_prompt": "SYS", "format_instruction": "Answer briefly."}}
    msgs = release_opening(_prompt(input_template=args), 2, "ours")
    assert msgs == [
        {"role": "system", "content": "SYS"},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What "},
                                     {"type": "image"},
                                     {"type": "text", "text": " is it?\nAnswer briefly."}]}]
    row = [{"role": "user", "content": "Just this."}]
    assert release_opening(_prompt(prompt=row), 0, "ours") == [
        {"role": "system", "content": "ours"},
        {"role": "user", "content": [{"type": "text", "text": "Just this."}]}]
    both = [{"role": "system", "content": "theirs"}, {"role": "user", "content": "q"}]
    with pytest.raises(BadInput, match="keep one"):
        release_opening(_prompt(prompt=both, input_template=args), 0, "ours")
