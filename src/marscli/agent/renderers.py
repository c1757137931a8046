"""How the agent loop's turns become what the engine reads: one renderer per prompt-rendering
mode, chosen once when the Agent is built (`choose_renderer`), so that the loop's steps never ask
which mode they are in.

A renderer turns a trajectory's prompt, each reply and each observation into compact token ids
(the prompt, model and tool segments) and, for a message-level engine, chat messages. It keeps
no state of its own (one serves every trajectory, from any thread of the asynchronous loop):
what a mode keeps per trajectory lives on the trajectory (`Traj.rendered`, `Traj.messages`),
and only that mode's renderer touches it. The loop keeps everything else (segments, context,
budgets, counters, images).

- `OwnRenderer` (a token-level engine — hf, vllm, server, replay — without `--tools-config`):
  marscli's own system prompt (or `--system-prompt FILE`) followed by its `# Tools` block, laid
  out by tokens.py (`prompt_parts`, `tool_parts`); a reply's text is decoded from its ids.
- `TemplateRenderer` (`AgentConfig.tool_schemas`, from `--tools-config FILE`; token-level engines
  only): the system prompt, the question and the schemas go through the policy processor's
  `apply_chat_template(tools=...)`, which writes the `# Tools` block itself
  (chat_template.TemplateTurns). The prompt segment is that rendering with the generation
  prompt. After each reply, the conversation plus the reply (its text as generated) and the
  observation as a role `tool` message is rendered again; the new text must extend the old text
  + the reply (+ `<|im_end|>` when the model closed its turn), or the run fails naming the
  trajectory and the turn; the tool segment is the new suffix, tokenised on its own (it starts
  with the `\\n` after `<|im_end|>`, or with the `<|im_end|>` that closes a cut reply, masked).
  The model's ids are kept exactly as generated. Images a tool returns without `<image>`
  markers follow its text directly, as in Qwen's role-tool layout. The tools offered are exactly
  the schemas' (each under its schema's name): a schema naming a tool this run does not offer is
  refused (BadInput, with the list); with no tools (eval --mode direct) no tools block is
  rendered. A template that ignores `tools=` is refused. A release row's
  `input_template.arguments` (its dataset manifest's `system_prompt`, `format_instruction`) and
  its own `prompt` messages, when the row carries them, are honoured as verl's dataset builds
  them (`release_opening`); the row's system prompt wins over `--system-prompt`, which wins over
  marscli's.
- `MessageRenderer` (`engine.message_level`: the openai engine): the conversation goes to the
  engine as chat messages (OpenAI format; images as `{"type": "image", "image": i}` parts
  indexing the record's `images`), which the record carries. With a processor
  (`--tokenize-with`) the prompt, replies and observations are also tokenised into the same
  token-exact segments as `OwnRenderer`'s (`<|im_end|>` added when a reply stopped: the server
  cuts it off); without one, segments carry text only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from marscli.agent.protocol import SYSTEM_PROMPT, system_prompt, tool_content
from marscli.agent.tools_config import RELEASE_TOOLS
from marscli.agent.trajectory import Traj
from marscli.engines import Engine, Generation
from marscli.errors import BadInput, RuntimeFailure
from marscli.qwen.chat_template import TemplateTurns, check_renders_tools, content_parts, tool_names
from marscli.qwen.tokens import (
    IMAGE_MARK,
    SpecialIds,
    encode_parts,
    prompt_parts,
    special_ids,
    split_images,
    tool_parts,
)
from marscli.records.schema import Prompt
from marscli.tools import Tool

# A reply as recorded: its text, its compact ids (None without a tokenizer), its log-probs.
Reply = tuple[str, list[int] | None, list[float] | None]


class Renderer(Protocol):
    def prompt(self, t: Traj) -> list[int] | None:
        """The prompt segment's compact ids (None without a tokenizer); sets up what the mode
        keeps per trajectory."""

    def reply(self, t: Traj, g: Generation, closed: bool) -> Reply:
        """A reply's text, ids and log-probs (`closed`: the model ended its turn)."""

    def tool(self, t: Traj, text: str, new_idx: list[int], counts: list[int], closed: bool
             ) -> tuple[str, list[int] | None]:
        """An observation as recorded (its unmarked images placed) and its compact ids:
        `new_idx` the images it adds (indexes into `t.images`), `counts` their image-token
        counts (empty without a processor), `closed` whether the reply before it was closed."""


@dataclass(frozen=True)
class OwnRenderer:
    """marscli's own layout: system prompt + `# Tools` block, tokens.py's segments."""

    tok: Any
    ids: SpecialIds
    system: str  # marscli's (or --system-prompt) with the `# Tools` block

    def prompt(self, t: Traj) -> list[int] | None:
        return encode_parts(self.tok, self.ids,
                            prompt_parts(self.system, t.prompt.question, _counts(t)))

    def reply(self, t: Traj, g: Generation, closed: bool) -> Reply:
        return _decoded(self.tok, g, closed)

    def tool(self, t: Traj, text: str, new_idx: list[int], counts: list[int], closed: bool
             ) -> tuple[str, list[int] | None]:
        text = _place_images(text, len(new_idx), "\n")
        return text, encode_parts(self.tok, self.ids, tool_parts(text, counts, closed))


@dataclass(frozen=True)
class TemplateRenderer:
    """The checkpoint's chat template with `tools=`; each trajectory's rendering is its
    `t.rendered` (TemplateTurns), extended turn by turn."""

    processor: Any
    ids: SpecialIds
    schemas: list[dict] | None  # rendered as `tools=`; None: no tools (eval --mode direct)
    system: str  # the opening's system message when the row brings none

    def prompt(self, t: Traj) -> list[int] | None:
        t.rendered = TemplateTurns(self.processor, self.schemas, self.ids)
        return t.rendered.prompt(release_opening(t.prompt, len(t.images), self.system),
                                 _counts(t))

    def reply(self, t: Traj, g: Generation, closed: bool) -> Reply:
        return _decoded(self.processor.tokenizer, g, closed)

    def tool(self, t: Traj, text: str, new_idx: list[int], counts: list[int], closed: bool
             ) -> tuple[str, list[int] | None]:
        """The tool segment's ids from re-rendering the conversation (TemplateTurns.tool), the
        observation as a role `tool` message; a rendering that does not extend the previous
        one fails the run, naming the trajectory and the turn."""
        text = _place_images(text, len(new_idx), "")  # right after the text, as Qwen's tools
        reply = t.segments[-1].text  # the model segment this observation answers
        try:
            toks = t.rendered.tool(reply, closed, tool_content(text, len(counts)), counts,
                                   t.turns)
        except RuntimeFailure as e:
            raise RuntimeFailure(f"trajectory {t.id}: {e}") from None
        return text, toks


@dataclass(frozen=True)
class MessageRenderer:
    """Chat messages for a message-level engine, in `t.messages`; token-exact segments in
    marscli's layout too when there is a tokenizer (`--tokenize-with`)."""

    tok: Any | None
    ids: SpecialIds | None
    system: str  # marscli's (or --system-prompt) with the `# Tools` block

    def prompt(self, t: Traj) -> list[int] | None:
        q, idxs = t.prompt.question, list(range(len(t.images)))
        q = q if IMAGE_MARK in q else IMAGE_MARK * len(idxs) + q  # as prompt_parts places them
        t.messages = [{"role": "system", "content": self.system},
                      {"role": "user", "content": message_content(q, idxs)}]
        if self.tok is None:
            return None
        return encode_parts(self.tok, self.ids,
                            prompt_parts(self.system, t.prompt.question, _counts(t)))

    def reply(self, t: Traj, g: Generation, closed: bool) -> Reply:
        """The engine's text, tokenised canonically when there is a tokenizer, `<|im_end|>`
        added when the reply stopped (the server cuts it off)."""
        t.messages.append({"role": "assistant", "content": g.text})
        if self.tok is None:
            return g.text, None, None
        toks = self.tok.encode(g.text, add_special_tokens=False)
        return g.text, toks + ([self.ids.im_end] if closed else []), None

    def tool(self, t: Traj, text: str, new_idx: list[int], counts: list[int], closed: bool
             ) -> tuple[str, list[int] | None]:
        text = _place_images(text, len(new_idx), "\n")
        t.messages.append({"role": "user", "content": message_content(
            f"<tool_response>\n{text}\n</tool_response>", new_idx)})
        if self.tok is None:
            return text, None
        return text, encode_parts(self.tok, self.ids, tool_parts(text, counts, closed))


def choose_renderer(engine: Engine, tools: list[Tool], base_prompt: str | None,
                    schemas: list[dict] | None) -> tuple[Renderer, dict[str, Tool]]:
    """The renderer for this engine and `--tools-config` (`schemas`), and the tools the model is
    offered, by the names it sees (with `--tools-config`, the schemas' names). `base_prompt` is
    `--system-prompt` (None: marscli's)."""
    message_level = bool(getattr(engine, "message_level", False))
    processor = engine.processor  # None: a message-level engine without a tokenizer
    if processor is None and not message_level:
        raise ValueError("a token-level engine needs a processor")
    tok = processor.tokenizer if processor is not None else None
    ids = special_ids(tok) if tok is not None else None
    offered = {t.name: t for t in tools}
    if schemas is not None:
        if message_level:
            raise BadInput("--tools-config: prompts are rendered by the policy's chat template, "
                           "which needs a token-level engine — use --engine hf or vllm")
        schemas, offered = _template_tools(processor, schemas, offered)
        return TemplateRenderer(processor, ids, schemas, base_prompt or SYSTEM_PROMPT), offered
    system = system_prompt([t.schema for t in tools], base_prompt)
    if message_level:
        return MessageRenderer(tok, ids, system), offered
    return OwnRenderer(tok, ids, system), offered


def _template_tools(processor: Any, schemas: list[dict], tools: dict[str, Tool]
                    ) -> tuple[list[dict] | None, dict[str, Tool]]:
    """The schemas the template renders (`tools=`) and the tools by those names: exactly the
    tools this run offers, each under its schema's name; no schemas when the stage offers no
    tools (eval --mode direct)."""
    if not tools:
        return None, tools
    names = tool_names(schemas)
    missing = [n for n in names if RELEASE_TOOLS.get(n, n) not in tools]
    if missing:
        raise BadInput(f"--tools-config: {missing[0]} is in the tool schemas but this run "
                       f"offers only {', '.join(tools)} — set its backend "
                       "(--text-search, --image-search) or drop it from the file")
    renamed = {n: tools[RELEASE_TOOLS.get(n, n)] for n in names}
    check_renders_tools(processor, schemas)
    return schemas, renamed


def release_opening(prompt: Prompt, n_images: int, system: str) -> list[dict]:
    """The opening messages for the chat template, built as the release's dataset builds them
    (verl's `RLHFJSONDatasetV2._build_messages`): the row's own `prompt` messages when it
    carries them, else its question; `input_template.arguments.system_prompt` inserted as the
    system message (else the row's, else `system`: --system-prompt or marscli's),
    `format_instruction` appended to the first user message after a newline, and `<image>`
    markers as image parts (unmarked images first, as marscli places them)."""
    where = f"prompt {prompt.id!r} (line {prompt.line})"
    msgs = _row_messages(prompt, where)
    users = [m for m in msgs if m["role"] == "user"]
    args = _template_arguments(prompt.extra.get("input_template"))
    has_system = any(m["role"] == "system" for m in msgs)
    if args.get("system_prompt"):
        if has_system:
            raise BadInput(f"{where}: input_template.arguments.system_prompt and a system "
                           "message in `prompt` — keep one")
        msgs.insert(0, {"role": "system", "content": args["system_prompt"]})
    elif not has_system:
        msgs.insert(0, {"role": "system", "content": system})
    if args.get("format_instruction"):
        users[0]["content"] = users[0]["content"].rstrip() + "\n" + args["format_instruction"]
    _image_parts(users, n_images, where)
    return msgs


def _row_messages(prompt: Prompt, where: str) -> list[dict]:
    """The row's own `prompt` messages (copied: role and content only), else its question as
    the one user message; BadInput unless they have string content and a user message."""
    raw = prompt.extra.get("prompt")
    if isinstance(raw, list) and raw and all(isinstance(m, dict) for m in raw):
        msgs = [{"role": m.get("role"), "content": m.get("content")} for m in raw]
    else:
        msgs = [{"role": "user", "content": prompt.question}]
    if (not any(m["role"] == "user" for m in msgs)
            or not all(isinstance(m["content"], str) for m in msgs)):
        raise BadInput(f"{where}: prompt: expected chat messages with string content and a "
                       "user message")
    return msgs


def _image_parts(users: list[dict], n_images: int, where: str) -> None:
    """The users' `<image>` markers as image parts, in order; the images no marker places go
    first in the first user message (as marscli places them)."""
    unmarked = n_images - sum(m["content"].count(IMAGE_MARK) for m in users)
    users[0]["content"] = IMAGE_MARK * max(0, unmarked) + users[0]["content"]
    left = n_images
    for m in users:
        k = min(m["content"].count(IMAGE_MARK), left)
        m["content"] = content_parts(m["content"], k, f"{where}: question")
        left -= k


def _template_arguments(template: Any) -> dict:
    """`input_template.arguments` of a release row (its dataset manifest's), or {}."""
    args = template.get("arguments") if isinstance(template, dict) else None
    return {k: v for k, v in (args or {}).items()
            if k in ("system_prompt", "format_instruction") and isinstance(v, str)}


def message_content(text: str, image_idxs: list[int]) -> list[dict]:
    """Chat-message content parts of a text with `<image>` markers (images without a marker go
    last); an image is `{"type": "image", "image": i}`, i indexing the trajectory's images."""
    parts: list[dict] = []
    for p in split_images(text, image_idxs):  # ints come back in place: here, image indexes
        if isinstance(p, int):
            parts.append({"type": "image", "image": p})
        elif p:
            parts.append({"type": "text", "text": p})
    return parts


def _counts(t: Traj) -> list[int]:
    """Image-token counts of the trajectory's images (empty without a processor)."""
    return [f.n_tokens for f in t.feats]


def _decoded(tok: Any, g: Generation, closed: bool) -> Reply:
    """A token-level engine's reply: its ids as generated, its text decoded from them (without
    the closing `<|im_end|>`)."""
    body = g.tokens[:-1] if closed else g.tokens
    return tok.decode(body, skip_special_tokens=False), g.tokens, g.logprobs


def _place_images(text: str, n_new: int, sep: str) -> str:
    """`text` with a marker for each of its `n_new` images it does not mark, after the text
    (each after `sep`): images a tool returns unmarked go last."""
    if n_new and text.count(IMAGE_MARK) < n_new:
        text += (sep + IMAGE_MARK) * (n_new - text.count(IMAGE_MARK))
    return text
