#!/usr/bin/env bash
#SBATCH --job-name=marscli-update
# One policy update (GSPO/GRPO loss) on advantage rows; writes a new HF checkpoint.
# usage: stages/update.sh ADV POLICY OUT [marscli update options...]
# NPROC=N runs N processes with torchrun (add --deepspeed recipes/ds_zero2.json). As an sbatch
# job of several nodes (sbatch --nodes=K --ntasks-per-node=1, NNODES=K) it starts one torchrun
# agent per node with srun, NPROC processes each; see run_trainer in _common.sh.
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh" 2>/dev/null || source stages/_common.sh
adv=$1 policy=$2 out=$3; shift 3
run_trainer update "$adv" --policy "$policy" --out "$out" "$@"
