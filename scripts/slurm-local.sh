#!/usr/bin/env bash
# A Slurm cluster on this one machine (Debian slurm-wlm + munge), for CI and laptops.
#   scripts/slurm-local.sh start [--nodes N] [--gpus G]   # installs the packages if missing,
#                                      # starts munged (unless running), slurmctld, N slurmd
#   scripts/slurm-local.sh status      # sinfo
#   scripts/slurm-local.sh stop        # stops what start started, by pid
# Nodes are n1..nN: one slurmd each (`slurmd -N ni`), all on this host, each on its own port
# (Debian's slurmd supports several daemons per host) and each offering all of this machine's
# CPUs, so a job of --nodes 2 gets two Slurm nodes that share one kernel, one filesystem and the
# loopback network: enough to test srun + torchrun across nodes. --gpus G declares G GPUs per
# node as generic resources backed by stand-in devices (made like /dev/null), so that sbatch
# accepts the GPU recipes' --gres=gpu:G and --cpus-per-gpu (the jobs still run on the CPU).
# State lives under $SLURM_LOCAL_DIR (default /tmp/marscli-slurm),
# fresh at every start; ports from $SLURM_LOCAL_PORT (default 6817: slurmctld, nodes +1..+N).
# Needs root (CI containers are).
set -euo pipefail
DIR=${SLURM_LOCAL_DIR:-/tmp/marscli-slurm}
PORT=${SLURM_LOCAL_PORT:-6817}
CONF=$DIR/slurm.conf

install() {
  command -v slurmctld >/dev/null && command -v munged >/dev/null && return
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq slurm-wlm munge >/dev/null
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

start_munge() {
  mkdir -p /etc/munge /run/munge /var/log/munge /var/lib/munge
  if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  fi
  chown -R munge:munge /etc/munge /run/munge /var/log/munge /var/lib/munge 2>/dev/null || true
  chmod 700 /etc/munge; chmod 400 /etc/munge/munge.key
  alive /run/munge/munged.pid && return  # someone's munged: use it, never stop it
  munged --force 2>/dev/null || sudo -u munge munged --force
  cp /run/munge/munged.pid "$DIR/munged.pid"  # ours: stop ends it
}

write_conf() {  # usage: write_conf NODES GPUS
  local n=$1 gpus=$2 host cpus mem i names
  host=$(hostname -s)
  cpus=$(nproc)
  mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
  names=n1; [ "$n" -gt 1 ] && names="n[1-$n]"
  cat > "$CONF" <<CONF
ClusterName=marscli
SlurmctldHost=$host
SlurmctldPort=$PORT
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
SlurmdSpoolDir=$DIR/spool-%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
CONF
  if [ "$gpus" -gt 0 ]; then  # slurmd drops GPUs without a device file: give it /dev/null's
    echo "GresTypes=gpu" >> "$CONF"
    for i in $(seq 0 $(( gpus - 1 ))); do
      [ -c "$DIR/fake-gpu$i" ] || mknod -m 666 "$DIR/fake-gpu$i" c 1 3
    done
    echo "Name=gpu File=$DIR/fake-gpu[0-$(( gpus - 1 ))]" > "$DIR/gres.conf"
  else
    rm -f "$DIR/gres.conf" /etc/slurm/gres.conf
  fi
  # Every node is this host (NodeHostname), reached at 127.0.0.1 on its own port.
  for i in $(seq 1 "$n"); do
    echo "NodeName=n$i NodeHostname=$host NodeAddr=127.0.0.1 Port=$(( PORT + i ))" \
      "CPUs=$cpus RealMemory=$mem$([ "$gpus" -gt 0 ] && echo " Gres=gpu:$gpus") State=UNKNOWN" >> "$CONF"
  done
  echo "PartitionName=debug Nodes=$names Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES" \
    >> "$CONF"
}

start() {
  local nodes=1 gpus=0
  while [ $# -gt 0 ]; do
    case $1 in
      --nodes) nodes=$2; shift 2 ;;
      --gpus) gpus=$2; shift 2 ;;
      *) echo "slurm-local: unknown option $1 (start [--nodes N] [--gpus G])" >&2; exit 2 ;;
    esac
  done
  if alive "$DIR/slurmctld.pid"; then
    echo "slurm: already running from $DIR ($(sinfo -h -N -o %N | sort -u | wc -l) nodes);" \
      "run \`$0 stop\` first" >&2
    return 1
  fi
  install
  rm -rf "$DIR/state" "$DIR"/spool-* "$DIR/log"
  mkdir -p "$DIR/state" "$DIR/log"
  start_munge
  write_conf "$nodes" "$gpus"
  # sinfo, sbatch and srun read /etc/slurm/slurm.conf unless SLURM_CONF says otherwise
  mkdir -p /etc/slurm && cp "$CONF" /etc/slurm/slurm.conf
  if [ "$gpus" -gt 0 ]; then cp "$DIR/gres.conf" /etc/slurm/gres.conf; fi
  slurmctld -f "$CONF"
  for i in $(seq 1 "$nodes"); do
    mkdir -p "$DIR/spool-n$i"
    slurmd -f "$CONF" -N "n$i"
  done
  for _ in $(seq 1 30); do
    if [ "$(sinfo -h -N -o '%N %T' 2>/dev/null | grep -cE ' (idle|mixed|allocated)$')" -ge "$nodes" ]; then
      echo "slurm: $nodes node(s) up ($(nproc) CPUs$([ "$gpus" -gt 0 ] && echo ", $gpus GRES gpu") each)" >&2
      return 0
    fi
    sleep 1
  done
  echo "slurm: nodes did not come up; see $DIR/log" >&2
  tail -n 5 "$DIR"/log/*.log >&2 || true
  return 1
}

stop() {
  local f
  for f in "$DIR"/slurmd-*.pid "$DIR/slurmctld.pid" "$DIR/munged.pid"; do
    alive "$f" && kill "$(cat "$f")"
    rm -f "$f"
  done
  return 0
}

case "${1:-}" in
  start) shift; start "$@" ;;
  status) sinfo -N ;;
  stop) stop ;;
  *) echo "usage: $0 start [--nodes N] [--gpus G] | status | stop" >&2; exit 2 ;;
esac
