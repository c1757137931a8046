#!/usr/bin/env bash
# `make rl SERVE=1` (and rl-eval): start SERVERS `marscli serve` on RUN/ckpt-0, wait until every
# one answers, run `make TARGET... SERVING=1` with their URLs in SERVE_URLS (rollout and eval
# shard i uses server i mod SERVERS, each reloading or waking it with its checkpoint), then stop
# them. How the servers start, by SLURM:
#   0      SERVERS processes here; server i on port PORT+i and the i-th group of TP GPUs
#   1      an array job of SERVERS tasks (SBATCH_SERVE each: its own GPUs), beside the stages' jobs
#   steps  one job step of SERVERS tasks (SRUN_SERVE) in this allocation, --overlap: the stages'
#          steps run beside it, and a colocated update (COLOCATE=1) on the same GPUs
# A script rather than a recipe line, so that `make -n rl SERVE=1` prints it instead of
# starting servers (make runs any recipe line that calls $(MAKE), even under -n).
# usage: scripts/rl-served.sh RUN PORT SLURM SERVERS TARGET... [-- marscli serve options...]
#   environment: PY (the venv's python), SBATCH_OPTS, SERVE_TIME (the array's --time: the loop's,
#   not a stage's), SBATCH_SERVE, SRUN_SERVE, SERVE_ALLOW (the
#   folders the servers may read); make's MAKEFLAGS carries the command line's variables to the
#   inner make.
# A token per run, RUN/serve/token (mode 600): the servers answer only requests that carry it
# (under Slurm they listen on every interface); MARSCLI_SERVE_TOKEN_FILE names the file to the
# servers (stages/serve.sh), the stages and serve-ctl. It is never on a command line or in a log.
set -euo pipefail
run=$1 port=$2 slurm=$3 servers=$4; shift 4
targets=()
while [ $# -gt 0 ] && [ "$1" != -- ]; do targets+=("$1"); shift; done
[ $# -eq 0 ] || shift  # the rest: marscli serve's options
for dir in ${SERVE_ALLOW:-}; do  # the folders whose images the servers may open, as they exist
  [ ! -d "$dir" ] || set -- "$@" --allow-dir "$dir"
done
# ckpt-0 may be a link to a checkpoint elsewhere (a shared cold start): the servers hold it
# first and reload it to evaluate it, where the link leads
[ ! -L "$run/ckpt-0" ] || set -- "$@" --allow-dir "$(realpath "$run/ckpt-0")"
url_dir=$run/serve
mkdir -p "$run/logs"
rm -rf "$url_dir"
mkdir -p "$url_dir"
(umask 077 && "${PY:-python3}" -c 'import secrets; print(secrets.token_hex(32))' > "$url_dir/token")
MARSCLI_SERVE_TOKEN_FILE=$(realpath "$url_dir/token")
export MARSCLI_SERVE_TOKEN_FILE
alive=()
case $slurm in
  1)
    # shellcheck disable=SC2086  # the sbatch options are words
    job=$(sbatch --parsable --array=0-$(( servers - 1 )) -o "$run/logs/serve-%A_%a.out" \
      ${SBATCH_OPTS:-} ${SERVE_TIME:+--time=$SERVE_TIME} ${SBATCH_SERVE:-} stages/serve.sh "$run/ckpt-0" "$port" "$url_dir" "$@")
    trap 'scancel "$job"' EXIT
    alive=(--job "${job%%;*}") ;;
  steps)
    # shellcheck disable=SC2086  # the srun options are words
    srun --overlap --ntasks="$servers" ${SRUN_SERVE:-} --kill-on-bad-exit=0 \
      -o "$run/logs/serve-%j.%s-%t.out" stages/serve.sh "$run/ckpt-0" "$port" "$url_dir" "$@" &
    step=$!
    trap 'kill "$step" 2>/dev/null; wait "$step" 2>/dev/null || true' EXIT
    alive=(--pid "$step") ;;
  *)
    pids=()
    for i in $(seq 0 $(( servers - 1 ))); do
      SERVE_INDEX=$i stages/serve.sh "$run/ckpt-0" "$port" "$url_dir" "$@" \
        2> "$run/logs/serve-$i.log" &
      pids+=($!) alive+=(--pid $!)
    done
    trap 'kill "${pids[@]}" 2>/dev/null; wait "${pids[@]}" 2>/dev/null || true' EXIT ;;
esac
urls=$("${PY:-python3}" scripts/serve-wait.py "$url_dir" --count "$servers" "${alive[@]}")
export SERVE_URLS=${urls//$'\n'/ }
make --no-print-directory "${targets[@]}" SERVING=1
