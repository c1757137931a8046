"""One parser for every assistant turn: typed actions and typed format errors."""

from __future__ import annotations

import pytest

from marscli.agent.protocol import (
    Answer,
    FormatError,
    ToolCall,
    last_answer,
    parse_turn,
    system_prompt,
    tools_block,
)

CALL = ('<tool_call>{"name": "image_zoom_in_tool", '
        '"arguments": {"bbox_2d": [1, 2, 3, 4]}}</tool_call>')


@pytest.mark.parametrize("text,kind,detail", [
    (f"<thinking>look</thinking>{CALL}", ToolCall, "image_zoom_in_tool"),
    (f"<think>look</think>\n{CALL}", ToolCall, "image_zoom_in_tool"),
    (CALL, ToolCall, "image_zoom_in_tool"),  # thinking is optional for parsing
    ("<thinking>ok</thinking><answer> 1997 </answer>", Answer, "1997"),
    ("<thinking>ok</thinking><answer></answer>", Answer, ""),
    ('<tool_call>{"name": "t", "arguments": "{\\"q\\": 1}"}</tool_call>', ToolCall, "t"),
    ("<thinking>x</thinking><tool_call>{bad json}</tool_call>", FormatError, "not valid JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', FormatError, '"name"'),
    ('<tool_call>{"name": "t", "arguments": [1]}</tool_call>', FormatError, "JSON object"),
    (f"{CALL}<answer>a</answer>", FormatError, "not both"),
    (f"{CALL}{CALL}", FormatError, "one tool call"),
    ("<answer>a</answer><answer>b</answer>", FormatError, "one answer"),
    ("<thinking>never closed", FormatError, "never closed"),
    ("<thinking>x</thinking><answer>never closed", FormatError, "<answer> is never closed"),
    ("just text", FormatError, "no <tool_call> or <answer>"),
])
def test_parse_turn(text, kind, detail):
    action = parse_turn(text)
    assert isinstance(action, kind)
    if kind is ToolCall:
        assert action.name == detail and isinstance(action.arguments, dict)
    elif kind is Answer:
        assert action.text == detail
    else:
        assert detail in action.message


def test_thinking_is_captured():
    assert parse_turn(f"<thinking> a b </thinking>{CALL}").thinking == "a b"
    assert parse_turn("<think>c</think><answer>d</answer>").thinking == "c"


def test_last_answer():
    assert last_answer("<answer>a</answer> x <answer> b </answer>") == "b"
    assert last_answer("none") is None


def test_system_prompt_lists_tool_schemas():
    from marscli.tools.zoom import SCHEMA

    block = tools_block([SCHEMA])
    assert block.startswith("# Tools") and '"name":"image_zoom_in_tool"' in block
    assert system_prompt([SCHEMA], "BASE").startswith("BASE\n\n# Tools")
    assert "# Tools" not in system_prompt([], "BASE")
