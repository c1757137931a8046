"""Questions, gold answers and precomputed image-search lists of the toy world's prompt rows.

Three kinds, as in MARS:
- `perception`: the logo's shape colour, shape or letter; answerable from a crop of the logo.
- `knowledge`: a named company's city, founder or founding year ("Who founded Zorba?"): text
  search gives the fact, which no model of another world can know.
- `both`: the same facts of the company whose logo is in the image: image search names the
  company (its top-5 list holds the true logo among logos that differ from it in colour and
  shape), then text search gives the fact.
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


def question(kind: str, attr: str, entity: Entity) -> str:
    if kind == "perception":
        return _PERCEPTION_Q[attr]
    if kind == "knowledge":
        return _FACT_Q[attr].format(subject=entity.name)
    return _FACT_Q[attr].format(subject="the company whose logo appears in this image")


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


def search_hits(rng: random.Random, entities: list[Entity], true: int) -> list[int]:
    """Entity indexes of the image-search list: the true one at a random rank among
    distractors, logos that differ from it in both colour and shape first (so that the scene's
    logo tells which result is its own)."""
    t = entities[true].logo
    others = [i for i in range(len(entities)) if i != true]
    rng.shuffle(others)

    def tier(i: int) -> int:
        o = entities[i].logo
        return 0 if not (o.colour == t.colour or o.shape == t.shape) else 1

    picked = sorted(others, key=tier)[:HITS - 1]  # stable: random order within a tier
    picked.insert(rng.randint(0, len(picked)), true)
    return picked
