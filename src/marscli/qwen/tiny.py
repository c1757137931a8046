"""A tiny, randomly initialised Qwen3-VL checkpoint for tests and CPU demos (built by
`build_tiny_model`; the `marscli tiny-model` stage is stages/tiny_model.py).

The folder is a Hugging Face checkpoint like the real ones: `config.json`, `generation_config.json`,
`model.safetensors`, a fast tokenizer and a `Qwen3VLProcessor` (image + video processor, chat
template). `AutoModelForImageTextToText.from_pretrained(OUT)`, `AutoProcessor.from_pretrained(OUT)`
and vLLM load it offline as they are. The same seed and texts give byte-identical files.

How it departs from a released Qwen3-VL checkpoint, and why:
1. The tokenizer is a byte-level BPE of at most `VOCAB_CAP` tokens trained here on a built-in text
   (protocol and tool vocabulary, a system prompt, common English words) plus any `--text` given.
   A tiny model only learns a task when the task's words are single tokens (docs/demo.md
   "Can the tiny model learn a visual task on CPU?"), so pass the toy world's corpus and
   prompts with `--text`.
   Pre-tokenisation is Qwen2's split regex (digits one by one, `_zoom` one piece) followed by
   byte-level mapping without a prefix space, as in Qwen's own tokenizer.
2. Token ids are fixed whatever the texts: `SPECIAL_TOKENS` take ids 0-6 and `PROTOCOL_TAGS` ids
   7-16, then the 256 byte symbols, then the merges. The protocol tags are added tokens that are
   *not* special, so `decode(skip_special_tokens=True)` keeps them and generated text round-trips.
3. The chat template is marscli's own, minimal one (`CHAT_TEMPLATE`): no default system prompt, no
   `<think>` injection, no tool rendering (tools live in the system prompt text). Assistant turns
   are wrapped in `{% generation %}` so `return_assistant_tokens_mask=True` marks exactly the
   assistant's content and its `<|im_end|>`.
4. Images are capped at `TINY_MAX_PIXELS` (at most 196 merged tokens each) and floored at
   `TINY_MIN_PIXELS` (64 tokens); patch 16, merge 2, temporal patch 2 as in Qwen3-VL.
5. Text RoPE keeps Qwen3-VL's interleaved M-RoPE with `mrope_section` [8, 12, 12] (sums to
   head_dim / 2 = 32); head_dim stays 64 because vLLM's CPU attention refuses smaller heads.

`--vocab qwen` (`VOCABS`) builds the same model on the real Qwen vocabulary instead of 1-3:
- The tokenizer is `qwen_vocab.qwen_tokenizer` (Qwen2/2.5/3's 151,643 BPE ranks and Qwen3-VL's
  added tokens at their real ids: "Hello world" is [9707, 1879], `<|im_start|>` 151,644) and the
  chat template `chat_template.QWEN3_VL_TEMPLATE` (renders as Qwen3-VL-Instruct's, `tools=`
  included), on the tokenizer and the processor. `--text` is refused: the vocabulary is fixed.
- `vocab_size` is `QWEN_VOCAB_SIZE` (151,936) as in Qwen3-VL's checkpoints: the 267 rows past
  the tokenizer's 151,669 tokens are embeddings no token names. The special ids in the config
  (image, video, vision start and end, pad, eos) are looked up by token string.
- The embedding dominates: the default size is then `micro` (text hidden 64, one attention
  head of 64), about 10 M parameters, nearly all of them the tied embedding; the full-vocab
  logits are most of a forward's cost.
- `<thinking>`, `<answer>` and their closers are several BPE tokens each, as for the released
  models; `<think>`, `<tool_call>`, `<tool_response>` and their closers are single added tokens.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Iterable
from pathlib import Path

from marscli.errors import BadInput, save_errors
from marscli.qwen.tiny_config import INIT_STD, TINY_MAX_PIXELS, TINY_MIN_PIXELS
from marscli.records.outputs import AtomicDir

# ids 0..6, in this order, special=True (skipped by decode(skip_special_tokens=True))
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# ids 7..16, in this order, added tokens with special=False (decode keeps them)
PROTOCOL_TAGS: tuple[str, ...] = (
    "<thinking>",
    "</thinking>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<answer>",
    "</answer>",
    "<tool_response>",
    "</tool_response>",
)
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
VOCAB_CAP = 4096  # BPE stops earlier when the texts run out of pairs seen twice
MODEL_MAX_LENGTH = 32768

PATCH_SIZE = 16
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2

# Rendering, for every message: `<|im_start|>{role}\n` + content + `<|im_end|>\n`.
# Content is a string or a list of parts: {"type": "image"} / {"type": "image_url"} render
# `<|vision_start|><|image_pad|><|vision_end|>` (the processor expands the pad), {"type": "video"}
# the same with `<|video_pad|>`, {"type": "text", "text": ...} the text verbatim. Assistant content
# plus its `<|im_end|>` sit inside {% generation %} (the assistant-token mask); the `\n` after it
# does not. `add_generation_prompt` appends `<|im_start|>assistant\n`.
# The `{% generation %}` tag must stay at the template's top level (not inside a macro): its span
# is measured against the output streamed so far.
CHAT_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is none -%}"
    "{%- elif content is string -%}{{- content -}}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part is string -%}{{- part -}}"
    "{%- elif part['type'] in ['image', 'image_url'] -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'video' -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- else -%}{{- raise_exception('unknown content part type: ' ~ part['type']) -}}"
    "{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- generation -%}{{- render(message['content']) + '<|im_end|>' -}}{%- endgeneration -%}"
    "{{- '\\n' -}}"
    "{%- else -%}"
    "{{- render(message['content']) + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Qwen2's pre-tokeniser split (tokenization_qwen2.PRETOKENIZE_REGEX).
_QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

SIZES: dict[str, dict] = {
    "tiny": {
        "text": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
                 "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64},
        "vision": {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4,
                   "num_position_embeddings": 256, "deepstack_visual_indexes": [0, 1]},
    },
    "small": {
        "text": {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64},
        "vision": {"depth": 2, "hidden_size": 128, "intermediate_size": 256, "num_heads": 4,
                   "num_position_embeddings": 256, "deepstack_visual_indexes": [0, 1]},
    },
    # the real vocabulary's default: its embedding is most of the model
    "micro": {
        "text": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                 "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 64},
        "vision": {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4,
                   "num_position_embeddings": 256, "deepstack_visual_indexes": [0, 1]},
    },
}

# ------------------------------------------------------------------------------ built-in text
# The texts the tiny vocabulary is trained on live as package data (tiny_text/), read
# byte for byte: the same texts give the same BPE merges, so the same model.


def _data_text(name: str) -> str:
    return (Path(__file__).parent / "tiny_text" / name).read_text(encoding="utf-8")


_SYSTEM_PROMPT = _data_text("system_prompt.txt")

_EXAMPLES = _data_text("examples.txt")

_TASK_WORDS = _data_text("task_words.txt")

_ENGLISH = _data_text("english.txt")


def builtin_text() -> str:
    """The text every tiny tokenizer is trained on (protocol, tools, system prompt, English)."""
    # The protocol parts are repeated so their merges come first when VOCAB_CAP binds.
    # Task words (colours, positions, question words, tool words) also learn their no-space form.
    parts = [_SYSTEM_PROMPT] * 3 + [_EXAMPLES] * 3 + [_TASK_WORDS, _ENGLISH]
    return "\n".join(parts + [_word_list([_TASK_WORDS])])


def _word_list(texts: Iterable[str]) -> str:
    """Every distinct word on its own line, sorted: each also learns its no-space form.

    BPE learns ` red` (after a space) and `red` (after `<answer>` or a newline) as different
    tokens; a word seen only mid-sentence would otherwise split after a tag.
    """
    words = set()
    for t in texts:
        words.update(re.findall(r"[^\W\d_]+", t))
    return "\n".join(sorted(words))


def read_texts(paths: Iterable[str | Path]) -> list[str]:
    """Training texts from files: JSON/JSONL rows give their string values, others their text.

    Keys, `sha256` digests and image paths are left out so the vocabulary goes to words.
    """
    out: list[str] = []
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise BadInput(f"{p}: no such file — --text takes a text or JSONL file")
        try:
            raw = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise BadInput(f"{p}: not UTF-8 text ({e.reason}) — --text takes a text or JSONL "
                           "file") from None
        if path.suffix in (".jsonl", ".json"):
            for n, line in enumerate(raw.splitlines() if path.suffix == ".jsonl" else [raw], 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise BadInput(f"{p}:{n}: not valid JSON: {e.msg}") from None
                out.extend(_strings(obj))
        else:
            out.append(raw)
    return out


_SKIP_KEYS = {"sha256", "path", "image", "thumbnail", "image_search_thumbnail_list"}


def _strings(obj) -> Iterable[str]:
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, list):
        for v in obj:
            yield from _strings(v)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            if k not in _SKIP_KEYS:
                yield from _strings(v)


# ---------------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: Iterable[str] = ()):
    """A byte-level BPE `tokenizers.Tokenizer` trained on the built-in text plus `texts`.

    Deterministic: the trainer counts words (order-free) and breaks ties by pair id, and the
    ids of the alphabet are sorted; the test builds twice and compares the JSON.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from tokenizers.pre_tokenizers import ByteLevel

    tok = Tokenizer(models.BPE())  # no unk: byte-level covers every input
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
        ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    # Special tokens and tags first (ids 0..16), then the byte alphabet, then merges.
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_CAP,
        min_frequency=1,
        show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False)
                        for t in SPECIAL_TOKENS + PROTOCOL_TAGS],
        initial_alphabet=ByteLevel.alphabet(),
    )
    # Protocol tags are cut out of the training text: they are added tokens, not BPE words.
    texts = list(texts)
    corpus = [_strip_tags(t) for t in [builtin_text(), *texts, _word_list(texts)]]
    tok.train_from_iterator(corpus, trainer=trainer)

    # The trainer registers every listed token as special; mark the protocol tags non-special.
    spec = json.loads(tok.to_str())
    for entry in spec["added_tokens"]:
        entry["special"] = entry["content"] in SPECIAL_TOKENS
    tok = Tokenizer.from_str(json.dumps(spec))
    for i, t in enumerate(SPECIAL_TOKENS + PROTOCOL_TAGS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    return tok


def _strip_tags(text: str) -> str:
    for t in SPECIAL_TOKENS + PROTOCOL_TAGS:
        text = text.replace(t, " ")
    return text


def make_tokenizer(texts: Iterable[str] = ()):
    """`PreTrainedTokenizerFast` around `train_tokenizer(texts)`, with the chat template."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(texts),
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        extra_special_tokens=[t for t in SPECIAL_TOKENS if t not in (EOS_TOKEN, PAD_TOKEN)],
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
    )


def make_processor(tokenizer, min_pixels: int = TINY_MIN_PIXELS,
                   max_pixels: int = TINY_MAX_PIXELS, chat_template: str = CHAT_TEMPLATE):
    """`Qwen3VLProcessor` with Qwen3-VL's patching and the tiny pixel budget."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    common = {"patch_size": PATCH_SIZE, "merge_size": MERGE_SIZE,
              "temporal_patch_size": TEMPORAL_PATCH_SIZE,
              "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
    image_processor = Qwen2VLImageProcessor(
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels}, **common)
    video_processor = Qwen3VLVideoProcessor(
        size={"shortest_edge": min_pixels, "longest_edge": 4 * max_pixels}, **common)
    return Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                            video_processor=video_processor, chat_template=chat_template)


# ------------------------------------------------------------------------------------- model




def check_init_std(init_std: float) -> None:
    if not (math.isfinite(init_std) and 0 < init_std <= 1):
        raise BadInput(f"--init-std: {init_std} — need a number in (0, 1]")


def make_config(tokenizer, size: str = "tiny", vocab_size: int | None = None,
                init_std: float = INIT_STD):
    """`Qwen3VLConfig` of the given size, with token ids looked up in `tokenizer` by string;
    `vocab_size` defaults to the tokenizer's length (the real vocabulary pads it); `init_std`
    is the random weights' standard deviation (HF's initializer_range)."""
    from transformers import Qwen3VLConfig

    if size not in SIZES:
        raise BadInput(f"unknown size {size!r} — choose one of: {', '.join(SIZES)}")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text = dict(
        SIZES[size]["text"],
        vocab_size=vocab_size or len(tokenizer),
        max_position_embeddings=MODEL_MAX_LENGTH,
        rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0,
                         "mrope_section": [8, 12, 12], "mrope_interleaved": True},
        pad_token_id=ids[PAD_TOKEN],
        dtype="float32",
        initializer_range=init_std,
    )
    vision = dict(
        SIZES[size]["vision"],
        patch_size=PATCH_SIZE,
        spatial_merge_size=MERGE_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
        out_hidden_size=text["hidden_size"],
        initializer_range=init_std,
    )
    return Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
        dtype="float32",
        architectures=["Qwen3VLForConditionalGeneration"],
        initializer_range=init_std,
    )


def qwen_parts() -> tuple[object, str, int]:
    """The real vocabulary: Qwen's tokenizer (a private copy: the shared one stays untouched),
    the Qwen3-VL chat template, and the padded vocabulary size."""
    import copy

    from marscli.qwen.chat_template import QWEN3_VL_TEMPLATE
    from marscli.qwen.vocab import QWEN_VOCAB_SIZE, qwen_tokenizer

    return copy.deepcopy(qwen_tokenizer(QWEN3_VL_TEMPLATE)), QWEN3_VL_TEMPLATE, QWEN_VOCAB_SIZE


VOCABS = ("tiny", "qwen")
DEFAULT_SIZE = {"tiny": "tiny", "qwen": "micro"}


def _tokenizer_parts(vocab: str, texts: list[str]) -> tuple[object, str, int | None]:
    """(tokenizer, chat template, vocab_size or None for the tokenizer's length)."""
    if vocab not in VOCABS:
        raise BadInput(f"--vocab: unknown vocabulary {vocab!r} — choose one of: "
                       f"{', '.join(VOCABS)}")
    if vocab == "tiny":
        return make_tokenizer(texts), CHAT_TEMPLATE, None
    if texts:
        raise BadInput("--text: the real Qwen vocabulary is fixed, nothing is trained — drop "
                       "--text, or use --vocab tiny")
    return qwen_parts()


def build_tiny_model(out: str | Path, seed: int = 0, texts: Iterable[str] = (),
                     size: str | None = None, force: bool = False,
                     min_pixels: int = TINY_MIN_PIXELS, max_pixels: int = TINY_MAX_PIXELS,
                     vocab: str = "tiny", init_std: float = INIT_STD) -> Path:
    """Write a random Qwen3-VL checkpoint (model, tokenizer, processor) to folder `out`.

    `texts` are training texts for the tokenizer (strings, not paths: see `read_texts`); `vocab`
    "qwen" takes the real vocabulary instead (no texts), and `size` defaults per vocabulary
    (`DEFAULT_SIZE`); `init_std` is the weights' standard deviation. The folder is built as
    `OUT.tmp-PID` and renamed onto `out`; an existing non-empty `out` is refused unless `force`.
    Same seed and texts, same bytes in every file.
    """
    out = Path(out)
    size = size or DEFAULT_SIZE.get(vocab, "tiny")
    if size not in SIZES:
        raise BadInput(f"--size: unknown size {size!r} — choose one of: {', '.join(SIZES)}")
    if out.exists() and not out.is_dir():
        raise BadInput(f"{out}: exists and is not a folder — choose another OUT")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise BadInput(f"{out}: folder exists and is not empty — pass --force to replace it")
    texts = list(texts)

    import torch
    from transformers import GenerationConfig, Qwen3VLForConditionalGeneration

    from marscli.qwen.policy import quiet_transformers

    if not 1024 <= min_pixels <= max_pixels:
        raise BadInput(f"--min-pixels/--max-pixels: need 1024 <= min ({min_pixels}) <= max "
                       f"({max_pixels})")
    check_init_std(init_std)
    tokenizer, template, vocab_size = _tokenizer_parts(vocab, texts)
    processor = make_processor(tokenizer, min_pixels, max_pixels, template)
    config = make_config(tokenizer, size, vocab_size, init_std)
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG state alone
        torch.manual_seed(seed)
        model = Qwen3VLForConditionalGeneration(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.convert_tokens_to_ids(EOS_TOKEN),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD_TOKEN),
    )

    # --force: the old folder goes only once the new one is in place; no "Writing model
    # shards" bar on stderr
    with AtomicDir(out) as ad, save_errors(ad.tmp), quiet_transformers():
        model.save_pretrained(ad.tmp, safe_serialization=True)
        # tokenizer files, processor_config.json, chat_template.jinja
        processor.save_pretrained(ad.tmp)
    return out


def count_parameters(folder: str | Path) -> int:
    """Parameters stored in a checkpoint's safetensors files (tied weights counted once)."""
    total = 0
    for f in sorted(Path(folder).glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, info in header.items():
            if name != "__metadata__":
                p = 1
                for d in info["shape"]:
                    p *= d
                total += p
    return total
