"""Questions, gold answers and precomputed image-search lists of the toy world's prompt rows.

Three kinds, as in MARS:
- `perception`: the logo's shape colour, shape or letter; answerable from a crop of the logo.
- `knowledge`: the logo's company's city, founder or founding year; image search names the
  company (its top-5 list holds the true logo among logos that look different), text search
  gives the fact.
- `both`: the same facts, but the top-5 list holds look-alikes (same colour, or same shape), so
  the logo must be seen up close (zoom) to pick the right result; the question says to look
  closely, so the two kinds can be told apart from the text.
"""

from __future__ import annotations

import random

from marscli.toy.entities import Entity

KINDS = ("perception", "knowledge", "both")
ATTRS = {"perception": ("colour", "shape", "letter"),
         "knowledge": ("city", "founder", "year"),
         "both": ("city", "founder", "year")}
HITS = 5  # image search results per row (the paper shows up to 5)

_FACT_Q = {"city": "In which city was {subject} founded?",
           "founder": "Who founded {subject}?",
           "year": "In which year was {subject} founded?"}
_PERCEPTION_Q = {"colour": "What colour is the shape on the logo in this image?",
                 "shape": "What shape is on the logo in this image?",
                 "letter": "Which letter is on the logo in this image?"}


def question(kind: str, attr: str) -> str:
    if kind == "perception":
        return _PERCEPTION_Q[attr]
    if kind == "knowledge":
        return _FACT_Q[attr].format(subject="the company whose logo appears in this image")
    return "Look closely at the small logo in this image. " + _FACT_Q[attr].format(
        subject="its company")


def gold(entity: Entity, attr: str) -> str:
    lg = entity.logo
    return {"colour": lg.colour, "shape": lg.shape, "letter": lg.letter}.get(attr) \
        or entity.attribute(attr)


def plan(rng: random.Random, n: int, n_entities: int,
         kinds: tuple[str, ...] = KINDS) -> list[tuple[str, str, int]]:
    """(kind, attribute, entity index) for `n` rows: kinds and attributes in turn, entities in
    reshuffled passes so that every entity appears before any appears twice."""
    out, order = [], []
    for i in range(n):
        if not order:
            order = list(range(n_entities))
            rng.shuffle(order)
        kind = kinds[i % len(kinds)]
        attr = ATTRS[kind][(i // len(kinds)) % len(ATTRS[kind])]
        out.append((kind, attr, order.pop()))
    return out


def search_hits(rng: random.Random, entities: list[Entity], true: int,
                lookalike: bool) -> list[int]:
    """Entity indexes of the image-search list: the true one at a random rank among
    distractors; look-alikes (same colour, then same shape) first when `lookalike`, logos that
    differ in both colour and shape first otherwise."""
    t = entities[true].logo
    others = [i for i in range(len(entities)) if i != true]
    rng.shuffle(others)

    def tier(i: int) -> int:
        o = entities[i].logo
        same_colour, same_shape = o.colour == t.colour, o.shape == t.shape
        if lookalike:
            return 0 if same_colour else 1 if same_shape else 2
        return 0 if not (same_colour or same_shape) else 1

    picked = sorted(others, key=tier)[:HITS - 1]  # stable: random order within a tier
    picked.insert(rng.randint(0, len(picked)), true)
    return picked
