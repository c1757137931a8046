#!/usr/bin/env bash
#SBATCH --job-name=marscli-rollout
# Sample G trajectories per prompt with tools. Resumable: re-running skips ids already written.
# usage: stages/rollout.sh PROMPTS POLICY OUT [marscli rollout options...]
# Slurm: sbatch --array=0-3 stages/rollout.sh ...   (then: marscli merge OUT OUT.shard-*)
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh" 2>/dev/null || source stages/_common.sh
prompts=$1 policy=$2; shard_args "$3"; engine_args; shift 3
exec $MARSCLI rollout "$prompts" --policy "$policy" -o "$SHARD_OUT" "${SHARD_OPTS[@]}" "$@" "${ENGINE_OPTS[@]}"
