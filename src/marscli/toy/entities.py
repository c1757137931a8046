"""Made-up entities: companies with a founder, a city, a founding year and a logo.

Names are built from a small syllable set (`Zorba`, `Kelon`, `Varn`): short, pronounceable, and
not English words, so a tokenizer trained on the world's text makes each one a single token
(docs/demo.md "Can the tiny model learn a visual task on CPU?"). Every answer of the world is one
such word: a city, a founder's surname, a year, a colour, a shape or a capital letter.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

ONSETS = tuple("bdfgklmnprstvz")  # the initials double as the logo letters (render.GLYPHS)
VOWELS = tuple("aeiou")
CODAS = tuple("rlnsk")
CLUSTERS = ("rn", "sk", "rv", "lk", "nd", "rd", "lm", "st")

# Logo colours: saturated, far from the scene clutter's muted palette (render.muted).
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30), "green": (30, 170, 50), "blue": (30, 70, 220),
    "yellow": (240, 210, 20), "orange": (245, 130, 20), "purple": (140, 40, 190),
    "pink": (245, 80, 170), "cyan": (20, 200, 220),
}
PLATES: dict[str, tuple[int, int, int]] = {"white": (250, 250, 250), "black": (15, 15, 15)}
SHAPES = ("circle", "square", "triangle", "diamond", "star", "cross")
MAX_ENTITIES = len(COLOURS) * len(SHAPES) * len(PLATES)  # every logo a distinct triple

# Generated words that are English (or too close to it) are skipped.
_ENGLISH_TEXT = """
bark bend bind bird bond born bulk burn dark darn desk disk dusk farm fast fern film find firm
fist fond ford form fund gulk kind land last lend list lord mask mast mend milk mind mist most
must nerd norm park pond post rest risk rust sand send silk sulk task tend term test torn tusk
turn vast vest bask bust dust gist gust just lust lost past pest zest musk husk tark dorm fork
pork kiln film helm realm bald bold fold gold hold mold sold told weld wild mild gild held meld
porn kelp sorta manna salsa pasta tonka polka nerva
"""
_ENGLISH = frozenset(_ENGLISH_TEXT.split())


@dataclass(frozen=True)
class Logo:
    shape: str  # one of SHAPES
    colour: str  # the shape's colour, one of COLOURS
    plate: str  # the background plate, one of PLATES
    letter: str  # capital initial of the company name, drawn under the shape


@dataclass(frozen=True)
class Entity:
    name: str  # "Zorba": also the logo file stem (lowercased) and the search title
    founder: str  # surname, "Kelon"
    city: str  # "Varn"
    year: str  # "1987" (a string: answers are strings)
    logo: Logo

    @property
    def slug(self) -> str:
        return self.name.lower()

    def attribute(self, attr: str) -> str:
        return {"city": self.city, "founder": self.founder, "year": self.year}[attr]

    def to_dict(self) -> dict:
        return {**asdict(self), "logo_path": f"logos/{self.slug}.png"}


def _company(rng: random.Random) -> str:  # CVC.CV: Zorba
    return "".join([rng.choice(ONSETS), rng.choice(VOWELS), rng.choice(CODAS),
                    rng.choice(ONSETS), rng.choice(VOWELS)]).capitalize()


def _person(rng: random.Random) -> str:  # CV.CVC: Kelon
    return "".join([rng.choice(ONSETS), rng.choice(VOWELS), rng.choice(ONSETS),
                    rng.choice(VOWELS), rng.choice(CODAS)]).capitalize()


def _place(rng: random.Random) -> str:  # CVCC: Varn
    return "".join([rng.choice(ONSETS), rng.choice(VOWELS), rng.choice(CLUSTERS)]).capitalize()


def _unique(rng: random.Random, make, n: int, taken: set[str]) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        w = make(rng)
        if w in taken or w.lower() in _ENGLISH or w[:2] == w[2:4]:  # no "Kaka"-like stutters
            continue
        taken.add(w)
        out.append(w)
    return out


def syllables() -> list[str]:
    """Every piece a name is built of, capitalised and not (onset+vowel, onset+vowel+coda, the
    clusters): a tokenizer trained on these and on no name splits every world's names alike, so
    a model pre-trained on some worlds meets the same kind of token sequences in any other."""
    heads = [o + v for o in ONSETS for v in VOWELS]
    pieces = heads + [h + c for h in heads for c in CODAS] + list(CLUSTERS) + list(CODAS)
    return pieces + [p.capitalize() for p in heads + [h + c for h in heads for c in CODAS]]


def make_entities(rng: random.Random, n: int, n_cities: int = 8, n_extra: int = 0,
                  avoid: frozenset[tuple[str, str]] = frozenset(),
                  ) -> tuple[list[Entity], list[str], list[str]]:
    """`n` entities, the world's city names, and `n_extra` spare company-like names (for
    distractor passages: companies that have no logo in the world). No logo takes a
    (shape, colour) pair of `avoid` (another world's logos: a pre-training world disjoint from
    the demo's)."""
    pairs = [(s, c) for s in SHAPES for c in COLOURS]
    most = 2 * len(set(pairs) - avoid)  # a logo is a (shape, colour) pair on one of 2 plates
    if not 1 <= n <= most:
        raise ValueError(f"entities: {n} — must be 1..{most} "
                         f"(distinct logos{' outside the avoided worlds' if avoid else ''})")
    taken: set[str] = set()
    names = _unique(rng, _company, n + n_extra, taken)
    names, extra = names[:n], names[n:]
    founders = _unique(rng, _person, n, taken)
    cities = _unique(rng, _place, min(n_cities, max(2, n)), taken)
    # Distinct (shape, colour, plate) triples: each shape+colour pair is used once (random
    # plate) before any is used again (with the other plate).
    rng.shuffle(pairs)
    pairs = [p for p in pairs if p not in avoid]
    plates = list(PLATES)
    ents: list[Entity] = []
    for i, name in enumerate(names):
        shape, colour = pairs[i % len(pairs)]
        if i < len(pairs):
            plate = rng.choice(plates)
        else:
            plate = next(p for p in plates if p != ents[i - len(pairs)].logo.plate)
        ents.append(Entity(name=name, founder=founders[i], city=rng.choice(cities),
                           year=str(rng.randint(1900, 2019)),
                           logo=Logo(shape, colour, plate, name[0].upper())))
    return ents, cities, extra
