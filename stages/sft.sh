#!/usr/bin/env bash
#SBATCH --job-name=marscli-sft
# Cold-start SFT on token-exact trajectories or message rows; resumable per epoch.
# usage: stages/sft.sh DATA POLICY OUT [marscli sft options...]
# NPROC=N processes a node and NNODES=K nodes under Slurm, as update.sh.
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh" 2>/dev/null || source stages/_common.sh
data=$1 policy=$2 out=$3; shift 3
run_trainer sft "$data" --policy "$policy" --out "$out" "$@"
