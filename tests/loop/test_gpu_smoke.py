"""scripts/gpu-smoke.sh and its update benchmark (bench/bench_update_gpu.py), rehearsed on
CPU (DEVICE=cpu) with small shapes: the same code path as on a GPU (a random Qwen3-VL with the
real vocabulary size, advantage rows, `update`, a second update from the fp32 masters, `plan`,
the script's summary and verdict), with CPU's peak RSS in place of the allocator's peak."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ENV, ROOT

BENCH = ROOT / "bench" / "bench_update_gpu.py"


def bench_module():
    spec = importlib.util.spec_from_file_location("bench_update_gpu", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_8b_shapes_with_fewer_layers():
    """The 8B's widths are kept, the layer counts replaced, and M-RoPE's sections still sum to
    head_dim / 2 when the head is narrower."""
    b = bench_module()
    base = json.loads(b.CONFIG_8B.read_text())
    a = b.parse(["--layers", "4", "--vision-layers", "2"])
    text, vision = b.model_config(base, a)
    assert (text["num_hidden_layers"], text["hidden_size"], text["intermediate_size"]) == (
        4, 4096, 12288)
    assert (text["num_attention_heads"], text["num_key_value_heads"], text["vocab_size"]) == (
        32, 8, 151936)
    assert text["rope_parameters"]["mrope_section"] == [24, 20, 20]  # the 8B's own
    assert (vision["depth"], vision["hidden_size"], vision["deepstack_visual_indexes"]) == (
        2, 1152, [0, 1])
    text, vision = b.model_config(base, b.parse(["--head-dim", "64", "--vision-layers", "27"]))
    assert text["rope_parameters"]["mrope_section"] == [12, 10, 10]
    assert vision["deepstack_visual_indexes"] == [6, 13, 20]  # three, spread as the 8B's 8/16/24


@pytest.mark.slow  # measured: 35-45 s on 2 cores
def test_cpu_rehearsal_of_the_script_and_its_update_benchmark(tmp_path):
    """scripts/gpu-smoke.sh with DEVICE=cpu: no vLLM parts, one update benchmark run at the CPU
    shapes (with the masters' read-back), its summary and verdict lines; the run's JSON line."""
    env = {**ENV, "DEVICE": "cpu", "USE_CURRENT_VENV": "1", "UPDATE_LAYERS": "2",
           "UPDATE_RUNS": "256", "WORK": str(tmp_path),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{ENV.get('PATH', '')}"}
    res = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-smoke.sh")], capture_output=True,
                         text=True, env=env, timeout=600, check=False)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    out = res.stdout
    assert "gpu-smoke: DEVICE=cpu: skipping the vLLM parts" in out
    assert "measured / (plan - context)" in out  # the benchmark's table
    assert re.search(r"gpu-smoke: update 1 x cpu, 2 layers, 256 tokens: [\d,]+ tokens/s, MFU n/a; "
                     r"peak RSS [\d.]+ GiB \(no ratio on CPU\); plan [\d.]+ GiB", out), out
    assert re.search(r"gpu-smoke: fp32 masters 0\.30 GiB: saved in [\d.]+ s, read back", out)
    assert out.strip().splitlines()[-1] == ("gpu-smoke: PASS (vLLM: skipped, DEVICE=cpu; update "
                                            "benchmark: 1 run(s))")
    [line] = (tmp_path / "update-bench.jsonl").read_text().splitlines()
    r = json.loads(line)
    assert r["bench"] == "update_gpu" and r["device"] == "cpu" and r["steps"] == 3
    assert r["steps_timed"] == 2  # the first step is the warm-up
    # CPU_SHAPES: h 256, f 768, 2 layers, q 4 x 64, kv 2 x 64, V 151,936; rows of 128 and 127
    # tokens, 64 of each under the loss. 6 L P_layer n + 6 V h n_loss + 12 L q n^2, by hand:
    p_layer = 256 * (256 + 256) + 256 * 256 + 3 * 256 * 768  # 786,432
    flops = sum(6 * 2 * p_layer * n + 6 * 151936 * 256 * 64 + 12 * 2 * 256 * n * n
                for n in (128, 127))
    assert (r["micro_batch_tokens"], r["loss_tokens"], r["vocab"]) == (256, 128, 151936)
    assert r["flops_per_step"] == flops == 32_478_074_880
    assert r["tokens_per_s"] > 0 and r["tflops_per_gpu"] > 0
    assert r["mfu"] is None and r["peak_tflops"] is None  # no peak to divide by on CPU
    # the masters file holds every parameter plan counts, in fp32 (plus a header)
    assert 4 * r["params"] < r["master_bytes"] < 4 * r["params"] + 2**20
    assert r["master_save_seconds"] > 0 and r["master_load_seconds"] > 0
    assert r["resume_load_seconds"] > r["master_load_seconds"]
    # plan: plain torch, 18 bytes a parameter of model states, plus activations and a context
    assert r["zero"] == "torch" and r["plan_model_states"] == 18 * r["params"]
    assert r["plan_peak"] > r["plan_model_states"] + r["plan_activations"] > 0
    # no allocator on CPU: null peaks and ratio, with the reason; RSS holds at least the fp32
    # weights, grads and AdamW's two moments
    assert r["gpu_peak_allocated"] is None and r["plan_ratio"] is None
    assert "no GPU allocator" in r["plan_note"]
    assert r["peak_rss"] > 16 * r["params"]
    work = tmp_path / "update"  # the outputs are gone, the model is kept for the next run
    assert not list(work.glob("out-*")) and len(list(work.glob("model-*"))) == 1


def test_gpu_smoke_script_parses():
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu-smoke.sh")],
                          check=False).returncode == 0
