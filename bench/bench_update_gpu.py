"""`marscli update` at Qwen3-VL-8B's layer shapes: MFU, peak GPU memory against `marscli plan`'s
prediction, and the fp32 masters' save and load times. Written for a CUDA machine with torch and
no vLLM (scripts/gpu-smoke.sh runs it); `--device cpu` with small shapes rehearses it end to end.

    python bench/bench_update_gpu.py                       # CUDA: 8B shapes, 4 text layers
    python bench/bench_update_gpu.py --layers 2 --tokens 16384 --gradient-checkpointing
    python bench/bench_update_gpu.py --nproc 8 --deepspeed recipes/ds_zero3.json
    python bench/bench_update_gpu.py --device cpu          # the CPU rehearsal's shapes

1. A random Qwen3-VL with recipes/qwen3-vl-8b.config.json's shapes (hidden 4096, intermediate
   12288, 32 heads of 128, 8 KV heads, vocabulary 151,936, untied head; vision 1152 wide,
   intermediate 4304, 16 heads, DeepStack mergers) but only --layers text layers and
   --vision-layers vision blocks, bf16 safetensors, built in a child process (this one never
   touches the GPU). The tokenizer is marscli's tiny one: the embedding keeps the 151,936 rows,
   the rows past the tokenizer are ones no token names. Kept in --work for the next run.
2. Advantage rows, text only: per optimiser step and rank two rows of --tokens/2 and
   --tokens/2 - 1 tokens (one micro-batch of --tokens, padded: the worst case `plan` takes),
   the last --loss-frac of each row a model segment under the loss; --steps minibatches.
3. `marscli update` (one process, or `torch.distributed.run` with --nproc) with
   --save-dtype bfloat16, so the fp32 masters go to train_state/master-rank-*.safetensors beside the
   bf16 export on CPU too; then (unless --no-resume) a second update of one step from its output,
   which reads the masters back in.
4. `marscli plan` on the same config.json with the run's shape (--gpus-per-node N, --zero 0
   or --deepspeed, --micro-batch-tokens, --loss-tokens, --image-tokens 0, the GPU's memory).
   On CUDA it runs first, and a run plan says does not fit the GPU is skipped (--no-fit-check
   runs it anyway).

Measured: tokens/s of the optimiser steps after the first (the first pays cuBLAS and AdamW's
state allocation); MFU = model FLOPs per second / (ranks x --peak-tflops), where a step's
model FLOPs are, over its rows of n tokens (n_loss under the loss), L layers of P_layer
matmul weights (h(q + 2kv) + qh + 3hf), hidden h, vocabulary V, q = heads x head_dim:
    6 L P_layer n + 6 V h n_loss + 12 L q n^2
(PaLM's count: forward + backward = 3 x the forward's 2 FLOPs per weight and token; the
attention term counts the full n x n scores, as SDPA computes them under a padding mask; the
LM head only over loss tokens, as update's PolicyLM runs it; the embedding lookup, norms and
the vision tower, which text-only rows never run, count nothing). Peak memory is update's
metrics `gpu_peak_allocated` / `gpu_peak_reserved` (torch's allocator, max over ranks, since
the process started); plan's figure includes a CUDA context (1 GiB assumed) that the allocator
does not see, so the ratio compares the allocator's peak with plan's peak less that context.
On CPU there is no allocator peak: the update's peak RSS (ru_maxrss: interpreter, libraries and
the host copies included) is reported, and no ratio.
Under DeepSpeed with several ranks, update adds a 1-token blank image row, padded to the
micro-batch's row length, to every micro-batch without images (trainer.PolicyLM): compute and
memory that neither the FLOPs nor plan count; the JSON says so (`blank_image_row`).

Prints a table on stdout and, last, one JSON line (`{"bench": "update_gpu", ...}`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG_8B = ROOT / "recipes" / "qwen3-vl-8b.config.json"
GiB = 1 << 30
PEAK_TFLOPS_DEFAULT = 989.0  # H100 / H200 SXM, dense bf16
# The CPU rehearsal (--device cpu without sizes): small widths, the real vocabulary size.
CPU_SHAPES = {"layers": 2, "hidden": 256, "intermediate": 768, "heads": 4, "kv_heads": 2,
              "head_dim": 64, "vision_layers": 2, "vision_hidden": 64,
              "vision_intermediate": 128, "vision_heads": 4, "tokens": 256, "steps": 3}
GPU_SHAPES = {"layers": 4, "vision_layers": 2, "tokens": 8192, "steps": 4}
TEXT_KEYS = {"hidden": "hidden_size", "intermediate": "intermediate_size",
             "heads": "num_attention_heads", "kv_heads": "num_key_value_heads",
             "head_dim": "head_dim", "layers": "num_hidden_layers", "vocab": "vocab_size"}
VISION_KEYS = {"vision_hidden": "hidden_size", "vision_intermediate": "intermediate_size",
               "vision_heads": "num_heads", "vision_layers": "depth"}


# ------------------------------------------------------------------------------ the model


def model_config(base: dict, a: argparse.Namespace) -> tuple[dict, dict]:
    """(text_config, vision_config): the 8B's, with the sizes given overridden."""
    text, vision = dict(base["text_config"]), dict(base["vision_config"])
    for arg, key in TEXT_KEYS.items():
        if getattr(a, arg) is not None:
            text[key] = getattr(a, arg)
    for arg, key in VISION_KEYS.items():
        if getattr(a, arg) is not None:
            vision[key] = getattr(a, arg)
    half = text["head_dim"] // 2  # M-RoPE's sections (t, h, w) sum to head_dim / 2: 8B's 24/20/20
    hw = half * 5 // 16
    rope = text.pop("rope_scaling", None) or {}
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": text.pop("rope_theta", 5e6),
                               "mrope_section": [half - 2 * hw, hw, hw],
                               "mrope_interleaved": rope.get("mrope_interleaved", True)}
    depth = vision["depth"]
    vision["deepstack_visual_indexes"] = [(k + 1) * depth // 4 for k in range(min(3, depth))] \
        if depth >= 4 else list(range(min(3, depth)))  # the 8B's 3 mergers, spread as its 8/16/24
    vision["out_hidden_size"] = text["hidden_size"]
    return text, vision


def build(folder: Path, a: argparse.Namespace) -> None:
    """Write the random checkpoint into `folder` (child process: `--build`)."""
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from marscli.qwen.policy import quiet_transformers
    from marscli.qwen.tiny import PAD_TOKEN, make_processor, make_tokenizer

    quiet_transformers()
    base = json.loads(CONFIG_8B.read_text())
    text, vision = model_config(base, a)
    tok = make_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in
           ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>", PAD_TOKEN)}
    text.update(pad_token_id=ids[PAD_TOKEN], dtype="bfloat16")
    for k in ("bos_token_id", "eos_token_id"):  # the real vocabulary's ids: not this tokenizer's
        text.pop(k, None)
    cfg = Qwen3VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False, dtype="bfloat16",
        architectures=["Qwen3VLForConditionalGeneration"])
    torch.manual_seed(a.seed)
    with torch.device(a.build_device):  # random init on the GPU: seconds, not minutes
        model = Qwen3VLForConditionalGeneration(cfg)
    model.to(torch.bfloat16).save_pretrained(folder)
    make_processor(tok).save_pretrained(folder)


def probe() -> dict:
    """The accelerator this process sees (child process: `--probe`)."""
    import torch

    if not torch.cuda.is_available():
        return {"device_name": "cpu", "gpus": 0, "gpu_memory": None}
    p = torch.cuda.get_device_properties(0)
    return {"device_name": p.name, "gpus": torch.cuda.device_count(),
            "gpu_memory": p.total_memory}


def child(a: argparse.Namespace, *flags: str) -> dict:
    """Run this file in a child process (`--build DIR` / `--probe`), its JSON answer."""
    args = [sys.executable, __file__, *flags, "--seed", str(a.seed),
            "--build-device", a.build_device]
    for arg in (*TEXT_KEYS, *VISION_KEYS):
        if getattr(a, arg) is not None:
            args += [f"--{arg.replace('_', '-')}", str(getattr(a, arg))]
    out = subprocess.run(args, check=True, stdout=subprocess.PIPE, env=child_env(a)).stdout
    return json.loads(out.decode().strip().splitlines()[-1])


def checkpoint(a: argparse.Namespace, work: Path) -> tuple[Path, float]:
    """The model's folder in `work` (built unless a run with these shapes left it), and the
    seconds building it took (0 when reused)."""
    key = "-".join(f"{k}{getattr(a, k)}" for k in (*TEXT_KEYS, *VISION_KEYS)
                   if getattr(a, k) is not None)
    folder = work / f"model-{key or 'default'}-s{a.seed}"
    if (folder / "config.json").is_file():
        return folder, 0.0
    t0 = time.perf_counter()
    tmp = folder.with_name(folder.name + f".tmp-{os.getpid()}")
    child(a, "--build", str(tmp))
    tmp.rename(folder)
    return folder, time.perf_counter() - t0


# ------------------------------------------------------------------------------ the rows


def row_shapes(a: argparse.Namespace) -> list[tuple[int, int]]:
    """(tokens, loss tokens) of the two rows of a micro-batch."""
    out = []
    for n in (a.tokens // 2, a.tokens // 2 - 1):
        loss = min(max(1, round(n * a.loss_frac)), n - 1)
        out.append((n, loss))
    return out


def write_rows(path: Path, a: argparse.Namespace, vocab: int, steps: int) -> None:
    """`steps` minibatches of 2 x nproc rows (row_shapes), random token ids past the tiny
    tokenizer's specials and tags (ids 0-16), no images, no engine log-probs (π_old is
    recomputed, as update does by default)."""
    rng = random.Random(a.seed)
    rows = []
    for step in range(steps):
        for r in range(a.nproc):
            for j, (n, loss) in enumerate(row_shapes(a)):
                toks = [rng.randrange(17, vocab) for _ in range(n)]
                rows.append({"v": 1, "id": f"s{step}-r{r}-{j}", "minibatch": step,
                             "advantage": rng.choice((-1.0, 1.0)), "images": [],
                             "segments": [
                                 {"role": "prompt", "tokens": toks[:n - loss], "images": []},
                                 {"role": "model", "tokens": toks[n - loss:], "logprobs": None}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def step_flops(text: dict, a: argparse.Namespace) -> float:
    """Model FLOPs of one optimiser step (module docstring), all ranks."""
    h, f, L, V = (text[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                    "vocab_size"))
    q = text["num_attention_heads"] * text["head_dim"]
    kv = text["num_key_value_heads"] * text["head_dim"]
    p_layer = h * (q + 2 * kv) + q * h + 3 * h * f
    per_rank = sum(6 * L * p_layer * n + 6 * V * h * loss + 12 * L * q * n * n
                   for n, loss in row_shapes(a))
    return float(per_rank * a.nproc)


# ------------------------------------------------------------------------------ running


def child_env(a: argparse.Namespace) -> dict:
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    if a.device == "cpu" and a.nproc > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def marscli_cmd(a: argparse.Namespace, nproc: int) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "marscli"]
    from socket import socket

    with socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            "--master_port", str(port), "-m", "marscli"]


def update(a: argparse.Namespace, adv: Path, policy: Path, out: Path) -> dict:
    """Run `marscli update`; its metrics rows, sidecar stats, wall seconds and peak RSS (the
    process tree's largest, ru_maxrss). Its log goes to stderr as it runs."""
    cmd = [*marscli_cmd(a, a.nproc), "update", str(adv), "--policy", str(policy),
           "--out", str(out), "--force", "--lr", "1e-6", "--seed", str(a.seed),
           "--micro-batch-tokens", str(a.tokens), "--save-dtype", "bfloat16"]
    cmd += ["--device", a.device] if a.device == "cpu" else []
    cmd += ["--gradient-checkpointing"] if a.gradient_checkpointing else []
    cmd += ["--deepspeed", a.deepspeed] if a.deepspeed else []
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, env=child_env(a))
    _, status, usage = os.wait4(p.pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise SystemExit(f"bench_update_gpu: update exited {code}: {' '.join(cmd)}")
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    stats = json.loads((out / "marscli.meta.json").read_text())["stats"]
    return {"metrics": metrics, "stats": stats, "wall": time.perf_counter() - t0,
            "peak_rss": usage.ru_maxrss * 1024}


def plan(a: argparse.Namespace, policy: Path, gpu_memory: int | None) -> dict:
    """`marscli plan --json` for the run's shape."""
    mem = f"{gpu_memory // 2**20}MiB" if gpu_memory else "80GiB"
    cmd = [sys.executable, "-m", "marscli", "plan", str(policy), "--json",
           "--gpus-per-node", str(a.nproc), "--micro-batch-tokens", str(a.tokens),
           "--loss-tokens", str(sum(loss for _, loss in row_shapes(a))), "--image-tokens", "0",
           "--gpu-memory", mem]
    cmd += ["--deepspeed", a.deepspeed] if a.deepspeed else ["--zero", "0"]
    cmd += ["--gradient-checkpointing"] if a.gradient_checkpointing else []
    res = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, env=child_env(a))
    return json.loads(res.stdout)


def throughput(metrics: list[dict]) -> tuple[float, float, int]:
    """(tokens, seconds, steps) over the steps after the first (all of them if only one)."""
    rows = metrics[1:] or metrics
    return sum(m["tokens"] for m in rows), sum(m["seconds"] for m in rows), len(rows)


def peak_of(metrics: list[dict], key: str) -> int | None:
    values = [m.get(key) for m in metrics if m.get(key) is not None]
    return max(values) if values else None


# ------------------------------------------------------------------------------ the report


def measure(a: argparse.Namespace, work: Path) -> dict:
    info = child(a, "--probe")
    cuda = a.device != "cpu"
    if cuda and not info["gpus"]:
        raise SystemExit("bench_update_gpu: no CUDA device — run with --device cpu")
    policy, build_s = checkpoint(a, work)
    text = json.loads((policy / "config.json").read_text())["text_config"]
    p = plan(a, policy, info["gpu_memory"])
    t = p["trainer"]
    context = p["assumptions"]["cuda_context"]
    res = {"bench": "update_gpu", "device": a.device, "device_name": info["device_name"],
           "ranks": a.nproc, "deepspeed": a.deepspeed, "zero": t["stage"],
           "gradient_checkpointing": a.gradient_checkpointing,
           "layers": text["num_hidden_layers"], "hidden": text["hidden_size"],
           "vocab": text["vocab_size"],
           "params": p["model"]["total"], "params_text": p["model"]["text"],
           "params_vision": p["model"]["vision"], "micro_batch_tokens": a.tokens,
           "loss_tokens": sum(loss for _, loss in row_shapes(a)),
           "blank_image_row": bool(a.deepspeed) and a.nproc > 1, "build_seconds": round(build_s, 1),
           "plan_peak": t["total"], "plan_phase": t["peak_phase"],
           "plan_model_states": t["model_states"], "plan_activations": t["activations"],
           "plan_context": context, "gpu_memory": info["gpu_memory"]}
    if cuda and a.fit_check and t["total"] > info["gpu_memory"]:
        res["skipped"] = (f"plan predicts {t['total'] / GiB:.1f} GiB, more than the GPU's "
                          f"{info['gpu_memory'] / GiB:.1f} GiB (--no-fit-check runs it)")
        return res
    adv = work / f"adv-{os.getpid()}.jsonl"
    write_rows(adv, a, min(text["vocab_size"], 4096), a.steps)
    out = work / f"out-{os.getpid()}"
    u = update(a, adv, policy, out)
    tokens, secs, n = throughput(u["metrics"])
    flops = step_flops(text, a) * n
    achieved = flops / secs / a.nproc if secs > 0 else 0.0  # per GPU
    peak_tflops = a.peak_tflops if a.peak_tflops is not None else (
        PEAK_TFLOPS_DEFAULT if cuda else None)
    alloc, reserved = (peak_of(u["metrics"], k) for k in ("gpu_peak_allocated",
                                                         "gpu_peak_reserved"))
    res.update({
        "steps": len(u["metrics"]), "steps_timed": n, "tokens_per_s": tokens / secs,
        "tflops_per_gpu": achieved / 1e12, "peak_tflops": peak_tflops,
        "mfu": achieved / (peak_tflops * 1e12) if peak_tflops else None,
        "flops_per_step": step_flops(text, a),
        "gpu_peak_allocated": alloc, "gpu_peak_reserved": reserved,
        "peak_rss": u["peak_rss"], "update_wall_seconds": round(u["wall"], 1),
        "plan_ratio": alloc / (t["total"] - context) if alloc else None,
        "plan_ratio_reserved": reserved / (t["total"] - context) if reserved else None,
        "load_seconds": u["stats"]["load_seconds"], "save_seconds": u["stats"]["save_seconds"],
        "master_save_seconds": u["stats"]["master_save_seconds"],
        "master_bytes": sum(f.stat().st_size
                            for f in (out / "train_state").glob("master-rank-*.safetensors")),
        "bytes_written": u["stats"]["bytes_written"]})
    if not cuda:
        res["plan_note"] = ("no GPU allocator on CPU: peak_rss (interpreter, libraries and host "
                            "copies included) is not plan's GPU figure, no ratio")
    if a.resume:
        one = work / f"adv1-{os.getpid()}.jsonl"
        one.write_text(adv.read_text().splitlines()[0] + "\n")
        r = update(a, one, out, work / f"resumed-{os.getpid()}")
        res.update({"resume_load_seconds": r["stats"]["load_seconds"],
                    "master_load_seconds": r["stats"]["master_load_seconds"]})
    for f in work.glob(f"*-{os.getpid()}*"):  # the outputs (GBs at 8B shapes); the model stays
        shutil.rmtree(f) if f.is_dir() else f.unlink()
    return res


def _gib(n: float | None) -> str:
    return f"{n / GiB:.2f} GiB" if n is not None else "n/a"


def table(r: dict) -> str:
    head = (f"update at Qwen3-VL-8B layer shapes: {r['layers']} layers, {r['params'] / 1e9:.3f}B "
            f"parameters (text {r['params_text'] / 1e9:.3f}B, vision "
            f"{r['params_vision'] / 1e9:.3f}B); {r['ranks']} rank(s) on {r['device_name']}, "
            f"{'ZeRO-' + str(r['zero']) if r['deepspeed'] else 'plain torch'}"
            f"{', gradient checkpointing' if r['gradient_checkpointing'] else ''}; micro-batch "
            f"{r['micro_batch_tokens']:,} tokens ({r['loss_tokens']:,} under the loss)")
    plan_line = (f"  plan: peak {_gib(r['plan_peak'])} at the {r['plan_phase']} (model states "
                 f"{_gib(r['plan_model_states'])}, activations {_gib(r['plan_activations'])}, "
                 f"CUDA context {_gib(r['plan_context'])})")
    if "skipped" in r:
        return "\n".join([head, plan_line, f"  skipped: {r['skipped']}"]) + "\n"
    mfu = f"{100 * r['mfu']:.1f}% of {r['peak_tflops']:g} TFLOPS" if r["mfu"] is not None \
        else "n/a (no --peak-tflops on CPU)"
    ratio = (f"{r['plan_ratio']:.2f} allocated, {r['plan_ratio_reserved']:.2f} reserved"
             if r["plan_ratio"] is not None else r.get("plan_note", "n/a"))
    lines = [head,
             f"  throughput: {r['tokens_per_s']:,.0f} tokens/s over {r['steps_timed']} step(s) "
             f"after the first; {r['tflops_per_gpu']:.2f} TFLOPS a GPU; MFU {mfu}",
             f"  measured peak: allocated {_gib(r['gpu_peak_allocated'])}, reserved "
             f"{_gib(r['gpu_peak_reserved'])}, process RSS {_gib(r['peak_rss'])}",
             plan_line,
             f"  measured / (plan - context): {ratio}",
             f"  checkpoint: load {r['load_seconds']:.1f} s (HF bf16), save "
             f"{r['save_seconds']:.1f} s ({r['bytes_written'] / GiB:.2f} GiB; fp32 masters "
             f"{r['master_bytes'] / GiB:.2f} GiB in {r['master_save_seconds']:.1f} s)"]
    if "resume_load_seconds" in r:
        lines.append(f"  resume from the masters: load {r['resume_load_seconds']:.1f} s, of it "
                     f"masters {r['master_load_seconds']:.1f} s")
    return "\n".join(lines) + "\n"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None,
                    help="default: cuda if torch sees one (asked in a child process)")
    ap.add_argument("--nproc", type=int, default=1, help="update's ranks (torchrun)")
    ap.add_argument("--deepspeed", help="update's --deepspeed config, e.g. recipes/ds_zero3.json")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--tokens", type=int, help="--micro-batch-tokens (two rows of half each)")
    ap.add_argument("--loss-frac", type=float, default=0.5, help="share of a row under the loss")
    ap.add_argument("--steps", type=int, help="optimiser steps (minibatches)")
    ap.add_argument("--peak-tflops", type=float,
                    help=f"the GPU's dense bf16 peak (default {PEAK_TFLOPS_DEFAULT:g} on CUDA)")
    ap.add_argument("--no-resume", dest="resume", action="store_false",
                    help="skip the second update that reads the masters back")
    ap.add_argument("--no-fit-check", dest="fit_check", action="store_false",
                    help="run even when plan says the GPU is too small")
    ap.add_argument("--work", help="folder for the model, rows and outputs (default: a temp "
                    "folder); the model is reused across runs with the same shapes")
    ap.add_argument("--seed", type=int, default=0)
    for arg, key in (*TEXT_KEYS.items(), *VISION_KEYS.items()):
        part = "vision_config" if arg in VISION_KEYS else "text_config"
        ap.add_argument(f"--{arg.replace('_', '-')}", type=int,
                        help=f"{part}.{key} (default: the 8B's, or GPU_SHAPES' / CPU_SHAPES')")
    ap.add_argument("--build", metavar="DIR", help=argparse.SUPPRESS)
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--build-device", default="cpu", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def fill_defaults(a: argparse.Namespace, cuda: bool) -> None:
    """Sizes not given: the 8B's with GPU_SHAPES' layers on CUDA, CPU_SHAPES on CPU."""
    a.device = a.device or ("cuda" if cuda else "cpu")
    for k, v in (GPU_SHAPES if a.device == "cuda" else CPU_SHAPES).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.build_device = "cuda" if a.device == "cuda" else "cpu"
    if a.tokens < 4 or not 0 < a.loss_frac < 1 or a.steps < 1 or a.nproc < 1:
        raise SystemExit("bench_update_gpu: need --tokens >= 4, 0 < --loss-frac < 1, "
                         "--steps >= 1, --nproc >= 1")


def main(argv: list[str] | None = None) -> None:
    a = parse(argv)
    if a.probe:
        print(json.dumps(probe()))
        return
    if a.build:
        build(Path(a.build), a)
        print(json.dumps({"built": a.build}))
        return
    if a.device is None:
        a.device = "cuda" if child(a, "--probe")["gpus"] else "cpu"
    fill_defaults(a, a.device == "cuda")
    with tempfile.TemporaryDirectory(prefix="bench-update-gpu-") as tmp:
        work = Path(a.work) if a.work else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        r = measure(a, work)
    sys.stdout.write(table(r))
    print(json.dumps(r))


if __name__ == "__main__":
    main()
