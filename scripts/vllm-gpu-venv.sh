#!/usr/bin/env bash
# Build the CUDA venv (default .venv-gpu) that the GPU recipes' stages and servers run from:
# `make vllm-gpu` (recipes/_gpu.mk: GPU_VENV, STAGE_VENV, SERVE_MARSCLI; the walkthrough:
# docs/gpu.md "From an empty account to iteration 1").
#
# What it installs, in order:
#   1. PyPI's CUDA vllm==VLLM_VERSION with the torch and torchvision it pins (read from the
#      wheel's metadata: vllm 0.33.0 pins torch==2.14.0, torchvision==0.29.0) and transformers in
#      the range both vLLM (>=5.16.1,<5.21) and marscli (<5.20) accept. Not 0.34.0, PyPI's newest
#      (December 2026): it pins flashinfer-python==0.7.3, which PyPI does not serve, so pip cannot
#      resolve it (VLLM_VERSION=... TORCH_VERSION=... TORCHVISION_VERSION=... to choose another);
#   2. marscli's own dependencies and extras (pyproject.toml) except torch/torchvision, vllm and
#      ruff, under constraints that hold torch, torchvision and transformers where step 1 put
#      them: DeepSpeed with DS_BUILD_OPS=0 (its ops compile at first use; --ds-build-ops builds
#      them now, which needs nvcc and CUDA 13 headers);
#   3. marscli editable with --no-deps;
#   4. an import check: torch (a CUDA build, and a GPU when nvidia-smi exists), vllm, deepspeed,
#      marscli; it prints their versions, or one line saying what failed (exit 1).
#
# CUDA and the driver. torch 2.14.0's Linux wheel on PyPI is built for CUDA 13.0 (its metadata
# requires cuda-toolkit==13.0.3, nvidia-*-cu13; vllm 0.33.0 itself requires cu13 kernels:
# nvidia-cutlass-dsl[cu13]), and CUDA 13.x runs on NVIDIA Linux drivers >= 580 (NVIDIA, "CUDA
# Compatibility", minor version compatibility table: CUDA 13.x >= 580;
# https://docs.nvidia.com/deploy/cuda-compatibility/minor-version-compatibility.html; CUDA 13.0
# GA shipped with 580.65.06). When nvidia-smi exists, a driver older than MIN_DRIVER stops the
# script before any download (one line, exit 2); --skip-driver-check builds anyway (a login node
# whose driver differs from the compute nodes'). vLLM's own installation page still says its
# binaries are CUDA 12.9 (vllm-project/vllm, getting_started/installation/gpu.cuda.inc.md),
# which is what its cu129 index gives; the PyPI wheel installed here is the cu13 one, as its
# metadata says.
#
# Idempotent: a stamp file records the recipe; a finished venv with the same recipe is left
# alone, an unfinished one is completed (pip skips what is already there).
# Usage: scripts/vllm-gpu-venv.sh [--dry-run] [--skip-driver-check] [--ds-build-ops] [VENV_DIR]
#   --dry-run   print the driver check's verdict and the pip commands; install nothing (no network)
set -euo pipefail
cd "$(dirname "$0")/.."

DRY_RUN=0 DRIVER_CHECK=1 DS_OPS=0 VENV=.venv-gpu
for arg in "$@"; do
  case $arg in
    --dry-run) DRY_RUN=1 ;;
    --skip-driver-check) DRIVER_CHECK=0 ;;
    --ds-build-ops) DS_OPS=1 ;;
    -*) echo "vllm-gpu-venv: unknown option $arg (--dry-run, --skip-driver-check, --ds-build-ops)" >&2; exit 2 ;;
    *) VENV=$arg ;;
  esac
done

VLLM_VERSION=${VLLM_VERSION:-0.33.0}
TORCH_VERSION=${TORCH_VERSION:-2.14.0}  # vllm 0.33.0's pin: torch==2.14.0
TORCHVISION_VERSION=${TORCHVISION_VERSION:-0.29.0}  # and torchvision==0.29.0
TRANSFORMERS_SPEC='transformers>=5.16.1,<5.20'  # vllm 0.33.0: >=5.16.1,<5.21; marscli: <5.20
CUDA_VERSION=13.0  # torch 2.14.0's PyPI wheel (cuda-toolkit 13.0.3)
MIN_DRIVER=580     # NVIDIA: CUDA 13.x needs a Linux driver >= 580
say() { echo "vllm-gpu-venv: $*" >&2; }

# --- the driver, before anything is downloaded
if ((DRIVER_CHECK)) && command -v nvidia-smi >/dev/null; then
  driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1 | tr -d ' ')
  if [[ ! $driver =~ ^[0-9]+ ]]; then
    say "nvidia-smi gave no driver version ('$driver'): is this a GPU node? (--skip-driver-check builds anyway)"; exit 2
  elif ((${driver%%.*} < MIN_DRIVER)); then
    say "NVIDIA driver $driver is too old: torch $TORCH_VERSION (vllm $VLLM_VERSION) is built for CUDA $CUDA_VERSION, which needs >= $MIN_DRIVER — ask for a newer driver, or --skip-driver-check to build anyway"; exit 2
  fi
  say "NVIDIA driver $driver (>= $MIN_DRIVER for CUDA $CUDA_VERSION)"
elif ((DRIVER_CHECK)); then
  say "no nvidia-smi here: the driver is not checked (the compute nodes need >= $MIN_DRIVER for CUDA $CUDA_VERSION)"
fi

# DeepSpeed's ops: JIT-compiled at first use (DS_BUILD_OPS=0), or built now (--ds-build-ops).
export DS_BUILD_OPS=$DS_OPS
ISOLATION=  # DeepSpeed's build imports torch to compile its ops: the venv's own, then
[[ $DS_OPS == 1 ]] && ISOLATION='--no-build-isolation '
PY=$VENV/bin/python
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
# The requirements of step 2, from pyproject.toml (read with this machine's python3 >= 3.11).
python3 - "$WORK" "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION" "$TRANSFORMERS_SPEC" <<'EOF'
"""Write WORK/requirements.txt (marscli's dependencies and extras without torch, torchvision,
vllm and ruff) and WORK/constraints.txt (what step 1 installed stays)."""
import re, sys, tomllib

work, constraints = sys.argv[1], sys.argv[2:]
skip = {"torch", "torchvision", "vllm", "ruff"}
name = lambda req: re.split(r"[\s\[<>=!~;(]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")
with open("pyproject.toml", "rb") as f:
    proj = tomllib.load(f)["project"]
reqs = proj["dependencies"] + [r for extra in proj["optional-dependencies"].values() for r in extra]
ours = sorted({r for r in reqs if name(r) not in skip})
open(f"{work}/requirements.txt", "w").write("\n".join(ours) + "\n")
open(f"{work}/constraints.txt", "w").write("\n".join(constraints) + "\n")
EOF

STEPS=(
  "1/3 vllm==$VLLM_VERSION with torch==$TORCH_VERSION (CUDA $CUDA_VERSION) from PyPI"
  "2/3 marscli's dependencies and extras but torch (DS_BUILD_OPS=$DS_OPS)"
  "3/3 marscli (editable, --no-deps)"
)
CMDS=(
  "$PY -m pip install -q vllm==$VLLM_VERSION torch==$TORCH_VERSION torchvision==$TORCHVISION_VERSION '$TRANSFORMERS_SPEC'"
  "$PY -m pip install -q $ISOLATION-r $WORK/requirements.txt -c $WORK/constraints.txt"
  "$PY -m pip install -q --no-deps -e ."
)
if ((DRY_RUN)); then
  echo "test -x $PY || python3 -m venv $VENV"
  echo "export DS_BUILD_OPS=$DS_OPS PIP_FIND_LINKS="
  for c in "${CMDS[@]}"; do echo "$c"; done
  echo "# $WORK/requirements.txt:"; sed 's/^/#   /' "$WORK/requirements.txt"
  echo "# $WORK/constraints.txt:"; sed 's/^/#   /' "$WORK/constraints.txt"
  exit 0
fi

# The stamp holds the recipe and the hashes of this script and pyproject.toml (marscli's deps).
RECIPE="vllm==$VLLM_VERSION torch==$TORCH_VERSION torchvision==$TORCHVISION_VERSION $TRANSFORMERS_SPEC DS_BUILD_OPS=$DS_OPS
$(sha256sum scripts/vllm-gpu-venv.sh pyproject.toml | cut -c1-16)"
STAMP=$VENV/.installed
if [[ -f $STAMP && "$(cat "$STAMP")" == "$RECIPE" ]] && "$PY" -c "import vllm" 2>/dev/null; then
  say "$VENV is up to date (vllm==$VLLM_VERSION)"
  touch "$STAMP"  # for make: newer than its prerequisites again
  exit 0
fi

# PyPI's own torch (CUDA), never a local folder of +cpu wheels a pip configuration may name.
export PIP_FIND_LINKS= PIP_DISABLE_PIP_VERSION_CHECK=1
export PIP_NO_CACHE_DIR=1  # its ~4 GB of downloads once, in the venv, not twice
t0=$SECONDS
test -x "$PY" || { say "creating $VENV"; python3 -m venv "$VENV"; }
rm -f "$STAMP"
for i in "${!CMDS[@]}"; do
  say "[$((SECONDS - t0))s] ${STEPS[$i]}"
  eval "${CMDS[$i]}"
done

say "[$((SECONDS - t0))s] checking the imports"
GPU=0; command -v nvidia-smi >/dev/null && GPU=1
"$PY" - "$CUDA_VERSION" "$GPU" <<'EOF' || exit 1
import sys
cuda, gpu = sys.argv[1], sys.argv[2] == "1"
try:
    import torch, torch.cuda, transformers, vllm, deepspeed
    import marscli, marscli.engines.vllm  # noqa: F401
except Exception as e:  # one line: what did not import
    sys.exit(f"vllm-gpu-venv: FAIL import: {type(e).__name__}: {e}")
if not (torch.version.cuda or "").startswith(cuda.split(".")[0] + "."):
    sys.exit(f"vllm-gpu-venv: FAIL torch {torch.__version__} is built for CUDA "
             f"{torch.version.cuda}, not {cuda}")
if gpu and not torch.cuda.is_available():
    sys.exit(f"vllm-gpu-venv: FAIL torch {torch.__version__} (CUDA {torch.version.cuda}) sees no "
             "GPU although nvidia-smi exists: the driver is older than the CUDA build needs?")
where = f"{torch.cuda.device_count()} GPU(s)" if torch.cuda.is_available() else "no GPU here"
print(f"vllm-gpu-venv: vllm {vllm.__version__}, torch {torch.__version__} (CUDA "
      f"{torch.version.cuda}, {where}), deepspeed {deepspeed.__version__}, transformers "
      f"{transformers.__version__}, marscli {marscli.__path__[0]}")
EOF
echo "$RECIPE" >"$STAMP"
say "[$((SECONDS - t0))s] done: $VENV ($(du -sh "$VENV" | cut -f1))"
