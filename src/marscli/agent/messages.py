"""Message rows → token-exact trajectory rows, laid out exactly as rollout lays out its turns.

A message row is a conversation, the layout LLaMA-Factory and the MARS data use:

    {"messages": [{"role": "system"?|"user"|"assistant"|"tool", "content": str | [parts]}, ...],
     "images": ["rel/path.jpg" | {"path": ...}, ...]}

- Images: `<image>` markers in text, or `{"type": "image"}` parts, take the row's `images` in
  order; `{"type": "image", "image": i}` (the openai engine's records) names image i of the row,
  and `{"type": "image", "image": "path"}` a file (relative to the data file's folder). Every
  listed image must be placed once at least; a marker with no image left is an error.
- Tool responses: a `tool` message, or a `user` message right after an assistant turn whose text
  is already wrapped in `<tool_response>\\n...\\n</tool_response>` (the agent's own form). Both
  become rollout's tool turn (`tokens.tool_parts`); consecutive tool messages share one user
  turn, each wrapped, as Qwen's chat template does.
- Assistant turns: the content (plus any OpenAI-style `tool_calls`, written in marscli's
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` form) tokenised as the engines
  tokenise replies, then `<|im_end|>`: these are the `model` segments, the only ones trained on.
  Messages after the last assistant turn are dropped (nothing to learn from them).
- System prompt: a leading system message is used verbatim. Without one, marscli's system prompt
  with the `# Tools` block of all three tools is inserted (`default_system`), which is what
  `marscli rollout` shows the model when both search backends are configured; a different
  base prompt (rollout's `--system-prompt FILE`) can be passed as `base`.

The common shape (system?, one user turn, then assistant / tool turns) is encoded with the very
functions rollout uses (`tokens.prompt_parts`, `tokens.tool_parts`, `encode_parts`), so a
message row and the trajectory rollout records for the same conversation give identical ids.
Other shapes (several user turns before the first answer, a plain user turn between assistant
turns) follow the same chat layout, `<|im_start|>{role}\\n{content}<|im_end|>\\n`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from marscli.agent.protocol import system_prompt
from marscli.errors import BadInput
from marscli.qwen.tokens import (
    IMAGE_MARK,
    encode_parts,
    prompt_parts,
    special_ids,
    split_images,
    tool_parts,
)

ROLES = ("system", "user", "assistant", "tool")
_OPEN, _CLOSE = "<tool_response>\n", "\n</tool_response>"
_BETWEEN = _CLOSE + "\n" + _OPEN  # consecutive tool responses in one user turn


def default_system(base: str | None = None) -> str:
    """marscli's system prompt (or `base`) with the tools block of the three tools."""
    from marscli.tools import TOOL_NAMES, TOOLS

    return system_prompt([TOOLS.get(n).schema for n in TOOL_NAMES], base)


def row_kind(row: dict, src: str, line: int) -> str:
    """`trajectory` (segments with token ids) or `messages`. A record of the openai engine run
    without `--tokenize-with` carries text-only segments and its `messages`: the latter count."""
    segs = row.get("segments")
    if isinstance(segs, list) and segs and all(isinstance(s, dict) and "tokens" in s for s in segs):
        return "trajectory"
    if "messages" in row:
        return "messages"
    if "segments" in row:
        return "trajectory"  # parse_segments names what is wrong with them
    raise BadInput(f"{src}:{line}: expected `segments` (a trajectory row from rollout) or "
                   "`messages` (a conversation with assistant turns)")


class _Images:
    """The row's images, handed out in order to markers and placed by index or path."""

    def __init__(self, row: dict, src: str, line: int, base: Path) -> None:
        key = "images" if "images" in row else "image"
        raw = row.get(key) or []
        if isinstance(raw, str):
            raw = [raw]
        if not isinstance(raw, list):
            raise BadInput(f"{src}:{line}: {key}: expected a list of image paths")
        self.paths: list[str] = []
        for i, im in enumerate(raw):
            p = im.get("path") if isinstance(im, dict) else im
            if not isinstance(p, str) or not p:
                raise BadInput(f"{src}:{line}: {key}[{i}]: expected a path (or {{\"path\": ...}})")
            self.paths.append(p)
        self.n_listed = len(self.paths)
        self.key, self.src, self.line, self.base = key, src, line, base
        self.cursor = 0
        self.used: set[int] = set()

    def next(self, where: str) -> int:
        while self.cursor in self.used and self.cursor < self.n_listed:
            self.cursor += 1  # an image placed by index is not handed out again
        if self.cursor >= self.n_listed:
            raise BadInput(f"{self.src}:{self.line}: {where}: more {IMAGE_MARK} markers / image "
                           f"parts than images ({self.n_listed} in `{self.key}`)")
        self.cursor += 1
        return self.take(self.cursor - 1, where)

    def take(self, i: Any, where: str) -> int:
        if isinstance(i, str):  # a path of its own
            self.paths.append(i)
            i = len(self.paths) - 1
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(self.paths):
            raise BadInput(f"{self.src}:{self.line}: {where}: image index {i!r} out of range "
                           f"({self.n_listed} images in `{self.key}`)")
        self.used.add(i)
        return i

    def check_all_placed(self) -> None:
        left = [i for i in range(self.n_listed) if i not in self.used]
        if left:
            raise BadInput(f"{self.src}:{self.line}: {self.key}[{left[0]}]: not placed by any "
                           f"{IMAGE_MARK} marker or image part ({self.n_listed} images, "
                           f"{len(self.used & set(range(self.n_listed)))} placed)")


def _text(content: Any, images: _Images, where: str) -> tuple[str, list[int]]:
    """Content → text with one `<image>` marker per image, and the image indexes in order."""
    if content is None:
        return "", []
    if isinstance(content, str):
        return content, [images.next(where) for _ in range(content.count(IMAGE_MARK))]
    if not isinstance(content, list):
        raise BadInput(f"{images.src}:{images.line}: {where}: expected a string or a list of parts")
    text, idxs = [], []
    for j, part in enumerate(content):
        w = f"{where}[{j}]"
        if isinstance(part, str):
            part = {"type": "text", "text": part}
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            text.append(part["text"])
            idxs += [images.next(w) for _ in range(part["text"].count(IMAGE_MARK))]
        elif kind == "image":
            ref = part.get("image", part.get("path"))
            text.append(IMAGE_MARK)
            idxs.append(images.next(w) if ref is None else images.take(ref, w))
        else:
            raise BadInput(f"{images.src}:{images.line}: {w}: unsupported part "
                           f"{kind!r} — expected {{\"type\": \"text\", \"text\": ...}} or "
                           "{\"type\": \"image\"}")
    return "".join(text), idxs


def _tool_calls(msg: dict, where: str, src: str, line: int) -> str:
    """OpenAI-style `tool_calls` of an assistant message, in marscli's inline form."""
    calls = msg.get("tool_calls") or []
    if not isinstance(calls, list):
        raise BadInput(f"{src}:{line}: {where}.tool_calls: expected a list")
    out = []
    for k, c in enumerate(calls):
        fn = c.get("function", c) if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadInput(f"{src}:{line}: {where}.tool_calls[{k}]: expected "
                           "{\"function\": {\"name\": ..., \"arguments\": ...}}")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass
        call = json.dumps({"name": fn["name"], "arguments": args}, ensure_ascii=False)
        out.append(f"<tool_call>{call}</tool_call>")
    return "".join(out)


def _unwrap(text: str) -> str | None:
    """The inside of `<tool_response>\\n...\\n</tool_response>`, or None."""
    if (text.startswith(_OPEN) and text.endswith(_CLOSE)
            and len(text) >= len(_OPEN) + len(_CLOSE)):
        return text[len(_OPEN):len(text) - len(_CLOSE)]
    return None


def _render(role: str, text: str) -> str:
    if role == "tool":
        return f"<|im_start|>user\n{_OPEN}{text}{_CLOSE}<|im_end|>\n"
    return f"<|im_start|>{role}\n{text}<|im_end|>\n"


def to_trajectory(row: dict, src: str, line: int, base: Path, processor: Any,
                  system: str) -> dict:
    """A message row as a trajectory row (`images`, compact `segments`) that
    `batch.load_example` validates and assembles like any rollout record."""
    msgs = row.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadInput(f"{src}:{line}: messages: expected a non-empty list of "
                       "{\"role\", \"content\"} objects")
    images = _Images(row, src, line, base)
    turns: list[tuple[str, str, list[int]]] = []  # (role, text with markers, image indexes)
    for k, m in enumerate(msgs):
        where = f"messages[{k}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BadInput(f"{src}:{line}: {where}.role: expected one of {', '.join(ROLES)}")
        text, idxs = _text(m.get("content"), images, f"{where}.content")
        if m["role"] == "assistant":
            if idxs:
                raise BadInput(f"{src}:{line}: {where}.content: an assistant turn cannot hold "
                               "images (the model only writes text)")
            text += _tool_calls(m, where, src, line)
        turns.append((m["role"], text, idxs))
    images.check_all_placed()
    last = max((k for k, t in enumerate(turns) if t[0] == "assistant"), default=None)
    if last is None:
        raise BadInput(f"{src}:{line}: messages: no assistant turn to train on")
    counts = _counts(images, src, line, base, processor)
    tok = processor.tokenizer
    ids = special_ids(tok)
    segments: list[dict] = []
    first = next(k for k, t in enumerate(turns) if t[0] == "assistant")
    segments.append(_prompt_segment(turns[:first], system, counts, tok, ids))
    k = first
    while k <= last:
        if turns[k][0] == "assistant":
            toks = tok.encode(turns[k][1], add_special_tokens=False) + [ids.im_end]
            segments.append({"role": "model", "tokens": toks, "text": turns[k][1]})
            k += 1
            continue
        run = []
        while turns[k][0] != "assistant":
            run.append(turns[k])
            k += 1
        segments.append(_between_segment(run, counts, tok, ids))
    return {"images": [{"path": p} for p in images.paths], "segments": segments}


def _counts(images: _Images, src: str, line: int, base: Path, processor: Any) -> list[int]:
    """Placeholder tokens of each image, from its header where possible (batch's rule)."""
    from marscli.qwen.images import MAX_SOURCE_PIXELS, placeholder_count

    out = []
    for i, p in enumerate(images.paths):
        path = Path(p) if Path(p).is_absolute() else base / p
        where = f"{images.key}[{i}]" if i < images.n_listed else "messages: image part"
        if not path.is_file():
            raise BadInput(f"{src}:{line}: {where}.path: {path}: image not found")
        try:
            n = placeholder_count(processor, path)
            if n is None:  # too large to know from the header: decode it as the agent does
                from marscli.qwen.images import open_image
                from marscli.qwen.tokens import image_features

                im = open_image(path, max_pixels=MAX_SOURCE_PIXELS)
                n = image_features(processor, im).n_tokens
        except BadInput as e:
            raise BadInput(f"{src}:{line}: {where}.path: {e}") from None
        out.append(n)
    return out


def _prompt_segment(head: list[tuple[str, str, list[int]]], system: str, counts: list[int],
                    tok: Any, ids: Any) -> dict:
    """Everything before the first assistant turn, ending with the assistant header."""
    sys_text = system
    if head and head[0][0] == "system" and not head[0][2]:
        sys_text, head = head[0][1], head[1:]
    idxs = [i for _, _, ix in head for i in ix]
    if len(head) == 1 and head[0][0] == "user":  # the common shape: rollout's own function
        parts = prompt_parts(sys_text, head[0][1], [counts[i] for i in idxs])
    else:
        text = (f"<|im_start|>system\n{sys_text}<|im_end|>\n"
                + "".join(_render(r, t) for r, t, _ in head) + "<|im_start|>assistant\n")
        parts = split_images(text, [counts[i] for i in idxs])
    return {"role": "prompt", "tokens": encode_parts(tok, ids, parts), "images": idxs}


def _between_segment(run: list[tuple[str, str, list[int]]], counts: list[int], tok: Any,
                     ids: Any) -> dict:
    """The turns between two assistant turns (after the first's `<|im_end|>`)."""
    idxs = [i for _, _, ix in run for i in ix]
    inner = []
    for role, text, _ in run:
        inside = text if role == "tool" else _unwrap(text) if role == "user" else None
        inner.append(inside)
    if all(x is not None for x in inner):  # tool responses: rollout's own function
        parts = tool_parts(_BETWEEN.join(inner), [counts[i] for i in idxs], True)
        return {"role": "tool", "tokens": encode_parts(tok, ids, parts), "images": idxs,
                "text": _BETWEEN.join(inner)}
    text = "\n" + "".join(_render(r, t) for r, t, _ in run) + "<|im_start|>assistant\n"
    parts = split_images(text, [counts[i] for i in idxs])
    return {"role": "tool", "tokens": encode_parts(tok, ids, parts), "images": idxs}
