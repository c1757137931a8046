#!/usr/bin/env bash
# GPU smoke test: CUDA vLLM against transformers on the tiny model, and `update` at
# Qwen3-VL-8B's layer shapes (MFU, peak memory against `marscli plan`, fp32 masters' save/load).
#
# NOT RUN ON A GPU YET: the development machines have none (the CPU paths are tested by
# `make test-vllm` and tests/loop/test_gpu_smoke.py). Run it on a machine with an NVIDIA GPU:
#     bash scripts/gpu-smoke.sh            # a fresh .venv-gpu with CUDA vLLM (needs a network)
#     USE_CURRENT_VENV=1 bash scripts/gpu-smoke.sh   # the active Python as it is (offline)
# Either way marscli comes from this checkout (PYTHONPATH=src), so USE_CURRENT_VENV runs on a
# machine with torch and transformers and no network; WHEELS=DIR installs DIR's wheels first
# (--no-index --no-deps: typer, rich, orjson, deepspeed, ... as the machine lacks them).
# Without vLLM, the vLLM parts (2-5) are skipped with one line and the update benchmark runs.
# It prints a verdict line `gpu-smoke: PASS ...` or `gpu-smoke: FAIL ...` and exits 0 / 1.
# DEVICE=cpu rehearses the script itself without a GPU (no vLLM parts, the update benchmark's
# CPU shapes): tests/loop/test_gpu_smoke.py runs it so.
#
# What it does:
#  1. installs CUDA vLLM (VLLM_SPEC, default `vllm`, which brings its own torch) and then
#     marscli with --no-deps plus its light dependencies (marscli pins the CPU machines' torch,
#     which need not be vLLM's);
#  2. builds the tiny model and a few image prompts;
#  3. `marscli rollout --engine vllm --device cuda` and `--engine hf --device cuda` (bfloat16);
#  4. teacher-forces every trajectory through transformers in float32 on the GPU and compares
#     the recorded log-probs (bf16 engines: loose bound), then samples from a float32 vLLM
#     engine directly and compares again (tight bound, the same check as the CPU tests);
#  5. runs bench/bench_async.py (the asynchronous against the lock-step agent loop under a
#     heavy-tailed search delay) and bench/bench_serve.py (`POST /reload` and a sleep and
#     wake in vLLM's sleep mode against a fresh engine, served against in-process tokens/s) on
#     CUDA vLLM, one GPU;
#  6. runs bench/bench_update_gpu.py: a random Qwen3-VL with the 8B's widths and
#     UPDATE_LAYERS (4) text layers; `update` on one GPU (plain torch, bf16 autocast) at each
#     micro-batch of UPDATE_RUNS (tokens, `:gc` for gradient checkpointing), the first run also
#     timing a second update that reads the fp32 masters back. `update` computes the log-probs
#     in chunks of the vocabulary's default (train/logprobs.py: 1024 positions at Qwen's), so
#     the 8k and 32k runs measure the chunked path's peak beside plan's figure for it (the
#     [N, V] logits plan used to count are gone); with several GPUs one more run
#     over all of them under torchrun (ZeRO-3 when DeepSpeed imports); then one line per run:
#     tokens/s, MFU, and the measured peak against `marscli plan`'s. A run plan says does not
#     fit the GPU is skipped. Estimated 4-6 minutes on one H100 (never timed: no GPU yet).
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_SPEC=${VLLM_SPEC:-vllm==0.33.0}  # 0.34.0 pins a flashinfer that PyPI does not serve (scripts/vllm-gpu-venv.sh)
BF16_TOL=${BF16_TOL:-0.1}  # bf16 engine vs fp32 forward, max abs log-prob diff
FP32_TOL=${FP32_TOL:-1e-3}  # fp32 vLLM vs fp32 forward
DEVICE=${DEVICE:-cuda}
UPDATE_LAYERS=${UPDATE_LAYERS:-4}
UPDATE_RUNS=${UPDATE_RUNS:-"8192 16384 32768:gc"}
UPDATE_TIMEOUT=${UPDATE_TIMEOUT:-300}  # seconds, each update benchmark run
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

if [[ $DEVICE == cuda ]]; then
  command -v nvidia-smi >/dev/null && nvidia-smi -L || { echo "gpu-smoke: FAIL no nvidia-smi: not a GPU machine" >&2; exit 1; }
fi

if [[ -n ${USE_CURRENT_VENV:-} ]]; then
  PY=$(command -v python3 || command -v python)
  if [[ -n ${WHEELS:-} ]]; then
    "$PY" -m pip install -q --no-index --no-deps --find-links "$WHEELS" "$WHEELS"/*.whl
  fi
else
  VENV=${VENV:-.venv-gpu}
  test -x "$VENV/bin/python" || python3 -m venv "$VENV"
  PY=$VENV/bin/python
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q "$VLLM_SPEC"
  "$PY" -m pip install -q --no-deps -e .
  "$PY" -m pip install -q "typer>=0.26,<1" "rich>=13" "orjson>=3.9" "pillow>=10" "requests>=2.31" \
    "safetensors>=0.4" "numpy>=1.26"
fi
MARSCLI=("$PY" -m marscli)
"$PY" - "$DEVICE" <<'EOF' || { echo "gpu-smoke: FAIL marscli's dependencies (WHEELS=DIR installs wheels)"; exit 1; }
import importlib.util, sys
need = ("torch", "transformers", "typer", "rich", "orjson", "PIL", "requests", "safetensors",
        "numpy", "tokenizers")
missing = [m for m in need if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"gpu-smoke: missing Python packages: {', '.join(missing)}")
import torch, transformers
assert torch.cuda.is_available() or sys.argv[1] == "cpu", "torch sees no GPU"
gpus = torch.cuda.device_count()
print(f"gpu-smoke: torch {torch.__version__}, transformers {transformers.__version__}, "
      + (f"{gpus} x {torch.cuda.get_device_name()}" if gpus else "no GPU"))
EOF
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")

WORK=${WORK:-$(mktemp -d -t marscli-gpu-smoke-XXXX)}
echo "gpu-smoke: working in $WORK" >&2
VLLM_RESULT="skipped, vllm does not import"
if [[ $DEVICE == cpu ]]; then
  VLLM_RESULT="skipped, DEVICE=cpu"
  echo "gpu-smoke: DEVICE=cpu: skipping the vLLM parts, the update benchmark at its CPU shapes"
elif ! "$PY" -c "import vllm; print(f'gpu-smoke: vllm {vllm.__version__}')" 2>/dev/null; then
  echo "gpu-smoke: vllm does not import: skipping the vLLM parts (rollouts, log-prob comparison, bench_async, bench_serve)"
else
test -f "$WORK/tiny/config.json" || "${MARSCLI[@]}" tiny-model "$WORK/tiny"
"$PY" - "$WORK" <<'EOF'
import sys
from pathlib import Path
import orjson
from PIL import Image, ImageDraw
work = Path(sys.argv[1])
rows = []
for i, (w, h) in enumerate([(640, 480), (1024, 768), (480, 640), (1600, 1200)]):
    im = Image.new("RGB", (w, h), (40, 40, 40))
    ImageDraw.Draw(im).rectangle([w // 2, h // 2, w // 2 + w // 5, h // 2 + h // 8], fill=(200, 30, 30))
    im.save(work / f"img{i}.png")
    rows.append({"v": 1, "id": f"q{i}", "image": f"img{i}.png", "question": "Where is the red box?",
                 "answer": ["bottom right"]})
(work / "prompts.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
EOF

for engine in vllm hf; do
  rm -rf "$WORK/$engine.jsonl" "$WORK/$engine.media"
  t0=$SECONDS
  "${MARSCLI[@]}" rollout "$WORK/prompts.jsonl" --policy "$WORK/tiny" --engine $engine \
    --device cuda -n 2 --max-turns 3 --max-turn-tokens 48 --seed 1 -o "$WORK/$engine.jsonl"
  echo "gpu-smoke: rollout --engine $engine --device cuda: $((SECONDS - t0)) s" >&2
done

cat >"$WORK/compare.py" <<'EOF'
"""Teacher-force the rollouts through transformers (fp32, cuda); then fp32 vLLM directly."""
import sys
from pathlib import Path


def forward_logprobs(model, proc, ids, input_ids, images):
    import torch
    from marscli.qwen.tokens import image_features

    feats = [image_features(proc, im) for im in images]
    x = torch.tensor([input_ids], device="cuda")
    kw = {"mm_token_type_ids": (x == ids.image_pad).int()}
    if feats:
        kw["pixel_values"] = torch.cat([f.pixel_values for f in feats]).to("cuda")
        kw["image_grid_thw"] = torch.stack([f.grid_thw for f in feats]).to("cuda")
    model.model.rope_deltas = None
    with torch.no_grad():
        logits = model(input_ids=x, **kw).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None])[:, 0].tolist()


def check_file(path, model, proc, ids):
    import orjson
    from PIL import Image
    from marscli.qwen.tokens import assemble

    worst, n_tok, n_traj = 0.0, 0, 0
    for line in Path(path).read_bytes().splitlines():
        rec = orjson.loads(line)
        seq = assemble(rec["segments"], ids.image_pad)
        for s in rec["segments"]:
            if s["role"] == "model" and set(s["tokens"]) & set(ids.vision):
                sys.exit(f"gpu-smoke: FAIL {path}: {rec['id']} sampled a vision placeholder")
        images = [Image.open(Path(path).parent / im["path"]).convert("RGB") for im in rec["images"]]
        lp = forward_logprobs(model, proc, ids, seq.input_ids, images)
        pairs = [(a, b) for a, b, m in zip(seq.model_logprobs[1:], lp, seq.loss_mask[1:]) if m]
        worst = max([worst] + [abs(a - b) for a, b in pairs])
        n_tok += len(pairs)
        n_traj += 1
    return worst, n_tok, n_traj


def main():
    work, bf16_tol, fp32_tol = Path(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
    from PIL import Image
    from marscli.engines import GenRequest, SamplingParams, make_engine
    from marscli.qwen.policy import load_model
    from marscli.qwen.tokens import encode_parts, expand, image_features, prompt_parts

    # fp32 vLLM first, before this process touches CUDA itself
    eng = make_engine("vllm", str(work / "tiny"), device="cuda", dtype="float32",
                      gpu_memory_utilization=0.3, max_model_len=8192)
    proc, ids = eng.processor, eng.ids
    images = [Image.open(work / f"img{i}.png").convert("RGB") for i in (0, 1)]
    feats = [image_features(proc, im) for im in images]
    toks = encode_parts(proc.tokenizer, ids, prompt_parts("You are careful.", "Compare <image> and <image>.",
                                                          [f.n_tokens for f in feats]))
    gens = eng.generate([GenRequest(toks, feats, 48) for _ in range(4)], SamplingParams(seed=2))
    model = load_model(str(work / "tiny"), device="cuda", dtype="float32")
    full = expand(toks, ids.image_pad)
    fp32_worst = 0.0
    for g in gens:
        if set(g.tokens) & set(ids.vision):
            sys.exit("gpu-smoke: FAIL fp32 vLLM sampled a vision placeholder")
        lp = forward_logprobs(model, proc, ids, full + g.tokens, images)[len(full) - 1:]
        fp32_worst = max([fp32_worst] + [abs(a - b) for a, b in zip(g.logprobs, lp)])
    results = {e: check_file(work / f"{e}.jsonl", model, proc, ids) for e in ("vllm", "hf")}
    for e, (worst, n_tok, n_traj) in results.items():
        print(f"gpu-smoke: {e} rollout (bf16): {n_traj} trajectories, {n_tok} model tokens, "
              f"max |logprob - fp32 forward| = {worst:.2e}")
    print(f"gpu-smoke: vllm fp32 direct: max |logprob - fp32 forward| = {fp32_worst:.2e}")
    ok = (fp32_worst < fp32_tol and all(w < bf16_tol and t > 0 for w, t, _ in results.values()))
    print(f"gpu-smoke: log-probs {'PASS' if ok else 'FAIL'} (bounds: fp32 {fp32_tol}, "
          f"bf16 {bf16_tol})")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":  # vLLM spawns workers on GPUs
    main()
EOF
if "$PY" "$WORK/compare.py" "$WORK" "$BF16_TOL" "$FP32_TOL"; then VLLM_RESULT=PASS; else VLLM_RESULT=FAIL; fi
"$PY" bench/bench_async.py --model "$WORK/tiny" || VLLM_RESULT="$VLLM_RESULT, bench_async FAIL"
"$PY" bench/bench_serve.py --model "$WORK/tiny" || VLLM_RESULT="$VLLM_RESULT, bench_serve FAIL"
fi

# 6. update at 8B layer shapes: each run prints a table, then its JSON line (kept in BENCH_JSON)
BENCH_JSON=$WORK/update-bench.jsonl
: >"$BENCH_JSON"
UPDATE_FAILED=0
bench_update() {
  local out rc=0
  out=$(timeout "$UPDATE_TIMEOUT" "$PY" bench/bench_update_gpu.py --device "$DEVICE" \
    --layers "$UPDATE_LAYERS" --work "$WORK/update" "$@") || rc=$?
  if (( rc == 0 )); then
    printf '%s\n' "$out" | sed '$d'
    printf '%s\n' "$out" | tail -n 1 >>"$BENCH_JSON"
  else
    echo "gpu-smoke: update benchmark FAILED (exit $rc): bench_update_gpu.py $*"
    UPDATE_FAILED=$((UPDATE_FAILED + 1))
  fi
}
resume=()
for run in $UPDATE_RUNS; do
  gc=()
  [[ $run == *:gc ]] && gc=(--gradient-checkpointing)
  bench_update --tokens "${run%%:*}" "${gc[@]}" "${resume[@]}"
  resume=(--no-resume)  # the masters' read-back is timed once
done
if (( NGPU > 1 )); then
  ds=()
  "$PY" -c "import deepspeed" 2>/dev/null && ds=(--deepspeed recipes/ds_zero3.json)
  bench_update --nproc "$NGPU" --tokens 16384 --no-resume "${ds[@]}"
fi
"$PY" - "$BENCH_JSON" <<'EOF'
"""One line per update run: throughput, MFU, the measured peak against plan's."""
import json, sys
G = 2 ** 30
for line in open(sys.argv[1]):
    r = json.loads(line)
    what = (f"{r['ranks']} x {r['device_name']}, {r['layers']} layers, "
            f"{r['micro_batch_tokens']:,} tokens{' +gc' if r['gradient_checkpointing'] else ''}"
            f"{', ZeRO-%s' % r['zero'] if r['deepspeed'] else ''}")
    if "skipped" in r:
        print(f"gpu-smoke: update {what}: skipped: {r['skipped']}")
        continue
    mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
    if r["gpu_peak_allocated"] is None:  # CPU: no allocator peak, no ratio
        peak = f"peak RSS {r['peak_rss'] / G:.2f} GiB (no ratio on CPU)"
    else:
        peak = (f"peak allocated {r['gpu_peak_allocated'] / G:.1f} GiB (reserved "
                f"{r['gpu_peak_reserved'] / G:.1f})")
    print(f"gpu-smoke: update {what}: {r['tokens_per_s']:,.0f} tokens/s, MFU {mfu}; {peak}; "
          f"plan {r['plan_peak'] / G:.2f} GiB with {r['plan_context'] / G:.0f} GiB context"
          + (f": measured / (plan - context) {r['plan_ratio']:.2f}"
             if r["plan_ratio"] is not None else ""))
    if "master_load_seconds" in r:
        print(f"gpu-smoke: fp32 masters {r['master_bytes'] / G:.2f} GiB: saved in "
              f"{r['master_save_seconds']:.1f} s, read back in {r['master_load_seconds']:.1f} s")
EOF

if [[ $VLLM_RESULT == *FAIL* ]] || (( UPDATE_FAILED > 0 )); then
  echo "gpu-smoke: FAIL (vLLM: $VLLM_RESULT; update benchmark: $UPDATE_FAILED run(s) failed)"
  exit 1
fi
echo "gpu-smoke: PASS (vLLM: $VLLM_RESULT; update benchmark: $(wc -l <"$BENCH_JSON") run(s))"
