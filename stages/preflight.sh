#!/usr/bin/env bash
#SBATCH --job-name=marscli-preflight
# Check that every search and judge endpoint answers from the node the stages run on (make rl
# runs it before the first iteration).
# usage: stages/preflight.sh [marscli preflight options...]
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh" 2>/dev/null || source stages/_common.sh
exec $MARSCLI preflight "$@"
