"""The protocol accepts what the released checkpoints emit, and writes tool responses as the
Qwen3-VL chat template writes role `tool` messages."""

from __future__ import annotations

import pytest

from marscli.agent.protocol import (
    Answer,
    FormatError,
    ToolCall,
    format_tool_response,
    parse_turn,
    tool_content,
)
from marscli.errors import RuntimeFailure
from marscli.qwen.chat_template import render

ZOOM_ARGS = {"bbox_2d": [120, 340, 560, 780], "label": "sign", "img_idx": 0}
VISION = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.mark.parametrize("text,expected", [
    # Qwen3-VL's layout: newlines inside the tags, blank line after the thinking
    ('<think>\nThe sign is small.\n</think>\n\n<tool_call>\n{"name": "image_zoom_in_tool", '
     '"arguments": {"bbox_2d": [120, 340, 560, 780], "label": "sign", "img_idx": 0}}\n'
     "</tool_call>", ToolCall("image_zoom_in_tool", ZOOM_ARGS, "The sign is small.")),
    # Hermes without newlines, thinking spelled out, whitespace everywhere, trailing <|im_end|>
    ('  <thinking> look </thinking>  \n <tool_call>  {"name": "text_search_tool", "arguments": '
     '{"query": "tower"}}  </tool_call>\n<|im_end|>',
     ToolCall("text_search_tool", {"query": "tower"}, "look")),
    # arguments as a JSON string (OpenAI style)
    ('<think>x</think><tool_call>\n{"name": "text_search_tool", "arguments": '
     '"{\\"query\\": \\"tower\\"}"}\n</tool_call>', ToolCall("text_search_tool", {"query": "tower"},
                                                            "x")),
    # no arguments: absent or null
    ('<tool_call>\n{"name": "image_search_tool"}\n</tool_call>',
     ToolCall("image_search_tool", {}, None)),
    ('<tool_call>\n{"name": "image_search_tool", "arguments": null}\n</tool_call>',
     ToolCall("image_search_tool", {}, None)),
    # a sentence between thinking and call; mixed spellings of the thinking tags
    ('<think>zoom</thinking>\nLet me zoom in.\n<tool_call>\n{"name": "image_zoom_in_tool", '
     '"arguments": {"bbox_2d": [120, 340, 560, 780], "label": "sign", "img_idx": 0}}\n'
     "</tool_call>", ToolCall("image_zoom_in_tool", ZOOM_ARGS, "zoom")),
    ("<think>\nIt reads 1997.\n</think>\n\n<answer>1997</answer><|im_end|>",
     Answer("1997", "It reads 1997.")),
    ("<thinking>\nsure\n</think>\n<answer> B </answer>", Answer("B", "sure")),
])
def test_release_replies_parse(text, expected):
    assert parse_turn(text) == expected


@pytest.mark.parametrize("text,message", [
    ('<tool_call>\n{"name": "t", "arguments": "not json"}\n</tool_call>',
     "must be a JSON object (got a string that is not JSON)"),
    ('<tool_call>\n{"name": "t", "arguments": "[1, 2]"}\n</tool_call>', "must be a JSON object"),
    ('<think>\nx\n</think>\n<tool_call>\n{"name": "t", "arguments": {"q": 1}}\n</tool',
     "<tool_call> is never closed"),                        # a reply cut mid-tag
    ("<think>\nstill thinking when the budget ran out", "<think> is never closed"),
    ('<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "b", '
     '"arguments": {}}\n</tool_call>', "one tool call per turn"),  # Qwen3 may emit two
    ("<tool_call>\n{'name': 'a'}\n</tool_call>", "not valid JSON"),
])
def test_release_replies_refused(text, message):
    action = parse_turn(text)
    assert isinstance(action, FormatError) and message in action.message


@pytest.mark.parametrize("text,n,content", [
    ("Here is the zoomed image:", 1,                  # the release's zoom tool
     [{"type": "text", "text": "Here is the zoomed image:"}, {"type": "image"}]),
    ("Reverse Image Search Results:\n\nTitle 1: Tower\nThumbnail 1: <image>\n\nTitle 2: Bridge"
     "\nThumbnail 2: <image>", 2,                     # interleaved, as its image search returns
     [{"type": "text", "text": "Reverse Image Search Results:\n\nTitle 1: Tower\nThumbnail 1: "},
      {"type": "image"}, {"type": "text", "text": "\n\nTitle 2: Bridge\nThumbnail 2: "},
      {"type": "image"}]),
    ("<image> starts with an image", 1, [{"type": "image"},
                                         {"type": "text", "text": " starts with an image"}]),
    ("  \n starts with whitespace", 0, [{"type": "text", "text": "  \n starts with whitespace"}]),
    ("", 2, [{"type": "image"}, {"type": "image"}]),
])
def test_tool_response_is_what_the_template_writes(text, n, content):
    assert tool_content(text, n) == content
    rendered = render([{"role": "tool", "content": content}])
    assert format_tool_response(text, n) == rendered
    assert rendered.startswith("<|im_start|>user\n<tool_response>\n")
    assert rendered.endswith("\n</tool_response><|im_end|>\n")


def test_tool_response_matches_qwen3_vl_instruct_rendering():
    """Against the published template's own rendering (tests/qwen/test_chat_template.py)."""
    from qwen_renderings import EXPECTED

    piece = format_tool_response("<image> image first", 1)
    inner = piece.removeprefix("<|im_start|>user").removesuffix("<|im_end|>\n")
    assert inner == f"\n<tool_response>\n{VISION} image first\n</tool_response>"
    assert inner in EXPECTED["consecutive_tools_merge"]
    zoom = format_tool_response("Zoomed in on image 0:", 1)
    assert zoom in EXPECTED["trajectory_raw_text"]


def test_more_markers_than_images_is_a_failure():
    with pytest.raises(RuntimeFailure, match="2 <image> markers for 1 images"):
        tool_content("<image><image>", 1)
