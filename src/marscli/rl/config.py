"""`marscli advantages`' options, each declared once (light: the CLI imports it for --help)."""

from __future__ import annotations

from dataclasses import dataclass

from marscli.options import option


@dataclass
class AdvantagesConfig:
    estimator: str = option(
        "bn-gspo", "Advantage estimator: bn-gspo (the paper's), grpo, dr-grpo or rloo.")
    minibatches: int = option(
        1, "Split whole groups into M seeded minibatches and normalise within each.")
    filter_zero_std: bool = option(False, "Drop groups whose rewards are all equal.")
    mask_truncated: bool = option(
        False, "Rows stopped by the turn limit or the token budget keep their reward in the "
               "group statistics but get advantage 0 and \"masked\": \"truncated\" (update "
               "trains nothing on them).")
    seed: int = option(0, "Seed of the minibatch shuffle.")
