"""Scripted expert replies for cold-start SFT, written from the ground truth.

One string per assistant turn, in the protocol (`<thinking>..</thinking>` then one tool call or
the answer). Thinking texts are short fixed templates: a tiny model has to learn them.
- perception: zoom on the logo's grid cell, then answer.
- knowledge: text search "Name keyword" for the company the question names, then answer.
- both: image search, "Result k matches the logo: Name", then as knowledge.
With `direct`, any kind is answered at once without a tool: the cold start's under-use of tools
(the toy world's `--direct`), which RL has to unlearn.
The replay engine feeds them through the real agent and tools; they hold for what the tools
return because the world was built so (tests check it: the zoom crop holds the logo, the image
search list holds the entity at rank k, the text index returns the fact for the query).
"""

from __future__ import annotations

import json

from marscli.toy.entities import Entity
from marscli.toy.prompts import KINDS, gold

KEYWORD = {"city": "city", "founder": "founder", "year": "year"}  # text-search query word


def _call(name: str, arguments: dict) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def _turn(thinking: str, action: str) -> str:
    return f"<thinking>{thinking}</thinking>{action}"


def zoom_turn(box: list[int]) -> str:
    return _turn("The logo is small. I zoom in on it.",
                 _call("image_zoom_in_tool", {"bbox_2d": list(box), "label": "logo"}))


def perception_answer(entity: Entity, attr: str) -> str:
    """The answer turn after the zoom. Its thinking names what to read, not the answer: a
    tiny model learns to copy a word from its own thinking into the answer far more slowly
    than it learns to read the crop (measured: the copied answer's loss stayed 3x the read
    word's after 720 SFT steps), so the answer is read from the image directly."""
    lg = entity.logo
    what, answer = {"colour": ("the colour of the shape", lg.colour),
                    "shape": ("the shape", lg.shape),
                    "letter": ("the letter", lg.letter)}[attr]
    return _turn(f"The logo is clear now. I read {what} on it.", f"<answer>{answer}</answer>")


DIRECT = "The logo is big enough. I answer without zooming."
DIRECT_SEARCH = "I know this company. I answer without searching."


def direct_answer(entity: Entity, attr: str, thinking: str = DIRECT) -> str:
    """An answer without a tool: what a cold-start teacher writes when it does not zoom or
    search (the toy world's `--direct` share of the SFT rows). Seen at the scene's resolution
    the logo is a few pixels, and another world's facts are not in the model, so a policy that
    answers so is mostly guessing: RL has to learn that the tools pay."""
    return _turn(thinking, f"<answer>{gold(entity, attr)}</answer>")


def fact_turns(entity: Entity, attr: str, thinking: str) -> list[str]:
    """Text search "Name keyword" (after `thinking`), then the answer copied from the result."""
    n, kw = entity.name, KEYWORD[attr]
    final = {"city": f"{n} was founded in {entity.city}.",
             "founder": f"{n} was founded by {entity.founder}.",
             "year": f"{n} was founded in {entity.year}."}[attr]
    return [_turn(thinking, _call("text_search_tool", {"query": f"{n} {kw}"})),
            _turn(final, f"<answer>{entity.attribute(attr)}</answer>")]


def search_turns(entity: Entity, attr: str, rank: int) -> list[str]:
    """Image search, pick result `rank` (1-based), text search, answer."""
    return [_turn("I need the company of this logo. I search for the image.",
                  _call("image_search_tool", {})),
            *fact_turns(entity, attr, f"Result {rank} matches the logo: {entity.name}. "
                                      f"I search for its {KEYWORD[attr]}.")]


def expert_replies(kind: str, attr: str, entity: Entity, zoom_box: list[int],
                   rank: int, direct: bool = False, guess: Entity | None = None) -> list[str]:
    """The expert's turns; `direct`: the question answered at once, without a tool, with
    `guess`'s attribute: a teacher that answers from a memory it does not have, so that the
    cold start cannot memorise the world RL is tested on. The world draws a search question's
    guess among the other companies (never the gold fact) and a perception question's among
    all its logos (the answers' marginal: the scene's logo is a few pixels)."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}")
    if direct:
        return [direct_answer(guess or entity, attr,
                              DIRECT if kind == "perception" else DIRECT_SEARCH)]
    if kind == "perception":
        return [zoom_turn(zoom_box), perception_answer(entity, attr)]
    if kind == "knowledge":
        return fact_turns(entity, attr, f"I need the {KEYWORD[attr]} of {entity.name}. "
                                        "I search for it.")
    return search_turns(entity, attr, rank)
