#!/usr/bin/env bash
#SBATCH --job-name=marscli-rl
# The RL loop in one allocation (`make rl-job`, SLURM=steps): make runs here, on the
# allocation's first node, and starts every stage as a job step of this allocation (srun), the
# servers (SERVE=1) as one step kept up beside them.
# usage: sbatch [options] stages/rl-job.sh TARGET...   (make's variables arrive in MAKEFLAGS)
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-.}"
echo "marscli-rl: job $SLURM_JOB_ID on ${SLURM_JOB_NODELIST:-?}: make $* SLURM=steps" >&2
exec make --no-print-directory "$@" SLURM=steps
