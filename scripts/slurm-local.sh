#!/usr/bin/env bash
# A one-node Slurm cluster on localhost (Debian slurm-wlm + munge), for CI and laptops.
#   scripts/slurm-local.sh start   # installs the packages if missing, starts munged, slurmctld, slurmd
#   scripts/slurm-local.sh stop    # stops what start started
# State lives under $SLURM_LOCAL_DIR (default /tmp/marscli-slurm). Needs root (CI containers are).
set -euo pipefail
DIR=${SLURM_LOCAL_DIR:-/tmp/marscli-slurm}
CONF=$DIR/slurm.conf

install() {
  command -v slurmctld >/dev/null && command -v munged >/dev/null && return
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq slurm-wlm munge >/dev/null
}

start() {
  install
  mkdir -p "$DIR"/{state,spool,log} /etc/munge /run/munge /var/log/munge /var/lib/munge
  if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  fi
  chown -R munge:munge /etc/munge /run/munge /var/log/munge /var/lib/munge 2>/dev/null || true
  chmod 700 /etc/munge; chmod 400 /etc/munge/munge.key
  pgrep -x munged >/dev/null || munged --force 2>/dev/null || sudo -u munge munged --force
  local host cpus mem
  host=$(hostname -s)
  cpus=$(nproc)
  mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
  cat > "$CONF" <<CONF
ClusterName=marscli
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
ReturnToService=2
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName=$host CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
  mkdir -p /etc/slurm && cp "$CONF" /etc/slurm/slurm.conf
  slurmctld -f "$CONF"
  slurmd -f "$CONF"
  for _ in $(seq 1 30); do
    if sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
      echo "slurm: node $host up ($cpus CPUs)" >&2; return 0
    fi
    sleep 1
  done
  echo "slurm: node did not come up; see $DIR/log" >&2
  tail -5 "$DIR"/log/*.log >&2 || true
  return 1
}

stop() {
  [ -f "$DIR/slurmd.pid" ] && kill "$(cat "$DIR/slurmd.pid")" 2>/dev/null || true
  [ -f "$DIR/slurmctld.pid" ] && kill "$(cat "$DIR/slurmctld.pid")" 2>/dev/null || true
  pkill -x munged 2>/dev/null || true
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
