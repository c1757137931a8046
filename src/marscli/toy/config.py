"""`marscli toy-world`'s and `marscli summary`'s options, each declared once (light: the CLI
imports it for --help)."""

from __future__ import annotations

from dataclasses import dataclass

from marscli.options import option


@dataclass
class WorldConfig:
    entities: int = option(24, "Made-up companies (5..96), each with a logo.")
    seed: int = option(0, "Seed of everything (same seed, same bytes).")
    train: int = option(240, "Prompt rows in train.jsonl.")
    test: int = option(60, "Prompt rows in test.jsonl (new scenes).")
    sft: int = option(120, "Rows with scripted expert replies in sft.jsonl.")
    size: int = option(1024, "Scene side in pixels.")
    grid: int = option(
        8, "Logos sit in one cell of a GRID x GRID layout; the expert zooms on that cell.")
    zoom_cells: int = option(
        1, "The expert's zoom box spans this many cells per side (a block aligned to multiples "
           "of it, holding the logo's cell): 2 on a 4x4 grid zooms on a quadrant.")
    kinds: str = option(
        "perception,knowledge,both", "Question kinds, comma-separated: perception, knowledge, "
                                     "both.")
    perceive: int = option(
        0, "Scenes of perception pre-training in perceive.jsonl (two message rows each: read "
           "the logo's crop, give the logo's box), for a random model to learn to see before the "
           "cold start; with --zoom-cells 2 or more also perceive-zoomed.jsonl (where the logo "
           "is in the crop).")
    clutter: float = option(
        1.0, "Amount of muted clutter in the scenes, as a multiple of the default (0: the "
             "background gradient alone).")
    direct: float = option(
        0.0, "Share of the cold-start (sft) rows of each kind and attribute whose expert answers "
             "without a tool, blind (some logo's value, another company's fact): a teacher that "
             "under-uses the tools, for RL to learn when to use them.")
    avoid_seeds: str = option(
        "", "Seeds of worlds (of --avoid-entities entities) whose logos this world must not "
            "reuse, comma-separated: a pre-training world disjoint from the demo's.")
    avoid_entities: int | None = option(
        None, "Entities of the --avoid-seeds worlds (default: --entities).")
    avoid_by: str = option(
        "pair", "What of the --avoid-seeds worlds' logos is not reused: 'pair' (their shape and "
                "colour together) or 'logo' (the whole logo: shape, colour, plate and letter; "
                "their pairs appear with other letters or plates).")
    force: bool = option(False, "Replace a non-empty OUT.")


@dataclass
class SummaryConfig:
    """`marscli summary RUN...`'s options."""

    iters: int = option(..., "RL iterations: checkpoints 0..ITERS.")
    seeds: int = option(1, "RL seeds averaged: RUN, RUN-seed1, ...")
    plot_path: str | None = option(
        None, "Also plot accuracy ± 95% CI per iteration to this PNG.", decls=("--plot",),
        metavar="PNG")
