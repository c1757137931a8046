#!/usr/bin/env bash
#SBATCH --job-name=marscli-serve
# Keep one vLLM engine up for a whole RL run (`make rl SERVE=1`), its weights reloaded in place
# by each iteration's rollout. Writes the URL it serves on to URL_FILE first (under Slurm: this
# node's address, listening on every interface), then serves until killed (scancel).
# usage: stages/serve.sh POLICY PORT URL_FILE [marscli serve options...]
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh" 2>/dev/null || source stages/_common.sh
policy=$1 port=$2 url_file=$3; shift 3
if [ -n "${SLURM_JOB_NODELIST:-}" ]; then host=$(first_node_addr) bind=0.0.0.0
else host=127.0.0.1 bind=127.0.0.1; fi
echo "http://$host:$port" > "$url_file.tmp-$$" && mv "$url_file.tmp-$$" "$url_file"
exec "${SERVE_MARSCLI:-$MARSCLI}" serve "$policy" --host "$bind" --port "$port" "$@"
