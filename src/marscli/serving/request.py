"""A `POST /generate` body made into the engine's request: token ids checked against the
vocabulary, one image per placeholder run, the images read only from the allowed folders and
decoded as the agent decodes them (`open_image`, then the processor's `model_image`) within the
pixel budget, so the server sees the pixels the client's placeholder counts came from."""

from __future__ import annotations

import base64
import binascii
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from marscli.engines import GenRequest, SamplingParams
from marscli.errors import BadInput
from marscli.serving.guard import NOT_ALLOWED, Folders, HttpFailure, PixelBudget, header_pixels


@dataclass
class _Image:
    image: Any  # the PIL picture the vllm engine sends (ImageFeatures.image)


def parse(engine: Any, body: Any, folders: Folders, budget: PixelBudget
          ) -> tuple[GenRequest, SamplingParams]:
    """A /generate body as the engine's request and sampling parameters, its images read from
    `folders` and decoded within `budget`; HttpFailure 400 (413, 503: the budget) otherwise."""
    from marscli.qwen.tokens import model_image

    if not isinstance(body, dict):
        raise HttpFailure(400, "expected a JSON object")
    tokens = body.get("tokens")
    if not (isinstance(tokens, list) and tokens and all(type(t) is int for t in tokens)):
        raise HttpFailure(400, "tokens: expected a non-empty list of integers")
    vocab = len(engine.processor.tokenizer)
    if any(t >= vocab for t in tokens):
        raise HttpFailure(400, f"tokens: an id over the vocabulary ({vocab})")
    images = body.get("images") or []
    if not isinstance(images, list) or sum(t < 0 for t in tokens) != len(images):
        raise HttpFailure(400, "images: one per negative (placeholder run) id in tokens")
    with tempfile.TemporaryDirectory(prefix="marscli-serve-") as tmp:
        files = [image_file(folders, spec, i, Path(tmp)) for i, spec in enumerate(images)]
        pixels = sum(header_pixels(f, i) for i, f in enumerate(files))
        with budget.hold(pixels):  # decoded and brought to the model's size in it
            pictures = [_Image(model_image(engine.processor, decode(f, i)))
                        for i, f in enumerate(files)]
    try:
        params = SamplingParams(
            temperature=float(body.get("temperature", 1.0)),
            top_p=float(body.get("top_p", 1.0)), top_k=int(body.get("top_k", 0)),
            presence_penalty=float(body.get("presence_penalty", 0.0)),
            max_new_tokens=int(body.get("max_new_tokens", 1024)),
            seed=int(body.get("seed", 0)))
        key, turn = str(body.get("key", "")), int(body.get("turn", 0))
    except (TypeError, ValueError) as e:
        raise HttpFailure(400, f"sampling options: {e}") from None
    if params.max_new_tokens < 1 or params.temperature < 0 or not 0 < params.top_p <= 1:
        raise HttpFailure(400, "max_new_tokens >= 1, temperature >= 0, 0 < top_p <= 1")
    return GenRequest(tokens, pictures, params.max_new_tokens, key=key, turn=turn), params


def image_file(folders: Folders, spec: Any, i: int, tmp: Path) -> Path:
    """The file of `images[i]`: an allowed path, or base64 bytes written under `tmp`."""
    if isinstance(spec, dict) and isinstance(spec.get("path"), str):
        return folders.image(spec["path"], i)
    if isinstance(spec, dict) and isinstance(spec.get("b64"), str):
        try:
            data = base64.b64decode(spec["b64"], validate=True)
        except (ValueError, binascii.Error):
            raise HttpFailure(400, f"images[{i}]: b64: not base64") from None
        f = tmp / f"{i}.img"
        f.write_bytes(data)
        return f
    raise HttpFailure(400, f'images[{i}]: expected {{"path": FILE}} or {{"b64": DATA}}')


def decode(f: Path, i: int) -> Any:
    """The picture in `f`, opened as the agent opens one; the generic refusal otherwise."""
    from marscli.qwen.images import MAX_SOURCE_PIXELS, open_image

    try:
        return open_image(f, max_pixels=MAX_SOURCE_PIXELS)
    except BadInput as e:
        print(f"serve: refused images[{i}]: {e}", file=sys.stderr)
        raise HttpFailure(400, f"images[{i}]: {NOT_ALLOWED}") from None
