# Sourced by every stage script: the marscli to run, threads matched to the job's CPUs, and
# shard arguments when the script runs as one task of a Slurm array.
set -euo pipefail
MARSCLI=${MARSCLI:-marscli}
if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then
  export OMP_NUM_THREADS=$SLURM_CPUS_PER_TASK MKL_NUM_THREADS=$SLURM_CPUS_PER_TASK
fi
# In an array job, task i of N writes OUT.shard-i and works on --shard i/N; `marscli merge`
# joins the shards afterwards. Outside an array, the stage writes OUT itself.
shard_args() {  # usage: shard_args OUT  → sets SHARD_OUT and SHARD_OPTS
  SHARD_OUT=$1
  SHARD_OPTS=()
  if [ -n "${SLURM_ARRAY_TASK_ID:-}" ]; then
    local n=${SLURM_ARRAY_TASK_COUNT:-$(( SLURM_ARRAY_TASK_MAX - SLURM_ARRAY_TASK_MIN + 1 ))}
    SHARD_OUT="$1.shard-$SLURM_ARRAY_TASK_ID"
    SHARD_OPTS=(--shard "$SLURM_ARRAY_TASK_ID/$n")
  fi
}
# Training stages: one process, or NPROC processes under torchrun (add --deepspeed CONFIG);
# across nodes, launch with srun and torchrun's rendezvous options instead.
run_trainer() {  # usage: run_trainer update|sft ARGS...
  if [ "${NPROC:-1}" -gt 1 ]; then
    local py=${PYTHON:-$(dirname "$(command -v "$MARSCLI")")/python}
    exec "$py" -m torch.distributed.run --nproc_per_node "$NPROC" \
      --master_port "${MASTER_PORT:-29511}" -m marscli "$@"
  fi
  exec $MARSCLI "$@"
}
