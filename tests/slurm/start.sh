#!/usr/bin/env bash
# Start a Slurm cluster for the tests (idempotent): on localhost as one node, or across the nodes
# of the emulated cluster (tests/cluster/start.sh) as one node per namespace.
#
#   eval "$(bash tests/slurm/start.sh)"              # one node; prints: export SLURM_CONF=...
#   bash tests/cluster/start.sh 4 1gbit
#   eval "$(bash tests/slurm/start.sh --cluster)"    # node1..node4; also puts sbatch & co. on PATH
#
# Installs Debian's slurmctld, slurmd, slurm-client, munge, libpmix2 and libpmix-dev if missing (needs
# root), writes every file under $MPIGOSSIP_SLURM_DIR (default /tmp/mpigossip-slurm, or the
# cluster's folder/slurm with --cluster), and starts munged, slurmctld and slurmd there: no
# systemd, no cgroups (proctrack/linuxproc, task/none). Each node advertises 16 CPUs and 4 GPUs
# (counted only) whatever the machine has (SlurmdParameters=config_overrides), so 8-task jobs fit
# on 2 cores. Stop with stop.sh, which stops only what this script started.
#
# --cluster: slurmctld runs in the head namespace, one slurmd per node namespace (with the node's
# host name); the client commands (sbatch, srun, salloc, squeue, scontrol, scancel, sinfo, sacct) reach the
# controller through wrappers in $DIR/bin that run them in the head namespace. A node whose
# slurmd stops answering is down after SlurmdTimeout=20 s (its jobs end NODE_FAIL and are
# requeued) and back in service once it answers again (ReturnToService=2).
set -euo pipefail
MODE=local
case "${1:-}" in
  --cluster) MODE=cluster ;;
  "") ;;
  *) echo "usage: tests/slurm/start.sh [--cluster]" >&2; exit 2 ;;
esac
CPUS=${MPIGOSSIP_SLURM_CPUS:-16}
log() { echo "slurm/start.sh: $*" >&2; }
if [ $MODE = cluster ]; then
  CDIR=${MPIGOSSIP_CLUSTER_DIR:-/tmp/mpigossip-cluster}
  [ -f "$CDIR/cluster" ] || { log "--cluster: no emulated cluster: run tests/cluster/start.sh N RATE first"; exit 2; }
  . "$CDIR/cluster"
  DIR=${MPIGOSSIP_SLURM_DIR:-$CDIR/slurm}
else
  DIR=${MPIGOSSIP_SLURM_DIR:-/tmp/mpigossip-slurm}
fi

# A munged already running before this script is the machine's: left alone. One started here, by
# us or by the munge package's install script (Debian starts the daemon on install), is ours to stop.
munged_before=$(pgrep -x munged || true)
missing=()
for cmd in slurmctld slurmd sbatch munged; do command -v "$cmd" >/dev/null || missing+=("$cmd"); done
# Slurm's mpi/pmix plugin dlopen()s pmix2/lib/libpmix.so: the unversioned link comes with libpmix-dev.
ls /usr/lib/*/pmix2/lib/libpmix.so >/dev/null 2>&1 || missing+=(libpmix-dev)
if [ ${#missing[@]} -gt 0 ]; then
  log "installing Debian's Slurm and munge (missing: ${missing[*]})"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q slurmctld slurmd slurm-client munge libpmix2 libpmix-dev >&2 \
    || { apt-get update -q >&2 && apt-get install -y -q slurmctld slurmd slurm-client munge libpmix2 libpmix-dev >&2; }
fi

mkdir -p "$DIR"/{state,spool,log,run,tmp}
PORT=${MPIGOSSIP_SLURM_PORT:-6817}
if [ $MODE = cluster ]; then
  # Per-node spool, pid, log and TmpFS (Slurm's PMIx folders) folders: %n is the node's name.
  HOSTS=$(seq -f "node%g" 1 "$nodes" | paste -sd, -)
  CTLD_HOST="head($net.254)"
  NODE_LINES=$(for k in $(seq 1 "$nodes"); do
    echo "NodeName=node$k NodeAddr=$net.$k CPUs=$CPUS Gres=gpu:4 RealMemory=4000 State=UNKNOWN"; done)
  PER_NODE=/%n
  for k in $(seq 1 "$nodes"); do mkdir -p "$DIR/spool/node$k" "$DIR/tmp/node$k"; done
else
  HOSTS=$(hostname -s)
  CTLD_HOST=$HOSTS
  NODE_LINES="NodeName=$HOSTS CPUs=$CPUS Gres=gpu:4 RealMemory=4000 State=UNKNOWN"
  PER_NODE=
fi
cat >"$DIR/slurm.conf" <<CONF
ClusterName=mpigossip
SlurmctldHost=$CTLD_HOST
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job may restart only once its launch credential has expired (120 s by default).
AuthInfo=cred_expire=5
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool$PER_NODE
TmpFS=$DIR/tmp$PER_NODE
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd${PER_NODE:+-%n}.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd${PER_NODE:+-%n}.log
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
# Pending jobs (a requeued one whose node came back) are looked at every 5 s, not every 30-60 s.
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0,sched_interval=5,bf_interval=5
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
GresTypes=gpu
MpiDefault=none
# A node that stops answering is down after 20 s (default 300) and back once it answers again.
SlurmdTimeout=20
ReturnToService=2
MinJobAge=4
JobRequeue=1
KillWait=5
$NODE_LINES
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
# Four GPUs per node that are only counted (character devices that are /dev/null): lets the job
# scripts keep --gpus-per-task and Slurm set CUDA_VISIBLE_DEVICES per task.
mkdir -p "$DIR/dev"; for i in 0 1 2 3; do [ -c "$DIR/dev/gpu$i" ] || mknod -m 666 "$DIR/dev/gpu$i" c 1 3; done
printf "AutoDetect=off\nNodeName=%s Name=gpu File=$DIR/dev/gpu[0-3]\n" "$([ $MODE = cluster ] && echo "node[1-$nodes]" || echo "$HOSTS")" >"$DIR/gres.conf"
# The pip Open MPI's PMIx needs the native security module.
echo "PMIxEnv=PMIX_MCA_psec=native" >"$DIR/mpi.conf"
export SLURM_CONF="$DIR/slurm.conf"

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# munge: reuse a running munged, else start one (as the munge user) and note it. Its UNIX socket
# is reached by path, so one munged serves every node namespace too.
if ! munge -n </dev/null >/dev/null 2>&1; then
  [ -s /etc/munge/munge.key ] || { mungekey --create --force >&2 2>/dev/null || dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 2>/dev/null; }
  chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
  mkdir -p /run/munge /var/log/munge /var/lib/munge && chown munge:munge /run/munge /var/log/munge /var/lib/munge
  runuser -u munge -- munged --force
  for _ in $(seq 50); do munge -n </dev/null >/dev/null 2>&1 && break; sleep 0.1; done
fi
if [ -z "$munged_before" ]; then pgrep -x munged >"$DIR/run/munged.pid" || true; fi

if [ $MODE = cluster ]; then
  # Client commands started outside the cluster's namespaces run in the head namespace, where the
  # controller's address is reachable; inside a node (a job's srun, scontrol) they run as they are.
  mkdir -p "$DIR/bin"
  for cmd in sbatch srun salloc squeue scontrol scancel sinfo sacct; do
    cat >"$DIR/bin/$cmd" <<WRAP
#!/bin/sh
case "\$(ip netns identify \$\$ 2>/dev/null)" in
  $prefix-*) exec $(command -v $cmd) "\$@" ;;
  *) exec nsenter --net=/run/netns/$prefix-head -- $(command -v $cmd) "\$@" ;;
esac
WRAP
    chmod +x "$DIR/bin/$cmd"
  done
  export PATH=$DIR/bin:$PATH
  # (slurmctld runs only on the host named in SlurmctldHost: "head", in a UTS namespace of its own)
  alive "$DIR/run/slurmctld.pid" || nsenter --net=/run/netns/$prefix-head -- \
    unshare --uts sh -c 'hostname head && exec slurmctld -f "$1"' sh "$SLURM_CONF"
  for k in $(seq 1 "$nodes"); do
    alive "$DIR/run/slurmd-node$k.pid" \
      || nsenter --net=/run/netns/$prefix-n$k --uts="$CDIR/uts-n$k" -- slurmd -f "$SLURM_CONF" -N "node$k"
  done
else
  alive "$DIR/run/slurmctld.pid" || slurmctld -f "$SLURM_CONF"
  alive "$DIR/run/slurmd.pid" || slurmd -f "$SLURM_CONF"
fi

want=$(echo "$HOSTS" | tr , ' ' | wc -w)
end=$((SECONDS + 30))
while [ $SECONDS -lt $end ]; do
  up=$(timeout 5 sinfo -h -N -n "$HOSTS" -o "%N %t" 2>/dev/null | grep -cE " (idle|mix|alloc)" || true)
  [ "$up" -ge "$want" ] && break
  sleep 0.2
done
if [ "$up" -ge "$want" ]; then
  log "$want node(s) up: $HOSTS"
else
  log "nodes did not come up: $(timeout 5 sinfo -h -N -o '%N %t' 2>&1 | paste -sd' ' -); see $DIR/log"
  tail -n 20 "$DIR"/log/*.log >&2
  exit 1
fi
echo "export SLURM_CONF=$SLURM_CONF${PER_NODE:+ PATH=$DIR/bin:\$PATH}"
