"""The text corpus `corpus.jsonl`: rows `{id, title, text}` for `marscli index text`.

Each entity gets five short passages titled with its name: a summary ("Zorba was founded in 1987
by Kelon in Varn."), one per attribute, each repeating the attribute's keyword (city, founder,
year) so that the expert's query `"<Name> <keyword>"` ranks them first under BM25, and one
describing its logo (so a text-only route exists, as on the web). Distractors: shops that have
no logo in the world, and one passage per city; they share words with the real passages.
"""

from __future__ import annotations

import random

from marscli.toy.entities import COLOURS, Entity


def entity_passages(e: Entity) -> list[dict]:
    n, lg = e.name, e.logo
    texts = [
        f"{n} was founded in {e.year} by {e.founder} in {e.city}.",
        f"{n} is a company in the city of {e.city}. The home city of {n} is {e.city}.",
        f"{n} was founded by {e.founder}. The founder of {n} is {e.founder}.",
        f"{n} was founded in the year {e.year}. The founding year of {n} is {e.year}.",
        (f"The {n} logo is a {lg.colour} {lg.shape} on a {lg.plate} plate with the letter "
         f"{lg.letter}."),
    ]
    return [{"id": f"{e.slug}-{k}", "title": n, "text": t} for k, t in enumerate(texts, 1)]


def distractor_passages(rng: random.Random, shops: list[str], cities: list[str]) -> list[dict]:
    rows = []
    for name in shops:
        city, colour = rng.choice(cities), rng.choice(sorted(COLOURS))
        rows.append({"id": f"shop-{name.lower()}", "title": name,
                     "text": f"{name} is a small shop in the city of {city}. It sells {colour} "
                             f"paint and opened in {rng.randint(1900, 2019)}."})
    for city in cities:
        rows.append({"id": f"city-{city.lower()}", "title": city,
                     "text": f"{city} is a city with a river and an old market. Many companies "
                             f"were founded in {city}."})
    return rows


def make_corpus(rng: random.Random, entities: list[Entity], shops: list[str],
                cities: list[str]) -> list[dict]:
    rows = [r for e in entities for r in entity_passages(e)]
    return rows + distractor_passages(rng, shops, cities)
