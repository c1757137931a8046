#!/usr/bin/env bash
# Build the peers venv (default .venv-peers) for bench/bench_peers.py: `make peers-venv`.
#
# TRL's GRPOTrainer beside marscli, on the libraries marscli's numbers were measured with:
#   1. torch==2.14.1 + torchvision==0.29.1 (the pair `make setup` installs; from the machine's
#      package mirror when it has one, as pip's own configuration says);
#   2. marscli (editable) with its light dependencies, under constraints.txt (transformers,
#      numpy, tokenizers ... as in .venv: the two sides must run the same model code);
#   3. TRL_VERSION (TRL's release when this was written) and what it needs (accelerate,
#      datasets, pandas, ...), constraints.txt still holding the shared libraries in place;
#   4. py-spy, to profile either side (`py-spy record -o flame.svg -- python ...`).
# Idempotent: a stamp records the recipe; a finished venv with the same recipe is left alone.
# Usage: scripts/peers-venv.sh [VENV_DIR]   (VENV_DIR relative to the repository root)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${1:-.venv-peers}
TRL_VERSION=1.16.0
RECIPE="trl==$TRL_VERSION torch==2.14.1 torchvision==0.29.1
$(sha256sum scripts/peers-venv.sh pyproject.toml constraints.txt | cut -c1-16)"
STAMP=$VENV/.installed

if [[ -f $STAMP && "$(cat "$STAMP")" == "$RECIPE" ]] && "$VENV/bin/python" -c "import trl" 2>/dev/null; then
  echo "peers-venv: $VENV is up to date (trl==$TRL_VERSION)" >&2
  touch "$STAMP"  # for make: newer than its prerequisites again
  exit 0
fi

export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
PY=$VENV/bin/python
PIP=("$PY" -m pip install -q -c constraints.txt)
t0=$SECONDS
step() { echo "peers-venv: [$((SECONDS - t0))s] $*" >&2; }

test -x "$PY" || { step "creating $VENV"; python3 -m venv "$VENV"; }
rm -f "$STAMP"
step "1/4 torch==2.14.1 torchvision==0.29.1"
"${PIP[@]}" torch==2.14.1 torchvision==0.29.1
step "2/4 marscli (editable) and its dependencies"
"${PIP[@]}" -e '.[dev]'
step "3/4 trl==$TRL_VERSION and its requirements"
"${PIP[@]}" "trl==$TRL_VERSION"
step "4/4 py-spy (profiles)"
"${PIP[@]}" py-spy

step "checking the imports"
"$PY" - <<'EOF'
import torch, transformers, trl
from trl import GRPOConfig, GRPOTrainer  # noqa: F401
import marscli.engines.hf  # noqa: F401
print(f"peers-venv: trl {trl.__version__}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}")
EOF
echo "$RECIPE" >"$STAMP"
step "done: $VENV ($(du -sh "$VENV" | cut -f1))"
