#!/usr/bin/env bash
# GPU smoke test of the `vllm` engine: CUDA vLLM against transformers on the tiny model.
#
# NOT RUN ON THE DEVELOPMENT MACHINES: they have no GPU (the CPU path is tested by
# `make test-vllm`). Run it on a machine with an NVIDIA GPU, CUDA drivers and a network:
#     bash scripts/gpu-smoke.sh            # a fresh .venv-gpu (VENV=... to choose)
#     USE_CURRENT_VENV=1 bash scripts/gpu-smoke.sh   # the active venv, as it is
# It prints a verdict line `gpu-smoke: PASS ...` or `gpu-smoke: FAIL ...` and exits 0 / 1.
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
#  5. runs benchmarks/bench_async.py (the asynchronous against the lock-step agent loop under a
#     heavy-tailed search delay) and benchmarks/bench_serve.py (`POST /reload` and a sleep and
#     wake in vLLM's sleep mode against a fresh engine, served against in-process tokens/s) on
#     CUDA vLLM, one GPU.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_SPEC=${VLLM_SPEC:-vllm}
BF16_TOL=${BF16_TOL:-0.1}  # bf16 engine vs fp32 forward, max abs log-prob diff
FP32_TOL=${FP32_TOL:-1e-3}  # fp32 vLLM vs fp32 forward
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

command -v nvidia-smi >/dev/null && nvidia-smi -L || { echo "gpu-smoke: FAIL no nvidia-smi: not a GPU machine" >&2; exit 1; }

if [[ -n ${USE_CURRENT_VENV:-} ]]; then
  PY=$(command -v python)
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
BIN=$(dirname "$PY")
"$PY" -c "import torch, vllm; assert torch.cuda.is_available(), 'torch sees no GPU'; \
print(f'gpu-smoke: vllm {vllm.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}')"

WORK=${WORK:-$(mktemp -d -t marscli-gpu-smoke-XXXX)}
echo "gpu-smoke: working in $WORK" >&2
test -f "$WORK/tiny/config.json" || "$BIN/marscli" tiny-model "$WORK/tiny"
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
  "$BIN/marscli" rollout "$WORK/prompts.jsonl" --policy "$WORK/tiny" --engine $engine \
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
    print(f"gpu-smoke: {'PASS' if ok else 'FAIL'} (bounds: fp32 {fp32_tol}, bf16 {bf16_tol})")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":  # vLLM spawns workers on GPUs
    main()
EOF
"$PY" "$WORK/compare.py" "$WORK" "$BF16_TOL" "$FP32_TOL"
"$BIN/python" benchmarks/bench_async.py --model "$WORK/tiny"
"$BIN/python" benchmarks/bench_serve.py --model "$WORK/tiny"
