#!/usr/bin/env bash
# `make rl SERVE=1`: start one `marscli serve` on RUN/ckpt-0 for the whole loop (with SLURM=1 a
# job of its own, beside the iteration jobs), wait until it answers, run `make rl-iter ITER=i`
# for i < ITERS (each rollout reloads it with its checkpoint: ROLLOUT_ENGINE), then stop it.
# A script rather than a recipe line, so that `make -n rl SERVE=1` prints it instead of
# starting a server (make runs any recipe line that calls $(MAKE), even under -n).
# usage: scripts/rl-served.sh RUN ITERS PORT SLURM [marscli serve options...]
#   environment: PY (the venv's python), SBATCH_OPTS, SBATCH_SERVE; make's MAKEFLAGS carries
#   the command line's variables to the iterations.
set -euo pipefail
run=$1 iters=$2 port=$3 slurm=$4; shift 4
url_file=$run/serve.url
mkdir -p "$run/logs"
rm -f "$url_file"
if [ "$slurm" = 1 ]; then
  # shellcheck disable=SC2086  # the sbatch options are words
  job=$(sbatch --parsable -o "$run/logs/serve-%j.out" ${SBATCH_OPTS:-} ${SBATCH_SERVE:-} \
    stages/serve.sh "$run/ckpt-0" "$port" "$url_file" "$@")
  trap 'scancel "$job"' EXIT
  alive=(--job "$job")
else
  stages/serve.sh "$run/ckpt-0" "$port" "$url_file" "$@" 2> "$run/logs/serve.log" &
  server=$!
  trap 'kill "$server" 2>/dev/null; wait "$server" 2>/dev/null || true' EXIT
  alive=(--pid "$server")
fi
"${PY:-python3}" scripts/serve-wait.py "$url_file" "${alive[@]}" > /dev/null
for i in $(seq 0 $(( iters - 1 ))); do
  make --no-print-directory rl-iter ITER="$i"
done
