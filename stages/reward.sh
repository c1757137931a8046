#!/usr/bin/env bash
#SBATCH --job-name=marscli-reward
# Score trajectories: exact match, then the judge for open answers; format reward.
# usage: stages/reward.sh TRAJ OUT [marscli reward options...]
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh" 2>/dev/null || source stages/_common.sh
traj=$1 out=$2; shift 2
exec $MARSCLI reward "$traj" -o "$out" "$@"
