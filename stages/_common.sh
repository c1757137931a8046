# Sourced by every stage script: the marscli to run, threads matched to the job's CPUs, shard
# arguments when the script runs as one task of a Slurm array, and the trainer launcher.
set -euo pipefail
MARSCLI=${MARSCLI:-marscli}
if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then
  export OMP_NUM_THREADS=$SLURM_CPUS_PER_TASK MKL_NUM_THREADS=$SLURM_CPUS_PER_TASK
fi
# Shard i of N writes OUT.shard-i and works on --shard i/N; `marscli merge` joins the shards
# afterwards. The shard is task i of a Slurm array, or MARSCLI_SHARD=i/N (the Makefile's
# shards run at once without a scheduler, or as job steps: SLURM=steps). Neither: the stage
# writes OUT itself.
shard_args() {  # usage: shard_args OUT  → sets SHARD_OUT, SHARD_OPTS, SHARD_INDEX
  SHARD_OUT=$1
  SHARD_OPTS=()
  SHARD_INDEX=0
  local n
  if [ -n "${SLURM_ARRAY_TASK_ID:-}" ]; then
    n=${SLURM_ARRAY_TASK_COUNT:-$(( SLURM_ARRAY_TASK_MAX - SLURM_ARRAY_TASK_MIN + 1 ))}
    SHARD_INDEX=$SLURM_ARRAY_TASK_ID
  elif [ -n "${MARSCLI_SHARD:-}" ]; then
    n=${MARSCLI_SHARD#*/} SHARD_INDEX=${MARSCLI_SHARD%/*}
  else
    return 0
  fi
  SHARD_OUT="$1.shard-$SHARD_INDEX"
  SHARD_OPTS=(--shard "$SHARD_INDEX/$n")
}

# Under sbatch $0 is Slurm's copy of the script (slurm_script): name the job instead.
STAGE_NAME=${SLURM_JOB_NAME:-${0##*/}}
die() { echo "$STAGE_NAME: $*" >&2; exit 2; }

# SERVE_URLS (`make rl SERVE=1`: the servers' URLs, space-separated): shard i generates through
# server i mod their count; when it is empty, the stage's own engine. MARSCLI_SERVE=1 (the
# Makefile exports it under SERVE=1) makes an empty one an error: an engine of the stage's own
# would start on the GPUs the servers hold.
engine_args() {  # usage: engine_args  → sets ENGINE_OPTS (after shard_args)
  ENGINE_OPTS=()
  local urls
  read -ra urls <<< "${SERVE_URLS:-}"
  if [ "${#urls[@]}" -eq 0 ]; then
    [ "${MARSCLI_SERVE:-0}" != 1 ] || die "SERVE=1 but no server (SERVE_URLS is empty) —" \
      "make rl SERVE=1 starts the servers, or set SERVE_URLS to the running servers' URLs"
    return 0
  fi
  ENGINE_OPTS=(--engine "server:${urls[$(( SHARD_INDEX % ${#urls[@]} ))]}")
}

# A node's address: Slurm's NodeAddr for it (the node name unless slurm.conf says otherwise;
# the local test cluster names nodes n1, n2 at 127.0.0.1). The allocation's first node hosts
# the torchrun rendezvous (MASTER_ADDR overrides); a server publishes its own node's.
node_addr() {  # usage: node_addr NODE
  local addr
  addr=$(scontrol show node "$1" -o 2>/dev/null | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p')
  echo "${addr:-$1}"
}
first_node_addr() { node_addr "$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -1)"; }

# Training stages (update, sft). What they read from the environment (the Makefile exports it
# from the recipe):
#   NPROC        training processes per node (torchrun --nproc_per_node); default
#                GPUS_PER_NODE, else 1
#   NNODES       nodes; under Slurm the job's own node count, which NNODES must then match
#   MASTER_PORT  rendezvous port (default 29511; under Slurm 20000 + (job id x 64 + step id) %
#                20000, so that two jobs, or two steps of a job, sharing a node do not collide)
#   NODE_RANK, MASTER_ADDR   only for several nodes without Slurm: run the stage once on every
#                node, as the release's train_multi_node.sh is run
# Launch shapes:
#   1 node, 1 process      marscli itself
#   1 node, NPROC          torchrun --nproc_per_node NPROC
#   N nodes under sbatch   srun, one task per node; each task a torchrun agent (node rank =
#                          SLURM_NODEID) with the static rendezvous on the first node
#   inside an srun step    one task per node: that node's torchrun agent; one task per rank
#                          (srun -n WORLD): marscli directly (it maps SLURM_PROCID to RANK)
run_trainer() {  # usage: run_trainer update|sft ARGS...
  [ -n "${MASTER_PORT:-}" ] || unset MASTER_PORT  # torch would read an empty one as a port
  local nproc=${NPROC:-${GPUS_PER_NODE:-1}} nodes=${NNODES:-1} port py
  [ "$nproc" -ge 1 ] || nproc=1
  py=${PYTHON:-$(dirname "$(command -v "$MARSCLI")")/python}
  port=${MASTER_PORT:-29511}
  if [ -n "${SLURM_JOB_ID:-}" ]; then
    nodes=${SLURM_STEP_NUM_NODES:-$SLURM_JOB_NUM_NODES}
    [ -z "${NNODES:-}" ] || [ "$NNODES" -eq "$nodes" ] || die "the Slurm job has $nodes node(s)" \
      "but NNODES=$NNODES: submit with sbatch --nodes=$NNODES (the Makefile's SBATCH_UPDATE and" \
      "SBATCH_SFT do), or set NNODES=$nodes"
    # One port per job step: SLURM=steps runs every update of the loop as a step of one job.
    port=${MASTER_PORT:-$(( 20000 + (SLURM_JOB_ID * 64 + ${SLURM_STEP_ID:-0}) % 20000 ))}
    if [ -n "${SLURM_STEP_ID:-}" ] && [ "${SLURM_STEP_NUM_TASKS:-1}" -gt "$nodes" ]; then
      exec $MARSCLI "$@"  # srun started one task per rank: no torchrun
    fi
    # Threads: the task's CPUs (--cpus-per-task, or --cpus-per-gpu x a GPU per process)
    # shared among its NPROC processes.
    local threads=$(( ${SLURM_CPUS_PER_TASK:-$(( ${SLURM_CPUS_PER_GPU:-1} * nproc ))} / nproc ))
    export OMP_NUM_THREADS=$(( threads > 0 ? threads : 1 ))
    export MKL_NUM_THREADS=$OMP_NUM_THREADS
  fi
  if [ "$nodes" -eq 1 ]; then
    [ "$nproc" -gt 1 ] || exec $MARSCLI "$@"
    exec "$py" -m torch.distributed.run --nproc_per_node "$nproc" --master_port "$port" \
      -m marscli "$@"
  fi
  local rdzv=(--nnodes "$nodes" --nproc_per_node "$nproc" --master_port "$port")
  if [ -z "${SLURM_JOB_ID:-}" ]; then  # several nodes by hand, like train_multi_node.sh
    [ -n "${NODE_RANK:-}" ] && [ -n "${MASTER_ADDR:-}" ] || die "NNODES=$nodes without Slurm:" \
      "run this stage on every node with NODE_RANK=0..$(( nodes - 1 )) and MASTER_ADDR=<node 0's" \
      "address>, or submit it through Slurm (make SLURM=1)"
    exec "$py" -m torch.distributed.run "${rdzv[@]}" --node_rank "$NODE_RANK" \
      --master_addr "$MASTER_ADDR" -m marscli "$@"
  fi
  local addr=${MASTER_ADDR:-$(first_node_addr)}
  rdzv+=(--master_addr "$addr")
  if [ -z "${SLURM_STEP_ID:-}" ]; then  # the batch script on the first node: one task per node
    echo "$STAGE_NAME: $nodes nodes x $nproc processes, rendezvous at $addr:$port" >&2
    # The step gets the job's CPUs per task explicitly (srun 22.05 does not inherit
    # --cpus-per-task from sbatch); with --cpus-per-gpu it follows the GPUs by itself.
    local cpus=()
    [ -z "${SLURM_CPUS_PER_TASK:-}" ] || cpus=(--cpus-per-task "$SLURM_CPUS_PER_TASK")
    exec srun --nodes "$nodes" --ntasks-per-node 1 "${cpus[@]}" --kill-on-bad-exit=1 \
      bash -c 'exec "$0" -m torch.distributed.run --node_rank "$SLURM_NODEID" "$@"' \
      "$py" "${rdzv[@]}" -m marscli "$@"
  fi
  exec "$py" -m torch.distributed.run "${rdzv[@]}" --node_rank "$SLURM_NODEID" -m marscli "$@"
}
