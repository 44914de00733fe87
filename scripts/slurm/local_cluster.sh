#!/bin/bash
# A real two-node SLURM cluster on this one Debian/Ubuntu machine, for trying and testing scripts/slurm/*.sbatch:
# one slurmctld and two slurmd (`slurmd -N n1`, `slurmd -N n2`) sharing 127.0.0.1 on distinct ports, munge auth.
#
#   sudo scripts/slurm/local_cluster.sh          # up (idempotent: installs slurm + munge when missing)
#   sudo scripts/slurm/local_cluster.sh down     # stop the daemons
#   sbatch --nodes=2 --ntasks-per-node=1 --gpus-per-node=0 scripts/slurm/pretrain.sbatch trainer.max_steps=20
#
# Needs root (daemons, /etc/hosts, /etc/slurm). Everything else lives in $NEVA_SLURM_DIR (default /var/tmp/neva-slurm):
# slurm.conf, state, spool directories, pid files and the daemons' logs. /etc/slurm/slurm.conf becomes a link to that
# slurm.conf when it is absent or already ours, so the plain commands (sbatch, squeue, scontrol) find the cluster; a
# machine that has its own slurm.conf keeps it, and the cluster is reached with SLURM_CONF=$NEVA_SLURM_DIR/slurm.conf.
# Exit status 3: this machine cannot run it (not root, no apt-get); the tests skip on it with that reason.
set -euo pipefail

DIR=${NEVA_SLURM_DIR:-/var/tmp/neva-slurm}
CONF=$DIR/slurm.conf
MARK="# neva local test cluster (scripts/slurm/local_cluster.sh)"
CPUS=${NEVA_SLURM_CPUS:-16}  # declared per node (SlurmdParameters=config_overrides): the sbatch headers' sizes fit

die() { echo "local_cluster: $*" >&2; exit "${2:-1}"; }

stop() {
  for pid in "$DIR"/slurmd-n1.pid "$DIR"/slurmd-n2.pid "$DIR"/slurmctld.pid; do
    [[ -f $pid ]] && kill "$(cat "$pid")" 2>/dev/null || true
  done
}

if [[ ${1:-up} == down ]]; then
  stop
  exit 0
fi

[[ $(id -u) == 0 ]] || die "needs root (daemons, /etc/hosts, /etc/slurm); run it with sudo" 3

# --- packages ----------------------------------------------------------------------------------------------------
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null ||
  ! command -v munged >/dev/null; then
  command -v apt-get >/dev/null || die "slurm and munge are not installed and there is no apt-get to install them" 3
  echo "local_cluster: installing slurmctld slurmd slurm-client munge (apt-get)" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2 || die "apt-get update failed" 3
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >&2 ||
    die "apt-get install of slurm / munge failed" 3
fi

# --- names: n1 and n2 resolve to this machine ---------------------------------------------------------------------
for node in n1 n2; do
  grep -qE "^127\.0\.0\.1[[:space:]].*\b$node\b" /etc/hosts || echo "127.0.0.1 $node" >>/etc/hosts
done

# --- munge -------------------------------------------------------------------------------------------------------
if ! munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
  if [[ ! -s /etc/munge/munge.key ]]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
  fi
  chown munge:munge /etc/munge/munge.key 2>/dev/null || true
  chmod 400 /etc/munge/munge.key
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge 2>/dev/null || true
  # As the munge user when it exists (the package's way); --force lets it run in containers with loose permissions.
  if id munge >/dev/null 2>&1 && command -v runuser >/dev/null; then
    runuser -u munge -- munged --force
  else
    munged --force
  fi
  for _ in $(seq 50); do munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
  munge -n </dev/null | unmunge >/dev/null || die "munged does not answer (see /var/log/munge/munged.log)"
fi

# --- slurm.conf --------------------------------------------------------------------------------------------------
mkdir -p "$DIR/state" "$DIR/spool/n1" "$DIR/spool/n2"
HOST=$(hostname -s)
cat >"$CONF.new" <<EOF
$MARK
ClusterName=neva-local
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=6817
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
# A small cluster for tests: schedule every second or two rather than every minute.
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
# How long a cancelled job's processes have between SIGTERM and SIGKILL: the stop checkpoint is written in it.
KillWait=30
MinJobAge=600
NodeName=n1 NodeAddr=127.0.0.1 Port=6821 CPUs=$CPUS State=UNKNOWN
NodeName=n2 NodeAddr=127.0.0.1 Port=6822 CPUs=$CPUS State=UNKNOWN
PartitionName=local Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP
EOF
if [[ -f $CONF ]] && cmp -s "$CONF" "$CONF.new"; then
  rm "$CONF.new"
else
  mv "$CONF.new" "$CONF"
  stop  # a changed configuration: restart below
  sleep 1
fi
mkdir -p /etc/slurm
if [[ ! -e /etc/slurm/slurm.conf ]] || grep -qF "$MARK" /etc/slurm/slurm.conf; then
  ln -sfn "$CONF" /etc/slurm/slurm.conf
else
  echo "local_cluster: /etc/slurm/slurm.conf is not ours; use SLURM_CONF=$CONF" >&2
fi
export SLURM_CONF=$CONF

# --- daemons -----------------------------------------------------------------------------------------------------
alive() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }
alive "$DIR/slurmctld.pid" || slurmctld -f "$CONF"
for node in n1 n2; do
  alive "$DIR/slurmd-$node.pid" || slurmd -f "$CONF" -N "$node"
done

# Both nodes idle (a node that was down when slurmctld last saw it comes back with ReturnToService=2).
for _ in $(seq 300); do
  if [[ $(sinfo -h -N -o '%N %t' 2>/dev/null | grep -cE ' (idle|mix|alloc)$') == 2 ]]; then
    echo "local_cluster: up ($CONF)"
    sinfo -N
    exit 0
  fi
  sleep 0.1
done
sinfo -N >&2 || true
die "nodes did not come up; logs in $DIR (slurmctld.log, slurmd-n1.log, slurmd-n2.log)"
