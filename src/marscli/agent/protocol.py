"""The agent protocol: system prompt, `# Tools` block, and the one parser of assistant turns.

An assistant turn is `<thinking>...</thinking>` (or `<think>`), then exactly one of
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` or `<answer>...</answer>`.
`parse_turn` returns a typed action or a typed format error; the agent loop and the format
reward use this same function, so they cannot disagree about what a valid turn is.

What `parse_turn` accepts, so that the released checkpoints' replies parse as they are:
- Hermes tool calls `<tool_call>{json}</tool_call>`, also in Qwen3-VL's layout with newlines
  (`<tool_call>\n{...}\n</tool_call>`) and any whitespace around the JSON, the tags or the turn.
- `<think>...</think>` or `<thinking>...</thinking>`, a close of either spelling accepted for
  either open (`<think>...</thinking>`); the thinking is optional for parsing. Text between the
  thinking and the call or answer (a sentence, blank lines) is allowed.
- `{"name": str, "arguments": ...}` where arguments is an object; a JSON string that decodes to
  an object (OpenAI style, or a model that encodes twice); or null / absent, meaning no
  arguments (`image_search_tool` takes none). A string that is not a JSON object, or any other
  value, is a format error. (The release's verl parser gives string arguments `{}` and counts a
  decode error; marscli takes what the model meant.)
- A trailing `<|im_end|>` (text decoded without skipping special tokens) changes nothing.
Refused, as format errors: a call and an answer in one turn, two calls or two answers (one tool
call per turn, as docs/design.md "The agent protocol" states; Qwen3-VL may emit several), a
tag opened and never closed (a reply cut mid-tag), invalid JSON, a call without a string
`name`.

`tool_content(text, n_images)` and `format_tool_response(text, n_images)` write a tool response
as the Qwen3-VL chat template writes a role `tool` message: `<|im_start|>user\n<tool_response>\n`
+ the text with its images inline + `\n</tool_response><|im_end|>\n`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from marscli.errors import BadInput, RuntimeFailure
from marscli.qwen.tokens import IMAGE_MARK, marked_parts

SYSTEM_PROMPT = """You are a careful visual research agent. You answer questions about images by \
thinking step by step and using tools when the image alone is not enough.

Each turn, first reason inside <thinking>...</thinking>. Then do exactly one of:
- call one tool: <tool_call>{"name": "TOOL_NAME", "arguments": {...}}</tool_call>
- give the final answer: <answer>short answer</answer>

Tool results come back inside <tool_response>...</tool_response>. Images are numbered from 0 in \
the order they appear in the conversation: the input image is 0, and each crop or search \
thumbnail gets the next number. Zoom in on small details rather than guessing, search for facts \
you do not know, and keep the final answer short: a name, a number, a word or an option letter."""


def tools_block(schemas: list[dict]) -> str:
    lines = ["# Tools", "", "You may call one of the following functions per turn.",
             "Function signatures, one per line:", "<tools>"]
    lines += [orjson.dumps(s).decode() for s in schemas]
    lines += ["</tools>"]
    return "\n".join(lines)


def system_prompt(schemas: list[dict], base: str | None = None) -> str:
    """The system message: the base prompt (ours or `--system-prompt FILE`) + the tools block."""
    return (f"{base or SYSTEM_PROMPT}\n\n{tools_block(schemas)}" if schemas
            else (base or SYSTEM_PROMPT))


def read_system_prompt(path: str | None) -> str | None:
    if path is None:
        return None
    p = Path(path)
    if not p.is_file():
        raise BadInput(f"--system-prompt: {path}: no such file")
    try:
        return p.read_text(encoding="utf-8").strip()
    except UnicodeDecodeError:
        raise BadInput(f"--system-prompt: {path}: not UTF-8 text") from None


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    thinking: str | None


@dataclass
class Answer:
    text: str
    thinking: str | None


@dataclass
class FormatError:
    message: str
    thinking: str | None = None


Action = ToolCall | Answer | FormatError

_THINK = re.compile(r"<think(?:ing)?>(.*?)</think(?:ing)?>", re.S)
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
_OPEN_TAGS = ("<thinking>", "<think>", "<tool_call>", "<answer>")


def parse_turn(text: str) -> Action:
    """Parse one assistant turn (without its `<|im_end|>`)."""
    m = _THINK.search(text)
    thinking = m.group(1).strip() if m else None
    body = text[m.end():] if m else text
    calls, answers = _CALL.findall(body), _ANSWER.findall(body)
    if calls and answers:
        return FormatError("a turn must hold either a tool call or an answer, not both", thinking)
    if len(calls) > 1:
        return FormatError("one tool call per turn", thinking)
    if len(answers) > 1:
        return FormatError("one answer per turn", thinking)
    if answers:
        return Answer(answers[0].strip(), thinking)
    if calls:
        return _parse_call(calls[0], thinking)
    for tag in _OPEN_TAGS:
        if tag in text and tag.replace("<", "</") not in text:
            return FormatError(f"{tag} is never closed", thinking)
    return FormatError("no <tool_call> or <answer> in the reply", thinking)


def _parse_call(raw: str, thinking: str | None) -> Action:
    try:
        obj = orjson.loads(raw.strip())
    except orjson.JSONDecodeError as e:
        return FormatError(f"tool call is not valid JSON ({e})", thinking)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return FormatError('tool call needs {"name": str, "arguments": {...}}', thinking)
    args = obj.get("arguments")
    if args is None:  # absent or null: a tool without arguments
        args = {}
    elif isinstance(args, str):  # OpenAI style, or a model that JSON-encodes them twice
        try:
            args = orjson.loads(args)
        except orjson.JSONDecodeError:
            return FormatError("tool call arguments must be a JSON object (got a string that "
                               "is not JSON)", thinking)
    if not isinstance(args, dict):
        return FormatError("tool call arguments must be a JSON object", thinking)
    return ToolCall(obj["name"], args, thinking)


def last_answer(text: str) -> str | None:
    """The content of the last `<answer>...</answer>` in a response, stripped."""
    found = _ANSWER.findall(text)
    return found[-1].strip() if found else None


_VISION = "<|vision_start|><|image_pad|><|vision_end|>"


def tool_content(text: str, n_images: int = 0) -> list[dict]:
    """Content parts of a role `tool` message: `<image>` markers in `text` place the images;
    images without a marker follow the text directly, as the release's tools return them (the
    zoom tool's "Here is the zoomed image:" then the crop)."""
    parts = marked_parts(text, n_images)
    if parts is None:
        raise RuntimeFailure(f"tool response: {text.count(IMAGE_MARK)} {IMAGE_MARK} markers for "
                             f"{n_images} images — a tool returned more markers than images")
    return parts


def format_tool_response(text: str, n_images: int = 0) -> str:
    """The rendering of one role `tool` message by Qwen3-VL's chat template (images as their
    unexpanded `<|vision_start|><|image_pad|><|vision_end|>`)."""
    body = "".join(_VISION if p["type"] == "image" else p["text"]
                   for p in tool_content(text, n_images))
    return f"<|im_start|>user\n<tool_response>\n{body}\n</tool_response><|im_end|>\n"
