"""The records of docs/design.md as dataclasses, validated where they enter a stage.

Rows flow through stages as plain dicts (unknown fields carried through untouched); these
dataclasses are the typed view a stage takes of the fields it needs. `load_prompts` accepts
marscli's own prompt rows and MARS-style rows and converts the latter.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from marscli.errors import BadInput
from marscli.records.jsonl import SCHEMA_VERSION, get_field, read_rows
from marscli.records.mcq import mcq_choices

SEGMENT_ROLES = ("prompt", "model", "tool")


@dataclass
class Prompt:
    """One question: marscli form `{v, id, image, question, answer, choices?, category?,
    image_search?}`; `base` is the folder image paths are relative to."""

    id: str
    question: str
    images: list[str]
    answer: list[str]
    base: Path
    choices: list[str] | None = None
    category: str | None = None
    image_search: list[dict] | None = None
    extra: dict = field(default_factory=dict)  # every other field, carried into trajectories
    line: int = 0  # where the row was read (for error messages)

    def image_paths(self) -> list[Path]:
        return [p if (p := Path(s)).is_absolute() else self.base / p for s in self.images]

    def row(self) -> dict:
        """The prompt as a dict for tools that read it (data-driven image search)."""
        return {**self.extra, "id": self.id, "question": self.question, "image": self.images,
                "answer": self.answer, "image_search": self.image_search, "_base": str(self.base)}


def _str_list(row: dict, key: str, src: str, line: int, *, required: bool = True) -> list[str]:
    val = row.get(key)
    if val is None:
        if required:
            raise BadInput(f"{src}:{line}: {key}: missing required field")
        return []
    if isinstance(val, str):
        return [val]
    if not isinstance(val, list) or not all(isinstance(x, str) for x in val):
        raise BadInput(f"{src}:{line}: {key}: expected a string or a list of strings")
    return val


def _from_mars(row: dict, src: str, line: int) -> dict:
    """MARS-style row → marscli fields. `<image>` markers are dropped from the question: the
    image goes first, as in the released data."""
    msgs = row["prompt"]
    if not isinstance(msgs, list) or not msgs or not isinstance(msgs[-1], dict):
        raise BadInput(f"{src}:{line}: prompt: expected a list of chat messages")
    user = [m for m in msgs if isinstance(m, dict) and m.get("role") == "user"]
    content = (user or msgs)[-1].get("content")
    if not isinstance(content, str):
        raise BadInput(f"{src}:{line}: prompt.content: expected a string")
    gt = get_field(row, "reward_model.ground_truth", (str, list), src, line)
    titles = row.get("image_search_title_list") or []
    thumbs = row.get("image_search_thumbnail_list") or []
    extra_info = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
    # the row's own id, else its `index` (the release's training rows), else extra_info's
    rid = next((row[k] for k in ("id", "index") if _present(row.get(k))),
               extra_info.get("index", f"line{line}"))
    out = {"id": str(rid), "question": re.sub(r"<image>\s*", "", content).strip(),
           "image": row.get("image", row.get("images", [])), "answer": gt}
    if titles or thumbs:
        out["image_search"] = [{"title": t, "thumbnail": th} for t, th in zip(titles, thumbs)]
    return out


def _present(v: object) -> bool:
    return v is not None and v != "" and not isinstance(v, bool)


_PROMPT_KEYS = {"v", "id", "image", "question", "answer", "choices", "category", "image_search"}
# A MARS row's `prompt` messages stay in `extra`: with --tools-config the agent renders them as
# the release does (their <image> placement, whitespace and system message).
_MARS_KEYS = {"image", "images", "reward_model", "image_search_title_list",
              "image_search_thumbnail_list"}


def parse_prompt(row: dict, src: str, line: int, base: Path) -> Prompt:
    is_mars = "prompt" in row and "question" not in row
    view = _from_mars(row, src, line) if is_mars else row
    rid = view.get("id")
    if not isinstance(rid, (str, int)) or isinstance(rid, bool) or str(rid) == "":
        raise BadInput(f"{src}:{line}: id: missing required field (a non-empty string)")
    question = view.get("question")
    if not isinstance(question, str):
        raise BadInput(f"{src}:{line}: question: missing required field (a string)")
    images = _str_list(view, "image", src, line)
    if not images:
        raise BadInput(f"{src}:{line}: image: at least one image path is required")
    answer = _str_list(view, "answer", src, line, required=False)
    choices = view.get("choices")
    if choices is not None and (not isinstance(choices, list)
                                or not all(isinstance(c, str) for c in choices)):
        raise BadInput(f"{src}:{line}: choices: expected a list of strings")
    if choices is None and is_mars:  # the release puts a question's options in its text
        choices = mcq_choices(question, answer)
    category = view.get("category")
    if category is not None and not isinstance(category, str):
        raise BadInput(f"{src}:{line}: category: expected a string")
    isearch = view.get("image_search")
    if isearch is not None and (not isinstance(isearch, list)
                                or not all(isinstance(x, dict) for x in isearch)):
        raise BadInput(f"{src}:{line}: image_search: expected a list of {{title, thumbnail}}")
    skip = _MARS_KEYS if is_mars else _PROMPT_KEYS
    extra = {k: v for k, v in row.items() if k not in skip}
    return Prompt(id=str(rid), question=question, images=images, answer=answer, base=base,
                  choices=choices, category=category, image_search=isearch, extra=extra,
                  line=line)


def load_prompts(path: str, image_dir: str | Path | None = None) -> list[Prompt]:
    """Read and validate a prompts file; duplicate ids are refused (they would collide in
    trajectory ids and make resumption ambiguous). Image paths are relative to `image_dir`,
    by default the file's folder."""
    if image_dir is not None:
        base = Path(image_dir).resolve()
        if not base.is_dir():
            raise BadInput(f"--image-dir: {image_dir}: no such folder")
    else:
        base = Path.cwd() if path == "-" else Path(path).resolve().parent
    prompts, seen = [], {}
    for line, row in read_rows(path):
        p = parse_prompt(row, path, line, base)
        if p.id in seen:
            raise BadInput(f"{path}:{line}: id: duplicate id {p.id!r} (first on line {seen[p.id]})")
        seen[p.id] = line
        prompts.append(p)
    return prompts


@dataclass
class Segment:
    role: str  # prompt | model | tool
    tokens: list[int]  # compact: a negative -n stands for n <|image_pad|> tokens
    images: list[int] | None = None  # indexes into the trajectory's images
    logprobs: list[float] | None = None  # model segments: the engine's log-probs; None: none
    text: str | None = None  # model segments: decoded text; tool segments: the observation
    tool: str | None = None
    ok: bool | None = None
    failed: bool | None = None  # tool segments: a backend failure, not the model's mistake
    ms: int | None = None

    def to_dict(self) -> dict:
        """Fields that are set; a model segment always says `logprobs`, `null` when the engine
        has none (docs/design.md "The trajectory record": never 0, and absent would read as
        a field forgotten)."""
        return {k: v for k, v in self.__dict__.items()
                if v is not None or (k == "logprobs" and self.role == "model")}


def parse_segments(row: dict, src: str, line: int) -> list[Segment]:
    """Validate a trajectory's segments (update and sft train on exactly these tokens)."""
    segs = get_field(row, "segments", list, src, line)
    out = []
    for i, s in enumerate(segs):
        f = f"segments[{i}]"
        if not isinstance(s, dict):
            raise BadInput(f"{src}:{line}: {f}: expected an object")
        role = s.get("role")
        if role not in SEGMENT_ROLES:
            raise BadInput(f"{src}:{line}: {f}.role: expected one of {', '.join(SEGMENT_ROLES)}")
        toks = s.get("tokens")
        if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                 for t in toks):
            raise BadInput(f"{src}:{line}: {f}.tokens: expected a list of integers")
        lps = s.get("logprobs")
        if lps is not None and (not isinstance(lps, list) or len(lps) != len(toks)):
            raise BadInput(f"{src}:{line}: {f}.logprobs: expected one number per token")
        imgs = s.get("images")
        if imgs is not None and not all(isinstance(x, int) for x in imgs):
            raise BadInput(f"{src}:{line}: {f}.images: expected a list of image indexes")
        out.append(Segment(role=role, tokens=toks, images=imgs, logprobs=lps,
                           text=s.get("text"), tool=s.get("tool"), ok=s.get("ok"),
                           failed=s.get("failed"), ms=s.get("ms")))
    if not any(s.role == "model" and s.tokens for s in out):
        raise BadInput(f"{src}:{line}: segments: no model segment to train on")
    return out


def parse_image_refs(row: dict, src: str, line: int) -> list[dict]:
    imgs = get_field(row, "images", list, src, line)
    for i, im in enumerate(imgs):
        if not isinstance(im, dict) or not isinstance(im.get("path"), str):
            raise BadInput(f"{src}:{line}: images[{i}].path: missing required field")
    return imgs


def new_record(**fields: Any) -> dict:
    """A record dict with the schema version first."""
    return {"v": SCHEMA_VERSION, **fields}
