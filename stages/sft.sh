#!/usr/bin/env bash
#SBATCH --job-name=marscli-sft
#SBATCH --cpus-per-task=1
# Cold-start SFT on token-exact trajectories or message rows; resumable per epoch.
# usage: stages/sft.sh DATA POLICY OUT [marscli sft options...]   (NPROC=N: torchrun, as update.sh)
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh" 2>/dev/null || source stages/_common.sh
data=$1 policy=$2 out=$3; shift 3
if [ "${NPROC:-1}" -gt 1 ]; then
  PY=${PYTHON:-$(dirname "$(command -v "$MARSCLI")")/python}
  exec "$PY" -m torch.distributed.run --nproc_per_node "$NPROC" --master_port "${MASTER_PORT:-29512}" \
    -m marscli sft "$data" --policy "$policy" --out "$out" "$@"
fi
exec $MARSCLI sft "$data" --policy "$policy" --out "$out" "$@"
