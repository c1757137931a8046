#!/usr/bin/env bash
#SBATCH --job-name=marscli-advantages
# Group- then batch-normalised advantages (BN-GSPO by default). Pure numpy, seconds.
# usage: stages/advantages.sh SCORED OUT [marscli advantages options...]
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh" 2>/dev/null || source stages/_common.sh
scored=$1 out=$2; shift 2
exec $MARSCLI advantages "$scored" -o "$out" "$@"
