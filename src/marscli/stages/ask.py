"""`marscli ask IMAGE QUESTION`: one trajectory, traced live, for a person at a terminal.

- The image is checked (a draft decode; a URL, or an aspect ratio the processor refuses, is
  one line, exit 2) and a hub policy is checked before any model loads: a
  hub id that is not in the local Hugging Face cache needs the hub, which is probed for at most
  `HUB_PROBE_S` seconds (`qwen/hub.py`; `HF_ENDPOINT` respected), so an offline machine fails
  in seconds with one line instead of minutes of download retries. `HF_HUB_OFFLINE=1` skips
  the probe.
- The live trace (`trace.LiveTrace`) starts with a header (image and its size, question,
  policy, engine, device) printed before the model loads.
- Image paths in the returned record are absolute, or relative to `rel_to` (the folder of the
  file the caller writes the record into): the crops folder is often a temporary one, and a
  record whose paths are relative to it shows no images anywhere else.
- `--engine replay --replies FILE` (a JSON list, one string per assistant turn) replays a
  scripted expert through the real agent loop and tools: `make ask-demo`'s zoom, crop and
  answer, in seconds on a CPU. The replies go into the prompt row, where the engine reads them.
"""

from __future__ import annotations

import os
import sys
import tempfile
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

from marscli.agent.generation import GenerationOptions
from marscli.agent.protocol import read_system_prompt
from marscli.agent.runner import CHECK_PIXELS, generate
from marscli.errors import BadInput
from marscli.qwen.hub import check_hub_policy
from marscli.qwen.images import open_image
from marscli.records.jsonl import dumps
from marscli.records.provenance import stage_inputs
from marscli.records.schema import Prompt
from marscli.view.trace import LiveTrace

_LOCAL_ENGINES = ("hf", "vllm", "replay")  # the engines that load --policy themselves


@stage_inputs()
def ask(image: str, question: str, gen: GenerationOptions | None = None, *,
        crops_dir: str | None = None, live: bool = True, rel_to: str | Path | None = None,
        replies: list[str] | None = None, trace: LiveTrace | None = None,
        **fields: Any) -> dict:
    """Run the agent on one image and question; return the trajectory record. `fields`:
    `GenerationOptions` fields, set over `gen`; `trace`: the live renderer (a default one on
    stderr when `live`)."""
    gen = replace(gen or GenerationOptions(temperature=0.0), **fields)
    gen.check()
    if gen.engine == "replay" and not replies:
        raise BadInput("--replies: required with --engine replay — a JSON list of the "
                       "assistant's turns (scripts/demo_image.py --replies writes one)")
    if replies and gen.engine != "replay":
        raise BadInput(f"--replies: scripted turns are for --engine replay, not {gen.engine} — "
                       "add --engine replay or leave --replies out")
    if image.lower().startswith(("http://", "https://")):
        raise BadInput(f"{image}: URLs are not supported: download the image first")
    img_path = Path(image).resolve()
    # fail fast on a bad image, before loading a model; a draft decode, as rollout checks
    size = open_image(img_path, max_pixels=CHECK_PIXELS, for_model=True).size
    base_prompt = read_system_prompt(gen.system_prompt)
    if gen.engine in _LOCAL_ENGINES and gen.policy is not None:
        check_hub_policy(gen.policy)
    # a fresh folder, made by the first crop: a run that fails before it leaves nothing behind
    media = Path(crops_dir or Path(tempfile.gettempdir()) / f"marscli-ask-{uuid.uuid4().hex[:12]}")
    prompt = Prompt(id="ask", question=question, images=[str(img_path)], answer=[],
                    base=img_path.parent, extra={"replies": replies} if replies else {})
    if live and trace is None:
        trace = LiveTrace()
    if trace is not None:
        trace.header(str(image), _true_size(img_path, size), question, gen.policy_name,
                     gen.engine, _device(gen))
    records: list[dict] = []
    generate([(prompt, 0)], gen, gen.tools(), output=None, system_prompt=base_prompt,
             label="ask", on_record=records.append, on_event=trace, media=media,
             rel_to=media, progress=False)
    return rebase_images(records[0], media, rel_to)


def main(image: str, question: str, gen: GenerationOptions, *, crops_dir: str | None = None,
         replies: str | None = None, as_json: bool = False) -> dict:
    """`marscli ask`: the live trace on stderr and the answer on stdout, or (`as_json`) no
    trace and the record on stdout; `replies`: the `--replies FILE` to replay."""
    scripted = load_replies(replies) if replies is not None else None
    rec = ask(image, question, gen, crops_dir=crops_dir, live=not as_json, replies=scripted)
    if as_json:
        sys.stdout.buffer.write(dumps(rec))
    else:
        print(rec["final_answer"] if rec["final_answer"] is not None else "")
    return rec


def load_replies(path: str) -> list[str]:
    """`--replies FILE`: a JSON list of strings, one per assistant turn (BadInput naming the
    file otherwise)."""
    import json

    try:
        replies = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BadInput(f"--replies: {path}: no such file") from None
    except (OSError, ValueError) as e:
        raise BadInput(f"--replies: {path}: not a JSON file ({e})") from None
    if not (isinstance(replies, list) and replies and all(isinstance(r, str) for r in replies)):
        raise BadInput(f"--replies: {path}: expected a non-empty JSON list of strings (one "
                       "per assistant turn)")
    return replies


def _true_size(path: Path, draft: tuple[int, int]) -> tuple[int, int]:
    """The image's size in pixels from its header (the draft decode may be smaller)."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            return im.size
    except OSError:
        return draft


def _device(gen: GenerationOptions) -> str:
    """The device the engine will run on (`auto` resolved), or "-" for one that runs remotely
    or needs none."""
    if gen.engine not in ("hf", "vllm"):
        return "-"
    from marscli.engines import resolve_device

    return resolve_device(gen.device)


def rebase_images(rec: dict, media: Path, rel_to: str | Path | None) -> dict:
    """`rec`'s image paths, relative to `media` as the agent wrote them, made absolute (or
    relative to `rel_to`)."""
    base = media.resolve()
    for ref in rec["images"]:
        p = Path(ref["path"])
        full = p if p.is_absolute() else Path(os.path.normpath(base / p))
        ref["path"] = str(full) if rel_to is None else os.path.relpath(full, Path(rel_to).resolve())
    return rec
