"""`marscli tiny-model`: an offline-loadable, byte-reproducible tiny Qwen3-VL with the protocol's
tokenizer and chat template."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from marscli.errors import BadInput
from marscli.qwen import tiny as T  # no torch at import: checked below
from marscli.stages.tiny_model import main as tiny_main

os.environ.setdefault("HF_HUB_OFFLINE", "1")

WORDS = "The flurgle sat near the quazzle. Where is the flurgle? It is top left, the quazzle red.\n"
VISION = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
IMG = "".join(VISION)
CALL = ('<thinking>x</thinking><tool_call>{"name": "image_zoom_in_tool", '
        '"arguments": {"bbox_2d": [1, 2, 3, 4]}}</tool_call>')


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Three builds: A and B (seed 0, same text file), C (seed 1, same text file)."""
    root = tmp_path_factory.mktemp("tiny")
    words = root / "words.txt"
    words.write_text(WORDS)
    a = tiny_main(str(root / "a"), seed=0, text_files=[str(words)])  # the CLI's code path
    b = T.build_tiny_model(root / "b", seed=0, texts=T.read_texts([words]))
    c = T.build_tiny_model(root / "c", seed=1, texts=T.read_texts([words]))
    return a, b, c


@pytest.fixture(scope="module")
def loaded(built):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(built[0]).eval()
    return model, AutoProcessor.from_pretrained(built[0])


def _image(w: int, h: int, seed: int):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))


# ------------------------------------------------------------------------- the checkpoint


def test_loads_offline_with_auto_classes(built, loaded):
    model, proc = loaded
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration"
    assert type(proc).__name__ == "Qwen3VLProcessor"
    assert type(proc.image_processor).__name__ == "Qwen2VLImageProcessor"
    assert type(proc.video_processor).__name__ == "Qwen3VLVideoProcessor"
    tok, cfg = proc.tokenizer, model.config
    assert cfg.text_config.vocab_size == len(tok) and 2000 <= len(tok) <= T.VOCAB_CAP
    assert cfg.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>") == 5
    assert cfg.video_token_id == 6 and cfg.vision_start_token_id == 3
    assert cfg.vision_end_token_id == 4
    assert cfg.tie_word_embeddings and model.lm_head.weight is model.get_input_embeddings().weight
    assert model.dtype.__str__() == "torch.float32"
    assert model.generation_config.eos_token_id == tok.eos_token_id == 2
    assert model.generation_config.pad_token_id == tok.pad_token_id == 0
    assert cfg.text_config.rope_parameters["mrope_section"] == [8, 12, 12]
    assert cfg.text_config.rope_parameters["mrope_interleaved"] is True
    assert proc.chat_template == tok.chat_template == T.CHAT_TEMPLATE
    assert sorted(p.name for p in Path(built[0]).iterdir()) == [
        "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
        "processor_config.json", "tokenizer.json", "tokenizer_config.json"]
    assert Path(f"{built[0]}.meta.json").is_file()  # the CLI path writes a sidecar beside it


def test_head_dim_is_64(loaded):
    model, _ = loaded
    text = model.config.text_config
    assert text.head_dim == 64  # vLLM's CPU attention refuses 16
    assert model.model.language_model.layers[0].self_attn.q_proj.out_features == 64 * 2
    assert sum(text.rope_parameters["mrope_section"]) == text.head_dim // 2


def test_same_seed_same_bytes_other_seed_other_weights(built):
    a, b, c = (Path(p) for p in built)
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for n in names:
        assert (a / n).read_bytes() == (b / n).read_bytes(), n
    for n in names:
        same = (a / n).read_bytes() == (c / n).read_bytes()
        assert same == (n != "model.safetensors"), n
    from safetensors.numpy import load_file

    wa, wc = load_file(a / "model.safetensors"), load_file(c / "model.safetensors")
    name = "model.language_model.embed_tokens.weight"
    assert wa.keys() == wc.keys() and wa[name].shape == wc[name].shape
    assert not (wa[name] == wc[name]).all()
    assert T.count_parameters(a) == sum(v.size for v in wa.values())


def test_tokenizer_training_is_deterministic():
    assert T.train_tokenizer([WORDS]).to_str() == T.train_tokenizer([WORDS]).to_str()
    assert T.train_tokenizer([WORDS]).to_str() != T.train_tokenizer().to_str()


# --------------------------------------------------------------------------------- tokenizer


def test_special_tokens_and_tags_are_single_tokens_with_fixed_ids(loaded):
    tok = loaded[1].tokenizer
    added = tok.added_tokens_decoder
    for i, t in enumerate(T.SPECIAL_TOKENS + T.PROTOCOL_TAGS):
        assert tok.convert_tokens_to_ids(t) == i
        assert tok(f"a{t}b", add_special_tokens=False)["input_ids"][1] == i
        assert tok(t, add_special_tokens=False)["input_ids"] == [i]
        assert added[i].content == t and added[i].special == (t in T.SPECIAL_TOKENS)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"


def test_decode_round_trips_protocol_text(loaded):
    tok = loaded[1].tokenizer
    ids = tok(CALL, add_special_tokens=False)["input_ids"]
    assert ids[:1] == [7] and ids[2] == 8 and ids[3] == 11 and ids[-1] == 12
    assert tok.decode(ids) == CALL
    assert tok.decode(ids, skip_special_tokens=True) == CALL  # tags are not special
    # words of the built-in text are whole tokens, and special tokens are what gets skipped
    for w in ["image", "_zoom", "_in", "_tool", "bbox", "arguments", "Ġred", "bottom"]:
        assert w in tok.get_vocab(), w
    assert tok.decode(tok("<|im_start|>assistant\nhi<|im_end|>")["input_ids"],
                      skip_special_tokens=True) == "assistant\nhi"


def test_word_from_text_file_becomes_a_single_token(loaded):
    tok = loaded[1].tokenizer
    for s in [" flurgle", "flurgle", " quazzle", "quazzle"]:
        assert len(tok(s, add_special_tokens=False)["input_ids"]) == 1, s
    assert len(tok("<answer>flurgle</answer>")["input_ids"]) == 3
    # control: without the text the words split (so the assertion above can fail)
    plain = T.train_tokenizer()
    assert len(plain.encode(" flurgle").ids) > 1 and len(plain.encode("quazzle").ids) > 1


def test_read_texts_takes_string_values_of_jsonl(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"v": 1, "id": "a", "question": "Where?", "answer": ["top left"], '
                 '"image": "x.png", "sha256": "abc"}\n\n')
    assert T.read_texts([f]) == ["a", "Where?", "top left"]
    f.write_text('{"v": 1,\n')
    with pytest.raises(BadInput, match=r"p.jsonl:1: not valid JSON"):
        T.read_texts([f])
    with pytest.raises(BadInput, match="no such file"):
        T.read_texts([tmp_path / "nope.txt"])


# ----------------------------------------------------------------------------- chat template


def _three_turns(image_a=None, image_b=None):
    a = {"type": "image"} if image_a is None else {"type": "image", "image": image_a}
    b = {"type": "image"} if image_b is None else {"type": "image", "image": image_b}
    return [
        {"role": "user", "content": [a, {"type": "text", "text": "Where is the flurgle?"}]},
        {"role": "assistant", "content": CALL},
        {"role": "user", "content": [{"type": "text", "text": "<tool_response>\n"}, b,
                                     {"type": "text", "text": "\n</tool_response>"}]},
    ]


def test_chat_template_renders_the_exact_string(loaded):
    tok = loaded[1].tokenizer
    got = tok.apply_chat_template(_three_turns(), tokenize=False, add_generation_prompt=True)
    assert got == (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Where is the flurgle?"
        "<|im_end|>\n"
        "<|im_start|>assistant\n" + CALL + "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n<|vision_start|><|image_pad|><|vision_end|>\n"
        "</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    assert not tok.apply_chat_template(_three_turns(), tokenize=False).endswith("assistant\n")
    # images in system and assistant turns, plain-string content, no default system prompt
    msgs = [{"role": "system", "content": [{"type": "image_url"}, {"type": "text", "text": "S"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "A"}, {"type": "image"}]}]
    assert tok.apply_chat_template(msgs, tokenize=False) == (
        f"<|im_start|>system\n{IMG}S<|im_end|>\n<|im_start|>assistant\nA{IMG}<|im_end|>\n")
    with pytest.raises(Exception, match="unknown content part type: audio"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "audio"}]}],
                                tokenize=False)


def test_assistant_mask_covers_exactly_content_and_im_end(loaded):
    tok = loaded[1].tokenizer
    msgs = _three_turns() + [
        {"role": "assistant", "content": "<think>y</think><answer>red</answer>"}]
    r = tok.apply_chat_template(msgs, tokenize=True, return_dict=True,
                                return_assistant_tokens_mask=True)
    # Independent expectation: the pieces split at added tokens, so they tokenize alone.
    pieces = [
        (f"<|im_start|>user\n{IMG}Where is the flurgle?<|im_end|>\n<|im_start|>assistant\n", 0),
        (CALL + "<|im_end|>", 1),
        (f"\n<|im_start|>user\n<tool_response>\n{IMG}\n</tool_response><|im_end|>\n"
         + "<|im_start|>assistant\n", 0),
        ("<think>y</think><answer>red</answer><|im_end|>", 1),
        ("\n", 0),
    ]
    ids, mask = [], []
    for text, m in pieces:
        piece = tok(text, add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [m] * len(piece)
    assert r["input_ids"] == ids
    assert r["assistant_masks"] == mask
    toks = tok.convert_ids_to_tokens(ids)
    for t, m in zip(toks, mask):  # per token, by name, the rule the lead's token code relies on
        if t in ("<|im_start|>", "assistant", "user"):
            assert m == 0
    assert [t for t, m in zip(toks, mask) if m][-1] == "<|im_end|>"
    assert sum(1 for t, m in zip(toks, mask) if m and t == "<|im_end|>") == 2


# ------------------------------------------------------------------------ processor and model


def test_processor_image_tokens_match_grid(loaded):
    proc = loaded[1]
    for (w, h), want_grid in [((640, 480), [1, 24, 32]), ((2000, 1500), None), ((40, 30), None)]:
        enc = proc(text=[f"{IMG}hi"], images=[_image(w, h, 0)], return_tensors="pt")
        t, gh, gw = enc["image_grid_thw"][0].tolist()
        if want_grid:
            assert [t, gh, gw] == want_grid
        n = int((enc["input_ids"] == 5).sum())
        assert n == t * gh * gw // 4
        assert 64 <= n <= 196  # min_pixels 65,536, max_pixels 200,704 at 32 px per token
        assert enc["pixel_values"].shape == (t * gh * gw, 3 * 2 * 16 * 16)


def test_forward_and_generate_with_two_images_of_different_sizes(loaded):
    import torch

    model, proc = loaded
    msgs = _three_turns(_image(640, 480, 1), _image(150, 420, 2))
    enc = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                   return_dict=True, return_tensors="pt")
    grid = enc["image_grid_thw"].tolist()
    assert len(grid) == 2 and grid[0] != grid[1]
    assert int((enc["input_ids"] == 5).sum()) == sum(t * h * w // 4 for t, h, w in grid)
    with torch.no_grad():
        out = model(**enc)
    assert out.logits.shape == (1, enc["input_ids"].shape[1], len(proc.tokenizer))
    assert torch.isfinite(out.logits).all()
    gen = model.generate(**enc, max_new_tokens=4, do_sample=False,
                         suppress_tokens=[3, 4, 5, 6])  # a random model samples vision tokens
    assert gen.shape == (1, enc["input_ids"].shape[1] + 4) or gen[0, -1] == 2


# ------------------------------------------------------------------------------ CLI boundary


def test_refuses_non_empty_out_and_force_replaces(tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    (out / "keep").write_text("x")
    with pytest.raises(BadInput, match="not empty"):
        T.build_tiny_model(out)
    with pytest.raises(BadInput, match="unknown size 'huge'"):
        T.build_tiny_model(tmp_path / "n", size="huge")
    assert (out / "keep").exists() and not (tmp_path / "n").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no OUT.tmp-* left behind


def test_cli_exit_codes_and_no_torch_at_import(tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    (out / "keep").write_text("x")
    r = subprocess.run([sys.executable, "-m", "marscli", "tiny-model", str(out)],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "--force" in r.stderr
    r = subprocess.run([sys.executable, "-m", "marscli", "tiny-model", str(tmp_path / "x"),
                        "--text", str(tmp_path / "nope.txt")],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 2 and "nope.txt: no such file" in r.stderr
    r = subprocess.run([sys.executable, "-c",
                        "import sys, marscli.stages.tiny_model, marscli.qwen.tiny; "
                        "print('torch' in sys.modules)"],
                       capture_output=True, text=True, check=False)
    assert r.stdout.strip() == "False"


def test_init_std_sets_the_random_weights_spread_and_is_checked(tmp_path):
    """--init-std is the weights' standard deviation (the default is HF's 0.02; seed 0 draws
    the same normals either way, scaled), kept in config.json and the sidecar; a value outside
    (0, 1] is one line and exit 2, nothing written."""
    import orjson
    from safetensors.torch import load_file

    wide = tiny_main(str(tmp_path / "wide"), seed=0, text_files=[], init_std=0.08)
    default = T.build_tiny_model(tmp_path / "default", seed=0)
    key = "model.language_model.layers.0.self_attn.q_proj.weight"
    w, d = load_file(wide / "model.safetensors")[key], load_file(default / "model.safetensors")[key]
    assert abs(float(w.std()) - 0.08) < 0.004 and abs(float(d.std()) - 0.02) < 0.001
    assert abs(float((w - 4 * d).abs().max())) < 1e-6  # one draw, scaled
    cfg = orjson.loads((wide / "config.json").read_bytes())
    assert cfg["text_config"]["initializer_range"] == cfg["vision_config"]["initializer_range"]
    assert cfg["text_config"]["initializer_range"] == 0.08
    meta = orjson.loads((tmp_path / "wide.meta.json").read_bytes())
    assert meta["config"]["init_std"] == 0.08
    for bad in ("0", "-0.1", "nan", "2"):
        r = subprocess.run([sys.executable, "-m", "marscli", "tiny-model", str(tmp_path / "x"),
                            "--init-std", bad], capture_output=True, text=True, check=False)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert r.stderr.startswith("error: --init-std:") and not (tmp_path / "x").exists()


def test_conftest_fixture_builds_a_loadable_model(tiny_model):
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(tiny_model).text_config.head_dim == 64


def test_small_size_config():
    tok = T.make_tokenizer()
    cfg = T.make_config(tok, "small")
    t, v = cfg.text_config, cfg.vision_config
    assert (t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads,
            t.head_dim) == (256, 4, 4, 2, 64)
    assert (v.depth, v.hidden_size, v.out_hidden_size, v.patch_size) == (2, 128, 256, 16)
    assert t.vocab_size == len(tok)
    with pytest.raises(BadInput, match="choose one of: tiny, small"):
        T.make_config(tok, "medium")


# ------------------------------------------------------------------------- --vocab qwen


# qwen_model: conftest.py's fixture (the CLI's code path, built once a session)


def test_qwen_vocab_config_and_tokenizer_ids(qwen_model):
    import json

    from transformers import AutoConfig, AutoProcessor

    from marscli.qwen.chat_template import QWEN3_VL_TEMPLATE
    from marscli.qwen.tokens import special_ids

    cfg = AutoConfig.from_pretrained(qwen_model)
    assert cfg.text_config.vocab_size == 151_936 and cfg.tie_word_embeddings
    assert (cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id,
            cfg.vision_end_token_id, cfg.text_config.pad_token_id) == (
        151_655, 151_656, 151_652, 151_653, 151_643)
    assert (cfg.text_config.hidden_size, cfg.text_config.head_dim) == (64, 64)  # micro
    proc = AutoProcessor.from_pretrained(qwen_model)
    tok = proc.tokenizer
    assert tok.encode("Hello world", add_special_tokens=False) == [9707, 1879]
    assert len(tok) == 151_669 and tok.eos_token_id == 151_645
    assert proc.chat_template == QWEN3_VL_TEMPLATE
    ids = special_ids(tok)  # what the engines suppress: looked up by string, not fixed ids
    assert ids.vision == (151_655, 151_656, 151_652, 151_653) and ids.im_end == 151_645
    gen = json.loads((qwen_model / "generation_config.json").read_text())
    assert (gen["eos_token_id"], gen["pad_token_id"]) == (151_645, 151_643)
    meta = json.loads(Path(f"{qwen_model}.meta.json").read_text())
    assert meta["config"]["vocab"] == "qwen" and meta["config"]["size"] == "micro"
    assert meta["stats"]["parameters"] < 11_000_000  # nearly all the tied embedding


def test_qwen_vocab_refuses_text_and_unknown_vocab(tmp_path):
    words = tmp_path / "w.txt"
    words.write_text(WORDS)
    with pytest.raises(BadInput, match="--text: the real Qwen vocabulary is fixed"):
        T.build_tiny_model(tmp_path / "m", texts=T.read_texts([words]), vocab="qwen")
    with pytest.raises(BadInput, match="--vocab: unknown vocabulary 'gpt2' — choose one of: "
                                       "tiny, qwen"):
        tiny_main(str(tmp_path / "n"), vocab="gpt2")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.txt"]


@pytest.mark.slow
def test_ask_rollout_eval_sft_update_run_on_the_qwen_vocab(qwen_model, tmp_path):
    """The stages on real token ids, a few tokens each (in process: torch is loaded already)."""
    import orjson
    from safetensors.torch import load_file

    from helpers import invoke, read_jsonl, scene, write_jsonl

    scene(tmp_path / "img.png")
    code, _, err = invoke(["ask", str(tmp_path / "img.png"), "What colour?", "--policy",
                           str(qwen_model), "--max-turn-tokens", "8", "--max-turns", "1",
                           "--device", "cpu"])
    assert code == 0, err
    prompts = write_jsonl(tmp_path / "p.jsonl", [
        {"v": 1, "id": f"q{i}", "image": ["img.png"], "question": "What colour?",
         "answer": ["red"]} for i in range(2)])
    traj = tmp_path / "t.jsonl"
    code, _, err = invoke(["rollout", str(prompts), "--policy", str(qwen_model), "-o",
                           str(traj), "-n", "2", "--max-turn-tokens", "8", "--max-turns", "1",
                           "--device", "cpu", "--seed", "1"])
    assert code == 0, err
    rows = read_jsonl(traj)
    assert len(rows) == 4
    code, _, err = invoke(["eval", str(prompts), "--policy", str(qwen_model), "-o",
                           str(tmp_path / "ev.jsonl"), "--max-turn-tokens", "8", "--max-turns",
                           "1", "--device", "cpu", "--protocol", "release"])
    assert code == 0, err
    assert orjson.loads((tmp_path / "ev.summary.json").read_bytes())["protocol"] == "release"
    prompt = rows[0]["segments"][0]["tokens"]
    assert prompt[:3] == [151_644, 8948, 198]  # <|im_start|>system\n on the real ids
    vision = {151_652, 151_653, 151_655, 151_656}
    for r in rows:
        for s in r["segments"]:
            if s["role"] == "model":
                assert s["tokens"] and not vision & set(s["tokens"])
    # one update step on hand-set advantages, one SFT step: the weights move
    adv = write_jsonl(tmp_path / "a.jsonl", [
        {**r, "reward": {"total": float(i % 2), "accuracy": float(i % 2), "format": 0.0,
                         "judge": "exact"},
         "advantage": 1.0 if i % 2 else -1.0, "group": {"mean": 0.5, "std": 0.5, "size": 2}}
        for i, r in enumerate(rows)])
    before = load_file(qwen_model / "model.safetensors")
    for stage, src in (("update", adv), ("sft", traj)):
        code, _, err = invoke([stage, str(src), "--policy", str(qwen_model), "--out",
                               str(tmp_path / stage), "--device", "cpu"])
        assert code == 0, (stage, err)
        after = load_file(tmp_path / stage / "model.safetensors")
        moved = [k for k in before if not (before[k] == after[k]).all()]
        assert moved, stage
        metrics = [orjson.loads(x) for x in
                   (tmp_path / stage / "metrics.jsonl").read_bytes().splitlines()]
        assert metrics and all(m.get("loss") is not None for m in metrics if "step" in m)
