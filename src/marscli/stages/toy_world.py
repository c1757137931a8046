"""`marscli toy-world OUT`: write the synthetic world (`toy.world.build_world`), then its sidecar
`OUT.meta.json` beside the folder and one line on stderr."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from marscli.records.provenance import stage_inputs
from marscli.records.sidecar import write_sidecar
from marscli.toy.prompts import KINDS
from marscli.toy.world import build_world, check_counts, parse_kinds, parse_seeds


@stage_inputs()
def main(out: str, entities: int = 24, seed: int = 0, train: int = 240, test: int = 60,
         sft: int = 120, size: int = 1024, grid: int = 8, kinds: str = ",".join(KINDS),
         zoom_cells: int = 1, perceive: int = 0, clutter: float = 1.0, direct: float = 0.0,
         avoid_seeds: str = "", avoid_entities: int | None = None, avoid_by: str = "pair",
         force: bool = False) -> dict:
    """Build the world into `out`; return its statistics. Every option is checked first."""
    started = time.time()
    check_counts(entities, train, test, sft, perceive, size)
    config = {"entities": entities, "train": train, "test": test, "sft": sft, "size": size,
              "grid": grid, "kinds": parse_kinds(kinds), "zoom_cells": zoom_cells,
              "perceive": perceive, "clutter": clutter, "direct": direct,
              "avoid": parse_seeds(avoid_seeds), "avoid_entities": avoid_entities,
              "avoid_by": avoid_by}
    stats = build_world(out, force=force, seed=seed, **config)
    write_sidecar(str(Path(out)), stage="toy-world", seed=seed, config=config, stats=stats,
                  started=started)
    print(f"wrote {out}: {stats['entities']} entities, {stats['train']} train, {stats['test']} "
          f"test and {stats['sft']} sft prompts, {stats['passages']} passages, "
          f"{stats['bytes'] / 1e6:.1f} MB in {stats['seconds']:.1f} s", file=sys.stderr)
    return stats
