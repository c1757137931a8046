"""Token-exact conversation assembly, shared by rollout (building prompts turn by turn) and by
update/sft (rebuilding the training batch from a trajectory's segments).

The layout is the chat template's, byte for byte: `<|im_start|>{role}\\n{content}<|im_end|>\\n`,
images as `<|vision_start|><|image_pad|>*n<|vision_end|>`. `encode_parts` encodes the text
between two images in one piece, so every boundary falls on a special token and the pieces give
exactly the ids of encoding the whole rendered conversation (checked against the processor on
the tiny and the real Qwen vocabulary in tests/agent/test_agent.py and
tests/qwen/test_template_render.py).
A model segment is kept as the engine generated it; segments start and end at special tokens
(or the `\\n` after `<|im_end|>`, which is followed by `<|im_start|>`), so they concatenate
without re-tokenising across a boundary.

Image placeholders are stored compactly: a negative id -n stands for n `<|image_pad|>` tokens.

`StreamDecoder` turns a reply's tokens into text pieces as they are generated (`ask`'s live
trace), multi-byte characters held back until complete.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

IMAGE_MARK = "<image>"  # where an image sits in a text (questions, tool results, messages)


@dataclass(frozen=True)
class SpecialIds:
    im_start: int
    im_end: int
    pad: int
    image_pad: int
    video_pad: int
    vision_start: int
    vision_end: int

    @property
    def vision(self) -> tuple[int, ...]:
        """Ids the sampler must never emit: a sampled placeholder breaks the next forward."""
        return (self.image_pad, self.video_pad, self.vision_start, self.vision_end)


def never_sampled(ids: SpecialIds, named: int, vocab_size: int | None) -> list[int]:
    """Ids the sampler must never emit: the vision placeholders, and the embedding rows past
    the tokenizer's last token (`named` = len(tokenizer)). Qwen3-VL pads its 151,669 names to
    151,936 rows; a random model samples those rows, and they decode to nothing."""
    return [*ids.vision, *range(named, max(named, vocab_size or 0))]


def special_ids(tokenizer: Any) -> SpecialIds:
    get = tokenizer.convert_tokens_to_ids
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else get("<|endoftext|>")
    return SpecialIds(im_start=get("<|im_start|>"), im_end=get("<|im_end|>"), pad=pad,
                      image_pad=get("<|image_pad|>"), video_pad=get("<|video_pad|>"),
                      vision_start=get("<|vision_start|>"), vision_end=get("<|vision_end|>"))


def encode_parts(tokenizer: Any, ids: SpecialIds, parts: Sequence[str | int]) -> list[int]:
    """Encode text pieces and images (an int n: an image of n placeholder tokens), compact.
    Adjacent text pieces are encoded together: `<tool_response>\n` and a response that starts
    with whitespace are one token on Qwen's vocabulary (`\n  \n`), as in the whole text."""
    out: list[int] = []
    text = ""
    for p in parts:
        if isinstance(p, int):
            if text:
                out += tokenizer.encode(text, add_special_tokens=False)
            text = ""
            out += [ids.vision_start, -p, ids.vision_end]
        else:
            text += p
    if text:
        out += tokenizer.encode(text, add_special_tokens=False)
    return out


def split_images(text: str, counts: Sequence[int]) -> list[str | int]:
    """`a<image>b` with counts [n] → ["a", n, "b"]; images without a marker go last."""
    pieces = text.split(IMAGE_MARK)
    if len(pieces) - 1 > len(counts):
        raise ValueError(f"{len(pieces) - 1} {IMAGE_MARK} markers for {len(counts)} images")
    parts: list[str | int] = [pieces[0]]
    for i, piece in enumerate(pieces[1:]):
        parts += [counts[i], piece]
    parts += list(counts[len(pieces) - 1:])
    return parts


def marked_parts(text: str, n_images: int) -> list[dict] | None:
    """Chat-template content of a text with `<image>` markers, as verl builds it: one
    `{"type": "image"}` per marker, the text pieces between (empty ones dropped), images
    without a marker after the text; None when there are more markers than images."""
    pieces = text.split(IMAGE_MARK)
    if len(pieces) - 1 > n_images:
        return None
    parts: list[dict] = []
    for i, piece in enumerate(pieces):
        if i:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts + [{"type": "image"}] * (n_images - (len(pieces) - 1))


def prompt_parts(system: str, question: str, image_counts: Sequence[int]) -> list[str | int]:
    """System turn, the user's question with its images (first, unless marked), and the
    assistant header the model continues from."""
    q = question if IMAGE_MARK in question else IMAGE_MARK * len(image_counts) + question
    return [f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n",
            *split_images(q, image_counts), "<|im_end|>\n<|im_start|>assistant\n"]


def tool_parts(text: str, image_counts: Sequence[int], model_closed: bool) -> list[str | int]:
    """A tool response as the next user turn, then the assistant header. When the model's turn
    was cut before `<|im_end|>`, the tool segment closes it (masked out: not the model's)."""
    head = ("" if model_closed else "<|im_end|>") + "\n<|im_start|>user\n<tool_response>\n"
    return [head, *split_images(text, image_counts),
            "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"]


def expand(tokens: Sequence[int], image_pad: int) -> list[int]:
    """Compact ids → model ids (each -n becomes n image placeholders)."""
    out: list[int] = []
    for t in tokens:
        if t < 0:
            out.extend([image_pad] * -t)
        else:
            out.append(t)
    return out


def compact(tokens: Sequence[int], image_pad: int) -> list[int]:
    """Model ids → compact ids (runs of image placeholders become -n)."""
    out: list[int] = []
    for t in tokens:
        if t == image_pad:
            if out and out[-1] < 0:
                out[-1] -= 1
            else:
                out.append(-1)
        else:
            out.append(t)
    return out


def image_token_count(grid_thw: Sequence[int], merge_size: int) -> int:
    t, h, w = grid_thw
    return int(t * h * w) // (merge_size * merge_size)


@dataclass
class ImageFeatures:
    """What the model consumes for one image: patches, grid, and the placeholder count."""

    pixel_values: Any  # torch.Tensor [patches, dim]
    grid_thw: Any  # torch.Tensor [3]
    n_tokens: int
    image: Any = None  # the PIL image itself (engines that run their own processor, e.g. vLLM)


def _size(ip: Any, key: str) -> int | None:
    size = getattr(ip, "size", None)
    v = getattr(size, key, None) if size is not None and not isinstance(size, dict) else (
        (size or {}).get(key))
    return int(v) if v else None


def model_image(processor: Any, image: Any) -> Any:
    """The image as the processor will see it. A source over the processor's pixel budget
    (`size.longest_edge`, Qwen's max_pixels) is downscaled here, once, with PIL, to exactly
    the size the processor's own smart resize would pick (so the placeholder count is the
    same); the processor then has nothing left to resize. Otherwise a 48 MP photo would go
    through the processor's float pipeline at full size for every trajectory and every
    training forward. Rollout, update and sft all get pixels through `image_features`, so
    they see the same ones."""
    from marscli.qwen.images import smart_resize

    ip = processor.image_processor
    max_px, min_px = _size(ip, "longest_edge"), _size(ip, "shortest_edge")
    if not max_px or image.width * image.height <= max_px:
        return image
    factor = int(getattr(ip, "patch_size", 14)) * int(getattr(ip, "merge_size", 2))
    lo = min_px or factor * factor
    h, w = smart_resize(image.height, image.width, factor, lo, max_px)
    if smart_resize(h, w, factor, lo, max_px) != (h, w):
        # The processor would resize that size again: scaled down to max_pixels, an image of
        # another aspect ratio can fall under min_pixels (they are equal in the tiny recipes)
        # and be scaled up (a 1024x512 crop: 64x160, then 96x224, 21 tokens instead of 10).
        # The processor resizes the source itself then, once, as it does everywhere else.
        return image
    from PIL import Image

    return image.resize((w, h), Image.BICUBIC, reducing_gap=3.0)


def image_features(processor: Any, image: Any) -> ImageFeatures:
    """Run the policy's image processor on one PIL image (through `model_image`)."""
    image = model_image(processor, image)
    out = processor.image_processor(images=[image], return_tensors="pt")
    grid = out["image_grid_thw"][0]
    merge = getattr(processor.image_processor, "merge_size", 2)
    return ImageFeatures(out["pixel_values"], grid, image_token_count(grid.tolist(), merge), image)


@dataclass
class Sequence_:
    """One trajectory assembled for a training forward."""

    input_ids: list[int]  # expanded
    loss_mask: list[int]  # 1 on model tokens
    model_logprobs: list[float | None]  # engine log-probs aligned to input_ids (None off-mask)


def assemble(segments: Sequence[Any], image_pad: int) -> Sequence_:
    """Concatenate segments token-exactly; the loss mask is 1 on `model` segments only."""
    ids: list[int] = []
    mask: list[int] = []
    lps: list[float | None] = []
    for s in segments:
        role = s.role if hasattr(s, "role") else s["role"]
        toks = expand(s.tokens if hasattr(s, "tokens") else s["tokens"], image_pad)
        ids += toks
        is_model = role == "model"
        mask += [1 if is_model else 0] * len(toks)
        seg_lp = (s.logprobs if hasattr(s, "logprobs") else s.get("logprobs")) if is_model else None
        lps += list(seg_lp) if seg_lp is not None else [None] * len(toks)
    return Sequence_(ids, mask, lps)


class StreamDecoder:
    """The text of a reply as its tokens arrive, piece by piece, for live display.

    `push(ids)` returns the text the new ids add (vLLM's incremental detokenising): the ids
    since the last piece are decoded after the ids of the piece before (the tokenizer's own
    decode, so a leading space or a byte-level merge comes out as in the whole text), and
    text ending in U+FFFD, a character cut between tokens, is held back until it is complete.
    Each push decodes a few tokens, whatever the reply's length. `stop` (the closing
    `<|im_end|>`) is not part of a reply's text. `rest(text)`: what the pieces have not shown
    yet of the reply's final text, so that the pieces add up to exactly that text."""

    def __init__(self, tokenizer: Any, stop: int) -> None:
        self.tok, self.stop = tokenizer, stop
        self.sent = ""  # every piece returned so far, concatenated
        self._ids: list[int] = []
        self._prefix = self._read = 0  # ids[prefix:read]: the last piece's ids

    def push(self, ids: Sequence[int]) -> str:
        self._ids += [i for i in ids if i != self.stop]
        before = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        if len(text) <= len(before) or text.endswith("\ufffd"):
            return ""
        piece = text[len(before):]
        self._prefix, self._read = self._read, len(self._ids)
        self.sent += piece
        return piece

    def rest(self, text: str) -> str:
        return text[len(self.sent):] if text.startswith(self.sent) else ""

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False) if ids else ""
