"""`marscli toy-world OUT`: write the whole toy world, atomically and deterministically.

Every random choice comes from `random.Random` streams named after the seed and their purpose
(`"0:entities"`, `"0:scene:train:17"`), so one split's size never changes another split's
scenes, and the same seed gives byte-identical files (PNG carries no timestamp).
"""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path

import orjson

from marscli.errors import BadInput, check_range
from marscli.records.jsonl import dumps
from marscli.records.outputs import AtomicDir
from marscli.toy.corpus import make_corpus
from marscli.toy.entities import MAX_ENTITIES, Entity, make_entities, syllables
from marscli.toy.expert import DIRECT, DIRECT_SEARCH, expert_replies
from marscli.toy.perceive import SYSTEM, WHERE, logo_rows, perception_rows, zoomed_rows
from marscli.toy.prompts import ATTRS, KINDS, gold, plan, question, search_hits
from marscli.toy.render import LOGO_MAX, render_logo, render_scene

SPLITS = ("train", "test", "sft")
MIN_ENTITIES = 5  # an image-search list is the true logo + 4 distractors
MAX_ROWS = 1_000_000  # --train, --test, --sft, --perceive
MIN_SIZE, MAX_SIZE = 256, 8192  # --size: scene side in pixels
MIN_CELL = 32  # pixels per grid cell at least: smaller logos lose their letter
LOGO_SIDE = 128  # pixels of the logo files (search thumbnails)
PNG_LEVEL = 1  # fast; scenes are flat colour, about 30 KB each
AVOID_BY = ("pair", "logo")
MAX_REDRAWS = 1000  # --avoid-by logo: draws of the entities until none is an avoided logo


def _rng(seed: int, *purpose: object) -> random.Random:
    return random.Random(":".join(map(str, (seed, *purpose))))


def check_counts(entities: int, train: int, test: int, sft: int, perceive: int,
                 size: int) -> None:
    """The counts and the scene side in range (BadInput naming the option)."""
    check_range("--entities", entities, MIN_ENTITIES, MAX_ENTITIES)
    for name, n in (("--train", train), ("--test", test), ("--sft", sft),
                    ("--perceive", perceive)):
        check_range(name, n, 0, MAX_ROWS)
    check_range("--size", size, MIN_SIZE, MAX_SIZE)


def parse_kinds(kinds: str) -> tuple[str, ...]:
    """`--kinds perception,both` → the question kinds; BadInput for an unknown or none."""
    kind_list = tuple(k.strip() for k in kinds.split(",") if k.strip())
    bad = [k for k in kind_list if k not in KINDS]
    if bad or not kind_list:
        raise BadInput(f"--kinds {kinds!r}: choose from {', '.join(KINDS)} (comma-separated)")
    return kind_list


def check_seed(seed: int, option: str = "--seed") -> int:
    """A seed world.json and the sidecar can hold: a signed 64-bit integer (JSON writers
    refuse larger ones, after the whole world is drawn)."""
    if not -(1 << 63) <= seed < 1 << 63:
        raise BadInput(f"{option}: {seed} is out of range — a seed is a 64-bit integer, "
                       "-2**63 to 2**63 - 1")
    return seed


def parse_seeds(seeds: str) -> tuple[int, ...]:
    """`--avoid-seeds 0,1,2` → (0, 1, 2); BadInput for a part that is not an integer."""
    try:
        found = {int(x) for x in seeds.split(",") if x.strip()}
    except ValueError:
        raise BadInput(f"--avoid-seeds {seeds!r}: integers, comma-separated") from None
    return tuple(sorted(check_seed(x, "--avoid-seeds") for x in found))


def check_options(entities: int, train: int, test: int, sft: int, size: int, grid: int,
                  zoom_cells: int = 1, perceive: int = 0, clutter: float = 1.0,
                  direct: float = 0.0) -> None:
    check_counts(entities, train, test, sft, perceive, size)
    if train + test + sft == 0:
        raise BadInput("--train, --test and --sft are all 0 — ask for at least one prompt")
    if not 3 <= grid <= 32:
        raise BadInput(f"grid: {grid} is out of range — must be 3..32 (the logo must stay "
                       "under 5% of the scene)")
    if zoom_cells < 1 or grid % zoom_cells or zoom_cells == grid:
        raise BadInput(f"--zoom-cells: {zoom_cells} must divide the grid ({grid}) and be "
                       "smaller than it (the zoom box is a block of cells, not the scene)")
    if not 0.0 <= clutter <= 4.0:
        raise BadInput(f"--clutter: {clutter} is out of range — must be 0..4 (a multiple of "
                       "the default amount of clutter)")
    if not 0.0 <= direct <= 1.0:
        raise BadInput(f"--direct: {direct} is out of range — must be 0..1 (a share of the "
                       "cold-start perception rows)")
    if size // grid < MIN_CELL:
        raise BadInput(f"--size {size} with a {grid}x{grid} grid gives cells under "
                       f"{MIN_CELL} px — use --size >= {MIN_CELL * grid}")


def world_entities(seed: int, entities: int, avoid: tuple[int, ...] = (),
                   avoid_entities: int | None = None, avoid_by: str = "pair",
                   ) -> tuple[list[Entity], list[str], list[str]]:
    """The entities, cities and shop names of the world of `seed` (cheap: nothing is drawn),
    none of whose logos shares with a world of a seed in `avoid` (built with `avoid_entities`
    entities, default as many) a (shape, colour) pair (`avoid_by` "pair"), or is one of its
    logos whole (shape, colour, plate and letter: "logo"; every pair then still appears, with
    other letters or plates, so that reading them can be learned apart)."""
    if seed in avoid:
        raise BadInput(f"--avoid-seeds: {seed} is this world's own --seed")
    if avoid_by not in AVOID_BY:
        raise BadInput(f"--avoid-by {avoid_by!r}: choose from {', '.join(AVOID_BY)}")
    theirs = {e.logo for s in avoid for e in world_entities(s, avoid_entities or entities)[0]}
    pairs = frozenset((lg.shape, lg.colour) for lg in theirs) if avoid_by == "pair" else frozenset()
    n_extra = max(2, entities // 4)
    try:
        for attempt in range(MAX_REDRAWS):  # attempt 0 is the draw of a world that avoids none
            rng = _rng(seed, "entities", *([attempt] if attempt else []))
            drawn = make_entities(rng, entities, n_extra=n_extra, avoid=pairs)
            if avoid_by == "pair" or not theirs & {e.logo for e in drawn[0]}:
                return drawn
    except ValueError as e:
        raise BadInput(f"--entities: {e}") from None
    raise BadInput(f"--avoid-by logo: {MAX_REDRAWS} draws of {entities} entities each reused "
                   "a logo of the avoided worlds — use fewer --entities")


def name_free_text(text: str, names: list[str]) -> str:
    """`text` without the world's names, and every syllable names are made of (`syllables.txt`:
    the text a tokenizer for any world is trained on, `tiny-model --text`)."""
    cut = re.compile(r"\b(" + "|".join(map(re.escape, sorted(names, key=len, reverse=True)))
                     + r")\b", re.IGNORECASE)
    pieces = syllables()  # on lines of their own and after a space: both forms are tokens
    return cut.sub("", text) + "\n".join(pieces) + "\n" + " ".join(pieces) + "\n"


def max_logo_area(grid: int) -> float:
    """The largest fraction of a scene a logo can cover."""
    return (LOGO_MAX / grid) ** 2


def _check_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise BadInput(f"{out}: exists and is not a folder — choose another OUT")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise BadInput(f"{out}: folder exists and is not empty — pass --force to replace it")


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_bytes(b"".join(dumps(r) for r in rows))


def _split_rows(split: str, n: int, seed: int, ents: list[Entity], tmp: Path, size: int,
                grid: int, kinds: tuple[str, ...] = KINDS, zoom_cells: int = 1,
                clutter: float = 1.0, direct: float = 0.0) -> list[dict]:
    rows = []
    planned = plan(_rng(seed, "plan", split), n, len(ents), kinds)
    no_tool = set()
    # exactly round(direct x count) of each kind's rows of each attribute, a keyed RNG each: a
    # draw over the whole kind once left 2 of 27 colour rows zoomed (demo world 0), and the cold
    # start then never zoomed for the attribute the base model reads best (docs/notes/demo-log.md,
    # lever ad)
    for kind in kinds:
        for attr in ATTRS[kind]:
            of = [i for i, (k, a, _) in enumerate(planned) if (k, a) == (kind, attr)]
            rng = _rng(seed, "direct", split, kind, attr)
            no_tool.update(rng.sample(of, round(direct * len(of))))
    for i, (kind, attr, k) in enumerate(planned):
        e = ents[k]
        rid = f"{split}-{i:04d}"
        im, logo_box, zoom_box = render_scene(_rng(seed, "scene", split, i), e.logo, size, grid,
                                               zoom_cells, clutter)
        rel = f"images/{rid}.png"
        im.save(tmp / rel, format="PNG", compress_level=PNG_LEVEL)
        hits = search_hits(_rng(seed, "hits", split, i), ents, k)
        rank = hits.index(k) + 1
        row = {"v": 1, "id": rid, "image": rel, "question": question(kind, attr, e),
               "answer": [gold(e, attr)], "category": kind,
               "image_search": [{"title": ents[h].name, "thumbnail": f"logos/{ents[h].slug}.png"}
                                for h in hits],
               "toy": {"entity": e.name, "attribute": attr, "logo_box": logo_box,
                       "size": size, "zoom_box": zoom_box, "hit": rank}}
        if split == "sft":
            # a search fact: another company's, never this one; a logo's attribute: any logo's
            # of the world, drawn blind (the answers' marginal). Neither teaches the world.
            wrong = [x for x in ents if gold(x, attr) != gold(e, attr)] or ents
            guess = _rng(seed, "guess", split, i).choice(ents if kind == "perception" else wrong)
            row["replies"] = expert_replies(kind, attr, e, zoom_box, rank, i in no_tool, guess)
        rows.append(row)
    return rows


def _vocab(corpus: list[dict], splits: dict[str, list[dict]], ents: list[Entity],
           extra: list[str]) -> str:
    """All the world's text, for `marscli tiny-model --text`: the system prompt and tool
    schemas, the corpus, every question, answer and expert reply, and the tool observations'
    fixed phrases."""
    from marscli.agent.protocol import system_prompt
    from marscli.tools import TOOLS

    schemas = [TOOLS.get(n).schema for n in
               ("image_zoom_in_tool", "text_search_tool", "image_search_tool")]
    lines = [system_prompt(schemas)]
    lines += [f"{r['title']}\n{r['text']}" for r in corpus]
    lines.append("Reverse image search results:\n" + "\n".join(
        f"[{i}] {e.name}" for i, e in enumerate(ents, 1)))
    lines.append("Zoomed in on image 0 (logo): image 1 is the region [0, 0, 125, 125].")
    lines += extra
    for rows in splits.values():
        for r in rows:
            lines.append(r["question"])
            lines += r["answer"]
            if "replies" in r:
                lines += r["replies"]
            else:  # the expert's words for train and test rows too
                toy = r["toy"]
                e = next(x for x in ents if x.name == toy["entity"])
                lines += expert_replies(r["category"], toy["attribute"], e, toy["zoom_box"],
                                        toy["hit"])
    return "\n".join(lines) + "\n"


def _write_logos(tmp: Path, ents: list[Entity]) -> None:
    """Each entity's logo file (the search thumbnails) and `logos.jsonl`, the rows
    `marscli index images` reads; also makes `images/` for the splits' scenes."""
    (tmp / "logos").mkdir()
    (tmp / "images").mkdir()
    for e in ents:
        render_logo(e.logo, LOGO_SIDE).save(tmp / "logos" / f"{e.slug}.png", format="PNG",
                                            compress_level=PNG_LEVEL)
    _write_jsonl(tmp / "logos.jsonl",
                 [{"path": f"logos/{e.slug}.png", "title": e.name} for e in ents])


def _write_perception(tmp: Path, perceive: int, seed: int, ents: list[Entity], size: int,
                      grid: int, zoom_cells: int, clutter: float) -> None:
    """`perceive*.jsonl`, the perception pre-training rows, on scenes of their own (keyed RNG:
    the other splits stay as they were)."""
    scenes = _split_rows("perceive", perceive, seed, ents, tmp, size, grid,
                         ("perception",), zoom_cells, clutter)
    _write_jsonl(tmp / "perceive.jsonl", perception_rows(scenes, tmp, PNG_LEVEL))
    if zoom_cells > 1:
        _write_jsonl(tmp / "perceive-zoomed.jsonl", zoomed_rows(scenes, zoom_cells))
    _write_jsonl(tmp / "perceive-logos.jsonl", logo_rows(ents))


def _vocab_extra(kinds: tuple[str, ...], perceive: int, direct: float) -> list[str]:
    """The fixed phrases vocab.txt needs beyond the splits' questions and replies: the blind
    expert's thinking lines (`direct`) and the perception rows' prompts (`perceive`)."""
    searches = direct and set(kinds) - {"perception"}
    return (([DIRECT] if direct else []) + ([DIRECT_SEARCH] if searches else [])
            + ([SYSTEM, WHERE] if perceive else []))


def build_world(out: str | Path, entities: int = 24, seed: int = 0, train: int = 240,
                test: int = 60, sft: int = 120, size: int = 1024, grid: int = 8,
                kinds: tuple[str, ...] = KINDS, zoom_cells: int = 1, perceive: int = 0,
                clutter: float = 1.0, direct: float = 0.0, avoid: tuple[int, ...] = (),
                avoid_entities: int | None = None, avoid_by: str = "pair",
                force: bool = False) -> dict:
    """Write the toy world to folder `out` (see the README it writes); return statistics.

    Built in `OUT.tmp-PID` and renamed onto `out`; a non-empty `out` is refused unless `force`.
    `avoid`: seeds of worlds (of `avoid_entities` entities, default as many) whose logos this
    one must not reuse, by (shape, colour) pair or whole logo (`avoid_by`, `world_entities`).
    """
    check_options(entities, train, test, sft, size, grid, zoom_cells, perceive, clutter, direct)
    check_seed(seed)
    # checks avoid and avoid_by
    ents, cities, shops = world_entities(seed, entities, avoid, avoid_entities, avoid_by)
    out = Path(out)
    t0 = time.perf_counter()
    _check_out(out, force)
    with AtomicDir(out) as ad:  # --force: the old world goes only once the new one is in place
        tmp = ad.tmp
        _write_logos(tmp, ents)
        corpus = make_corpus(_rng(seed, "corpus"), ents, shops, cities)
        _write_jsonl(tmp / "corpus.jsonl", corpus)
        counts = {"train": train, "test": test, "sft": sft}
        splits = {s: _split_rows(s, counts[s], seed, ents, tmp, size, grid, kinds, zoom_cells,
                                 clutter, direct if s == "sft" else 0.0) for s in SPLITS}
        for s, rows in splits.items():
            _write_jsonl(tmp / f"{s}.jsonl", rows)
        if perceive:
            _write_perception(tmp, perceive, seed, ents, size, grid, zoom_cells, clutter)
        text = _vocab(corpus, splits, ents, _vocab_extra(kinds, perceive, direct))
        (tmp / "vocab.txt").write_text(text, encoding="utf-8")
        names = [e.name for e in ents] + [e.founder for e in ents] + cities + shops
        (tmp / "syllables.txt").write_text(name_free_text(text, names), encoding="utf-8")
        world = {"v": 1, "seed": seed, "size": size, "grid": grid, "clutter": clutter,
                 "direct": direct,
                 "avoid": {"seeds": list(avoid), "entities": avoid_entities or entities,
                           "by": avoid_by},
                 "cities": cities, "shops": shops, "entities": [e.to_dict() for e in ents],
                 "splits": counts}
        (tmp / "world.json").write_bytes(orjson.dumps(world, option=orjson.OPT_INDENT_2) + b"\n")
        stats = {"entities": entities, **counts, "perceive": perceive,
                 "images": train + test + sft + 2 * perceive,
                 "passages": len(corpus), "max_logo_area": max_logo_area(grid)}
        (tmp / "README.md").write_text(readme(world, stats), encoding="utf-8")
        stats["bytes"] = sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file())
    stats["seconds"] = round(time.perf_counter() - t0, 2)
    return stats


def _files_table(stats: dict) -> str:
    """The README's table of the world's files, with the counts this world has of each."""
    return f"""## Files
| path | what |
|---|---|
| `world.json` | entities and their attributes, cities, distractor shop names, options |
| `logos/<name>.png`, `logos.jsonl` | one {LOGO_SIDE}px logo per entity; rows `{{path, title}}` \
for `marscli index images` |
| `images/<split>-NNNN.png` | one scene per prompt row (splits never share a scene) |
| `corpus.jsonl` | {stats['passages']} passages `{{id, title, text}}` for `marscli index text` |
| `train.jsonl`, `test.jsonl` | {stats['train']} and {stats['test']} prompt rows \
(marscli form, gold answers) |
| `sft.jsonl` | {stats['sft']} prompt rows with `replies`: the expert's turns, \
for `--engine replay` |
| `perceive.jsonl` | {2 * stats['perceive']} message rows of perception pre-training (read the \
crop, ground the logo) on scenes of their own, for `marscli sft` |
| `perceive-zoomed.jsonl` | with `--zoom-cells` 2 or more: {stats['perceive']} rows of \
grounding at the zoom's scale (the crop → the logo's cell in it) |
| `perceive-logos.jsonl` | with `--perceive`: {3 * stats['entities']} rows of reading at the \
logo's own scale (each logo file, each perception question) |
| `vocab.txt` | all the world's text, for `marscli tiny-model --text` |
| `syllables.txt` | the same without the world's names, and the syllables names are made of: \
a tokenizer for any world (`tiny-model --text`) |
"""


def readme(world: dict, stats: dict) -> str:
    ents = world["entities"]
    e = ents[0]
    example = json.dumps({k: e[k] for k in ("name", "founder", "city", "year", "logo")})
    return f"""# Toy world (marscli toy-world, seed {world['seed']})

A small synthetic, offline replica of the SenseNova-MARS task family, sized for a tiny model
trained on CPU. {stats['entities']} made-up companies, each with a founder, a city, a founding
year and a logo; {world['size']}x{world['size']} cluttered scenes with one logo drawn small
(at most {stats['max_logo_area']:.2%} of the area) in one cell of the \
{world['grid']}x{world['grid']} grid; a text corpus
about the companies; prompts of three kinds and scripted expert replies.

Example entity: `{example}`

{_files_table(stats)}
Prompt rows: `{{v, id, image, question, answer, category, image_search, toy}}`. `category` is
`perception` (shape colour, shape or letter of the logo: zoom, answer), `knowledge` (city,
founder or year of a company the question names: text search, answer) or `both` (the same of
the logo's company: image search, text search, answer; the image-search list's other logos
differ from the true one in colour and shape). `image_search` is the precomputed top-5 for
`--image-search data` (the true logo at a seeded rank); `toy` holds the entity, the attribute,
the logo's box in pixels (of the `size`-pixel scene), the expert's zoom box (0..1000, the logo's
grid cell or block of cells) and the true result's rank.

All answers are single words of the corpus: a city, a surname, a year, a colour, a shape, a
capital letter. The scene clutter is muted (saturation <= 0.35); logo colours are saturated.

## Use
WORLD is this folder.
```
marscli tiny-model ckpt --text WORLD/vocab.txt
marscli index text WORLD/corpus.jsonl -o WORLD/text.sqlite
# the agent's tools: --text-search local:WORLD/text.sqlite --image-search data
# cold start: replay sft.jsonl with --engine replay, then sft; then RL on train.jsonl,
# evaluation on test.jsonl.
```
`--image-search local:INDEX` (perceptual hashes of the whole input image) does not find a logo
this small in a scene; use `data`.
"""

