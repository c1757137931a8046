"""`marscli ask IMAGE QUESTION`: one trajectory, traced live, for a person at a terminal."""

from __future__ import annotations

import tempfile
from pathlib import Path

from marscli.agent import Agent, AgentConfig
from marscli.engines import SamplingParams, make_engine
from marscli.images import open_image
from marscli.protocol import read_system_prompt
from marscli.records import Prompt
from marscli.rollout import CHECK_PIXELS
from marscli.tools import build_tools
from marscli.trace import LiveTrace


def ask(image: str, question: str, *, policy: str, engine: str = "hf", device: str = "cpu",
        max_turns: int = 10, max_new_tokens: int = 2048, temperature: float = 0.0,
        seed: int = 0, crops_dir: str | None = None, system_prompt_file: str | None = None,
        text_search: str | None = None, image_search: str | None = None,
        live: bool = True) -> dict:
    """Run the agent on one image and question; return the trajectory record."""
    img_path = Path(image).resolve()
    # fail fast on a bad image, before loading a model; a draft decode, as rollout checks
    open_image(img_path, max_pixels=CHECK_PIXELS)
    base_prompt = read_system_prompt(system_prompt_file)
    tools = build_tools(text_search=text_search, image_search=image_search)
    eng = make_engine(engine, policy, device=device)
    media = Path(crops_dir) if crops_dir else Path(tempfile.mkdtemp(prefix="marscli-ask-"))
    cfg = AgentConfig(max_turns=max_turns, max_turn_tokens=max_new_tokens,
                      system_prompt=base_prompt, batch_size=1,
                      sampling=SamplingParams(temperature=temperature, seed=seed))
    agent = Agent(eng, tools, cfg, media_dir=media, rel_to=media, policy_name=policy,
                  on_event=LiveTrace() if live else None)
    prompt = Prompt(id="ask", question=question, images=[str(img_path)], answer=[],
                    base=img_path.parent)
    return next(agent.run([(prompt, 0)]))
