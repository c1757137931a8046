#!/usr/bin/env bash
#SBATCH --job-name=marscli-eval
# Evaluate a policy on a benchmark. Resumable and shardable like rollout.
# usage: stages/eval.sh BENCH POLICY OUT [marscli eval options...]
# Slurm: sbatch --array=0-3 stages/eval.sh ...   (then: marscli merge OUT OUT.shard-*; marscli eval summarize OUT)
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh" 2>/dev/null || source stages/_common.sh
bench=$1 policy=$2; shard_args "$3"; engine_args; shift 3
exec $MARSCLI eval "$bench" --policy "$policy" -o "$SHARD_OUT" "${SHARD_OPTS[@]}" "$@" "${ENGINE_OPTS[@]}"
