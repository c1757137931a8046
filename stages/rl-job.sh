#!/usr/bin/env bash
#SBATCH --job-name=marscli-rl
# The RL loop in one allocation (`make rl-job`, SLURM=steps): make runs here, on the
# allocation's first node, and starts every stage as a job step of this allocation (srun), the
# servers (SERVE=1) as one step kept up beside them.
# A time limit ends the job cleanly and it requeues itself: `make rl-job` submits it with
# --requeue --open-mode=append --signal=B:USR1@RL_JOB_GRACE, so Slurm sends this script USR1
# that many seconds before the limit. It then stops make (TERM to make's process group: the
# running stage's steps end; every stage writes its outputs atomically, so nothing half-written
# passes for done) and runs `scontrol requeue`: the same job, its same options and log, runs
# the same targets again and make resumes at the first missing file. At most RL_JOB_REQUEUES
# times (SLURM_RESTART_COUNT counts them), so that a stage longer than the limit cannot loop.
# usage: sbatch [options] stages/rl-job.sh TARGET...   (make's variables arrive in MAKEFLAGS)
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-.}"
restarts=${SLURM_RESTART_COUNT:-0} cap=${RL_JOB_REQUEUES:-10}
echo "marscli-rl: job $SLURM_JOB_ID (requeued $restarts times) on ${SLURM_JOB_NODELIST:-?}:" \
  "make $* SLURM=steps" >&2
set -m  # make in a process group of its own, so that one signal reaches it and its stages
make --no-print-directory "$@" SLURM=steps &
pid=$! stopping=0
trap 'stopping=1; echo "marscli-rl: time limit near (USR1): stopping make" >&2
  kill -TERM -- "-$pid" 2>/dev/null || true' USR1
rc=0
wait "$pid" || rc=$?
while [ "$stopping" = 1 ] && kill -0 "$pid" 2>/dev/null; do rc=0; wait "$pid" || rc=$?; done
[ "$stopping" = 1 ] || exit "$rc"
if [ "$restarts" -ge "$cap" ]; then
  echo "error: job $SLURM_JOB_ID reached its time limit $restarts times already (RL_JOB_REQUEUES=$cap) — a longer --time in SBATCH_OPTS, or make rl-job again to go on" >&2
  exit 1
fi
echo "marscli-rl: requeueing job $SLURM_JOB_ID; its next run resumes at the first missing file" >&2
exec scontrol requeue "$SLURM_JOB_ID"
