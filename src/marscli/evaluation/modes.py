"""`--mode agent|direct`: what each mode asks of the generation options, and the direct
mode's system prompt."""

from __future__ import annotations

from dataclasses import replace

from marscli.agent.generation import GenerationOptions
from marscli.errors import BadInput

MODES = ("agent", "direct")
DIRECT_PROMPT = """You answer questions about images. Look at the image carefully, reason \
briefly inside <thinking>...</thinking>, then give the final answer inside \
<answer>...</answer>: a short answer (a name, a number, a few words), or the option's letter \
for a multiple-choice question. You have no tools; answer in this one reply."""


def for_mode(gen: GenerationOptions, mode: str) -> GenerationOptions:
    """`--mode direct`: no tools, one turn (refusing options that say otherwise); `agent`: the
    tool loop, 10 turns unless told."""
    if mode == "agent":
        return replace(gen, max_turns=10 if gen.max_turns is None else gen.max_turns)
    for opt, val in (("--text-search", gen.text_search), ("--image-search", gen.image_search)):
        if val:
            raise BadInput(f"{opt}: not used with --mode direct (no tools) — drop it, "
                           "or use --mode agent")
    if gen.max_turns not in (None, 1):
        raise BadInput(f"--max-turns {gen.max_turns}: --mode direct answers in one turn")
    return replace(gen, max_turns=1)
