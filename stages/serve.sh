#!/usr/bin/env bash
#SBATCH --job-name=marscli-serve
# Keep vLLM engines up for a whole RL run (`make rl SERVE=1`), their weights reloaded in place
# (or woken, after a sleep) by each iteration's rollout. Server i listens on PORT+i, writes its
# URL to URL_DIR/i.url first (under Slurm: its node's address, listening on every interface),
# then serves until killed. i is SERVE_INDEX, else the task's index in a Slurm array (SLURM=1:
# one job per server) or job step (SLURM=steps: one step, a task per server).
# GPUs: server i takes the i-th group of TP GPUs on its node (the node-local task index) among
# CUDA_VISIBLE_DEVICES, or among 0..GPUS_PER_NODE-1 without one; when it sees TP GPUs or fewer
# (a job of its own), those.
# The run's token: MARSCLI_SERVE_TOKEN_FILE (scripts/rl-served.sh makes it) goes to marscli serve
# as --api-key-file, so every request but GET /health must carry it. Under Slurm the server
# listens on every interface, which it refuses to do without one.
# usage: stages/serve.sh POLICY PORT URL_DIR [marscli serve options...]
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh" 2>/dev/null || source stages/_common.sh
policy=$1 port=$2 url_dir=$3; shift 3
i=${SERVE_INDEX:-${SLURM_ARRAY_TASK_ID:-${SLURM_PROCID:-0}}}
local_i=${SLURM_LOCALID:-$i}

gpus=${CUDA_VISIBLE_DEVICES:-}
if [ -z "$gpus" ] && [ -n "${GPUS_PER_NODE:-}" ]; then gpus=$(seq -s, 0 $(( GPUS_PER_NODE - 1 ))); fi
IFS=, read -ra gpus <<< "$gpus"
tp=${TP:-1}
if [ "${#gpus[@]}" -gt "$tp" ]; then
  [ $(( (local_i + 1) * tp )) -le "${#gpus[@]}" ] || die "server $i: needs GPUs" \
    "$(( local_i * tp ))..$(( (local_i + 1) * tp - 1 )) of its node, which has ${#gpus[@]}"
  export CUDA_VISIBLE_DEVICES
  CUDA_VISIBLE_DEVICES=$(IFS=,; echo "${gpus[*]:$(( local_i * tp )):$tp}")
fi

if [ -n "${SLURM_JOB_NODELIST:-}" ]; then host=$(node_addr "${SLURMD_NODENAME:-$(hostname -s)}") bind=0.0.0.0
else host=127.0.0.1 bind=127.0.0.1; fi
token=()
if [ -n "${MARSCLI_SERVE_TOKEN_FILE:-}" ]; then
  token=(--api-key-file "$MARSCLI_SERVE_TOKEN_FILE")
elif [ "$bind" = 0.0.0.0 ]; then
  die "server $i: listening on every interface (Slurm) needs a token — set" \
    "MARSCLI_SERVE_TOKEN_FILE to a file of mode 600 holding one (make rl SERVE=1 makes" \
    "RUN/serve/token)"
fi
port=$(( port + i ))
mkdir -p "$url_dir"
echo "http://$host:$port" > "$url_dir/$i.url.tmp-$$" && mv "$url_dir/$i.url.tmp-$$" "$url_dir/$i.url"
echo "$STAGE_NAME: server $i on $host:$port${CUDA_VISIBLE_DEVICES:+, GPUs $CUDA_VISIBLE_DEVICES}" >&2
exec "${SERVE_MARSCLI:-$MARSCLI}" serve "$policy" --host "$bind" --port "$port" "${token[@]}" \
  "$@"
