"""marscli's own chat template that renders as Qwen3-VL-Instruct's does, and the turn-by-turn check.

A released SenseNova-MARS or Qwen3-VL checkpoint was trained on prompts rendered by Qwen3-VL's
template with `tools=`. `QWEN3_VL_TEMPLATE` is marscli's own Jinja template (written here, not a
copy of Qwen's) whose output is byte for byte that of the template published with
Qwen3-VL-8B-Instruct; tests/qwen/test_chat_template.py holds that template's renderings of the cases
below as expected strings. What it renders:
- A first `system` message: its text parts only (images in a system message are dropped) inside
  `<|im_start|>system\\n...<|im_end|>\\n`. Later system messages are not rendered at all.
- `tools=[...]`: the system turn becomes the system text (if any) + a blank line + Qwen3's
  `# Tools` block: each schema as `tojson` on its own line inside `<tools></tools>`, then the
  instruction to answer with `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`.
- `user` turns: text, images (`<|vision_start|><|image_pad|><|vision_end|>`; parts of type
  `image`/`image_url` or with such a key) and videos (`<|video_pad|>`) in order; with
  `add_vision_id=True` each is preceded by `Picture N: ` / `Video N: `, counted over the whole
  conversation (tool responses included).
- `assistant` turns: the text of `content` (a string or its text parts) verbatim, then each of
  `tool_calls` as `<tool_call>\\n{"name": "N", "arguments": A}\\n</tool_call>` (A written as given
  when a string, else `tojson`), separated by `\\n` (and from non-empty content), then
  `<|im_end|>\\n`. Content, tool calls and `<|im_end|>` sit inside `{% generation %}`, so
  `return_assistant_tokens_mask=True` marks exactly what the model wrote.
- `tool` messages: `<|im_start|>user` once for a run of consecutive tool messages, each one
  `\\n<tool_response>\\n...\\n</tool_response>` with its images inline; `<|im_end|>\\n` after
  the run.
- `add_generation_prompt`: `<|im_start|>assistant\\n` (no `<think>` injection: Instruct model).
Unlike Qwen's, an assistant message whose content is None renders as empty text (Qwen's fails).

`render(messages, tools, add_generation_prompt)` renders through transformers' own Jinja
environment (`render_jinja_template`, what `apply_chat_template(chat_template=...)` uses).
`check_extends(prev_ids, new_ids, turn)` is the agent's turn-by-turn check that a new rendering
extends the previous turn's tokens exactly (RuntimeFailure naming the turn and the first
differing token otherwise). `text_extension(prev_text, new_text, turn)` is the same check on
text, returning the new suffix: a model's sampled ids need not be the canonical tokenisation of
its text (`}` + `\\n` where the tokenizer writes `}\\n`), so the agent keeps the generated ids,
checks the re-rendered text and tokenises only the suffix, which starts at a special-token
boundary (`<|im_end|>` or the newline after it) and so tokenises as it would in place.

For the agent (`--tools-config`): `TemplateTurns` keeps one trajectory's messages and rendering
(through the processor's `apply_chat_template`) and gives the ids of the prompt segment and of
each tool segment, checked with `text_extension`; `template_parts` turns a rendering into
`tokens.encode_parts` pieces (each image its placeholder count; a rendering with another number
of images than the conversation fails); `content_parts` writes `<image>` markers as image parts
as verl's dataset does; `check_renders_tools` refuses a template that ignores `tools=`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from marscli.errors import RuntimeFailure
from marscli.qwen.tokens import IMAGE_MARK, marked_parts

_TOOLS_INTRO = (
    "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>"
)
_TOOLS_OUTRO = (
    "\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n'
)

# Jinja source; `\\n` below is Jinja's newline escape inside its string literals. Every tag
# trims whitespace, so only `{{ }}` output reaches the rendering. `{% generation %}` stays at
# the top level (not in a macro): its span is measured against the output streamed so far.
QWEN3_VL_TEMPLATE = (
    "{%- set seen = namespace(image=0, video=0) -%}"
    # system and assistant content: text parts only
    "{%- macro text_of(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- elif content is not none -%}"
    "{%- for part in content if 'text' in part -%}{{- part.text -}}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    # user and tool content: text, images and videos in order, numbered over the conversation
    "{%- macro media_of(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- elif content is not none -%}{%- for part in content -%}"
    "{%- if part.type == 'image' or 'image' in part or 'image_url' in part -%}"
    "{%- set seen.image = seen.image + 1 -%}"
    "{%- if add_vision_id -%}{{- 'Picture ' ~ seen.image ~ ': ' -}}{%- endif -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part.type == 'video' or 'video' in part -%}"
    "{%- set seen.video = seen.video + 1 -%}"
    "{%- if add_vision_id -%}{{- 'Video ' ~ seen.video ~ ': ' -}}{%- endif -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif 'text' in part -%}{{- part.text -}}"
    "{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set system = messages[0] if messages and messages[0].role == 'system' else none -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if system -%}{{- text_of(system.content) ~ '\\n\\n' -}}{%- endif -%}"
    "{{- '" + _TOOLS_INTRO + "' -}}"
    "{%- for tool in tools -%}{{- '\\n' ~ (tool | tojson) -}}{%- endfor -%}"
    "{{- '" + _TOOLS_OUTRO.replace("'", "\\'") + "' -}}"
    "{%- elif system -%}"
    "{{- '<|im_start|>system\\n' ~ text_of(system.content) ~ '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'user' -%}"
    "{{- '<|im_start|>user\\n' ~ media_of(message.content) ~ '<|im_end|>\\n' -}}"
    "{%- elif message.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- generation -%}"
    "{{- text_of(message.content) -}}"
    "{%- for call in message.tool_calls or [] -%}"
    "{%- if message.content or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{%- set fn = call.function if call.function else call -%}"
    "{%- set args = fn.arguments if fn.arguments is string else (fn.arguments | tojson) -%}"
    "{{- '<tool_call>\\n{\"name\": \"' ~ fn.name ~ '\", \"arguments\": ' ~ args"
    " ~ '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>' -}}"
    "{%- endgeneration -%}"
    "{{- '\\n' -}}"
    "{%- elif message.role == 'tool' -%}"
    "{%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' ~ media_of(message.content) ~ '\\n</tool_response>' -}}"
    "{%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def render(messages: list[dict], tools: list[dict] | None = None,
           add_generation_prompt: bool = False, template: str = QWEN3_VL_TEMPLATE,
           **kwargs: Any) -> str:
    """`messages` rendered by `template` in transformers' chat-template environment (the
    sandbox, `tojson` and `{% generation %}` that `apply_chat_template` uses)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template([messages], tools=tools, chat_template=template,
                                        add_generation_prompt=add_generation_prompt, **kwargs)
    return rendered[0]


def first_difference(prev_ids: Sequence, new_ids: Sequence) -> int | None:
    """Index of the first item (token or character) where `new_ids` stops extending
    `prev_ids`; None if it does."""
    for i, (a, b) in enumerate(zip(prev_ids, new_ids, strict=False)):
        if a != b:
            return i
    return None if len(new_ids) >= len(prev_ids) else len(new_ids)


def check_extends(prev_ids: Sequence[int], new_ids: Sequence[int], turn: int,
                  tokenizer: Any = None) -> None:
    """RuntimeFailure unless `new_ids` starts with `prev_ids` exactly: the token-exact segments
    of a trajectory are only right when each turn's rendering appends to the previous one.
    With `tokenizer`, the message shows the differing tokens' text."""
    prev, new = [int(t) for t in prev_ids], [int(t) for t in new_ids]
    i = first_difference(prev, new)
    if i is None:
        return
    if i >= len(new):
        detail = f"the new rendering has only {len(new)} of the previous {len(prev)} tokens"
    else:
        detail = f"{_show(prev[i], tokenizer)} became {_show(new[i], tokenizer)}"
    raise RuntimeFailure(
        f"turn {turn}: the chat template's rendering does not extend the previous turn's tokens "
        f"exactly (first difference at token {i}: {detail}) — the template rewrites earlier "
        "turns or a boundary re-tokenises; use a template whose turns only append")


def text_extension(prev_text: str, new_text: str, turn: int) -> str:
    """The part of `new_text` after `prev_text`; RuntimeFailure (as `check_extends`) unless
    `new_text` starts with `prev_text`."""
    if new_text.startswith(prev_text):
        return new_text[len(prev_text):]
    i = first_difference(prev_text, new_text)
    raise RuntimeFailure(
        f"turn {turn}: the chat template's rendering does not extend the previous turn's text "
        f"exactly (first difference at character {i}: {prev_text[i:i + 20]!r} became "
        f"{new_text[i:i + 20]!r}) — the template rewrites earlier turns; use a template whose "
        "turns only append")


def _show(token_id: int, tokenizer: Any) -> str:
    if tokenizer is None:
        return str(token_id)
    return f"{token_id} {tokenizer.decode([token_id])!r}"


# ------------------------------------------------------------------ the agent's turns, rendered

VISION = "<|vision_start|><|image_pad|><|vision_end|>"  # one image, as a template writes it


def template_parts(text: str, image_counts: Sequence[int], what: str) -> list[str | int]:
    """A rendering's text with each image as its placeholder count (`tokens.encode_parts`'s
    input). Every piece boundary is a special token, so encoding the pieces gives the ids the
    processor gives the whole text. RuntimeFailure when the rendering holds another number of
    images than the conversation has (a template that drops or adds images)."""
    pieces = text.split(VISION)
    if len(pieces) - 1 != len(image_counts):
        raise RuntimeFailure(f"{what}: the chat template rendered {len(pieces) - 1} images for "
                             f"{len(image_counts)} in the conversation — use a template that "
                             "renders every image part once")
    parts: list[str | int] = [pieces[0]]
    for n, piece in zip(image_counts, pieces[1:], strict=True):
        parts += [n, piece]
    return parts


def content_parts(text: str, n_images: int, what: str) -> list[dict]:
    """Chat-template content of a text with `<image>` markers, as verl builds it
    (`tokens.marked_parts`); BadInput naming `what` when there are more markers than images."""
    parts = marked_parts(text, n_images)
    if parts is None:
        from marscli.errors import BadInput

        raise BadInput(f"{what}: {text.count(IMAGE_MARK)} {IMAGE_MARK} markers for {n_images} "
                       "images — one marker per image")
    return parts


def tool_names(schemas: Sequence[dict]) -> list[str]:
    return [s["function"]["name"] for s in schemas]


class TemplateTurns:
    """A trajectory's token-exact segments taken from the policy's own chat template.

    `prompt` renders the opening messages with `tools=` and the generation prompt. `tool`
    appends the model's reply (its text as generated) and the tool message, re-renders, checks
    with `text_extension` that the new text extends the old text + the reply + `<|im_end|>`
    (when the model closed its turn), and returns the ids of the suffix alone: the model's ids
    are never re-tokenised. `text` is the text the ids so far stand for (images unexpanded)."""

    def __init__(self, processor: Any, tools: list[dict] | None, ids: Any) -> None:
        self.processor, self.tools, self.ids = processor, tools or None, ids
        self.messages: list[dict] = []
        self.text = ""

    def render(self) -> str:
        return self.processor.apply_chat_template(self.messages, tools=self.tools,
                                                  add_generation_prompt=True, tokenize=False)

    def prompt(self, messages: list[dict], counts: Sequence[int]) -> list[int]:
        """Compact ids of the prompt segment."""
        from marscli.qwen.tokens import encode_parts

        self.messages = list(messages)
        self.text = self.render()
        return encode_parts(self.processor.tokenizer, self.ids,
                            template_parts(self.text, counts, "the prompt"))

    def tool(self, reply: str, closed: bool, content: list[dict], counts: Sequence[int],
             turn: int) -> list[int]:
        """Compact ids of the tool segment after reply `turn` (1-based): from the end of the
        model's ids to the next generation prompt (`<|im_end|>` first when the reply was cut)."""
        from marscli.qwen.tokens import encode_parts

        before = self.text + reply + ("<|im_end|>" if closed else "")
        self.messages += [{"role": "assistant", "content": reply},
                          {"role": "tool", "content": content}]
        new_text = self.render()
        suffix = text_extension(before, new_text, turn)
        self.text = new_text
        return encode_parts(self.processor.tokenizer, self.ids,
                            template_parts(suffix, counts, f"turn {turn}"))


def check_renders_tools(processor: Any, schemas: Sequence[dict]) -> None:
    """BadInput unless the policy's chat template writes every schema's name when given
    `tools=`: a template that ignores `tools=` (the tiny model's own) would show the model no
    tools at all, silently."""
    from marscli.errors import BadInput

    if not getattr(processor, "chat_template", None):
        raise BadInput("--tools-config: the policy has no chat template to render tools= "
                       "through — use a checkpoint with one (Qwen3-VL's), or leave out "
                       "--tools-config")
    probe = processor.apply_chat_template([{"role": "user", "content": "q"}],
                                          tools=list(schemas), add_generation_prompt=True,
                                          tokenize=False)
    missing = [n for n in tool_names(schemas) if f'"{n}"' not in probe]
    if missing:
        raise BadInput(f"--tools-config: the policy's chat template does not render tools= "
                       f"({missing[0]!r} is not in its rendering) — use a checkpoint whose "
                       "template renders tools (Qwen3-VL's), or leave out --tools-config")
