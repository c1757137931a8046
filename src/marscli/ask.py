"""`marscli ask IMAGE QUESTION`: one trajectory, traced live, for a person at a terminal."""

from __future__ import annotations

import tempfile
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

from marscli.generate import CHECK_PIXELS, GenerationOptions, generate
from marscli.images import open_image
from marscli.protocol import read_system_prompt
from marscli.records import Prompt
from marscli.trace import LiveTrace


def ask(image: str, question: str, gen: GenerationOptions | None = None, *,
        crops_dir: str | None = None, live: bool = True, **fields: Any) -> dict:
    """Run the agent on one image and question; return the trajectory record. `fields`:
    `GenerationOptions` fields, set over `gen`."""
    gen = replace(gen or GenerationOptions(temperature=0.0), **fields)
    gen.check()
    img_path = Path(image).resolve()
    # fail fast on a bad image, before loading a model; a draft decode, as rollout checks
    open_image(img_path, max_pixels=CHECK_PIXELS)
    base_prompt = read_system_prompt(gen.system_prompt)
    # a fresh folder, made by the first crop: a run that fails before it leaves nothing behind
    media = Path(crops_dir or Path(tempfile.gettempdir()) / f"marscli-ask-{uuid.uuid4().hex[:12]}")
    prompt = Prompt(id="ask", question=question, images=[str(img_path)], answer=[],
                    base=img_path.parent)
    records: list[dict] = []
    generate([(prompt, 0)], gen, gen.tools(), output=None, system_prompt=base_prompt,
             label="ask", on_record=records.append, on_event=LiveTrace() if live else None,
             media=media, rel_to=media, progress=False)
    return records[0]
