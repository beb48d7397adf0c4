#!/usr/bin/env bash
# Start a single-node Slurm cluster on localhost for the tests (idempotent).
#
#   eval "$(bash tests/slurm/start.sh)"     # prints: export SLURM_CONF=...
#
# Installs Debian's slurmctld, slurmd, slurm-client, munge, libpmix2 and libpmix-dev if missing (needs
# root), writes every file under $MPIGOSSIP_SLURM_DIR (default /tmp/mpigossip-slurm), and
# starts munged, slurmctld and slurmd there: no systemd, no cgroups
# (proctrack/linuxproc, task/none). The node advertises 16 CPUs whatever the machine has
# (SlurmdParameters=config_overrides), so 8-task jobs fit on 2 cores. Stop with stop.sh,
# which stops only what this script started.
set -euo pipefail
DIR=${MPIGOSSIP_SLURM_DIR:-/tmp/mpigossip-slurm}
CPUS=${MPIGOSSIP_SLURM_CPUS:-16}
log() { echo "slurm/start.sh: $*" >&2; }

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

mkdir -p "$DIR"/{state,spool,log,run}
NODE=$(hostname -s)
cat >"$DIR/slurm.conf" <<CONF
ClusterName=mpigossip
SlurmctldHost=$NODE
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job may restart only once its launch credential has expired (120 s by default).
AuthInfo=cred_expire=5
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldPort=${MPIGOSSIP_SLURM_PORT:-6817}
SlurmdPort=$(( ${MPIGOSSIP_SLURM_PORT:-6817} + 1 ))
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
GresTypes=gpu
MpiDefault=none
ReturnToService=2
MinJobAge=4
JobRequeue=1
KillWait=5
NodeName=$NODE CPUs=$CPUS Gres=gpu:4 RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
# Four GPUs that are only counted (no device files): lets job scripts keep --gpus-per-task.
mkdir -p "$DIR/dev"; for i in 0 1 2 3; do [ -c "$DIR/dev/gpu$i" ] || mknod -m 666 "$DIR/dev/gpu$i" c 1 3; done
printf "AutoDetect=off\nNodeName=$NODE Name=gpu File=$DIR/dev/gpu[0-3]\n" >"$DIR/gres.conf"
# The pip Open MPI's PMIx needs the native security module.
echo "PMIxEnv=PMIX_MCA_psec=native" >"$DIR/mpi.conf"
export SLURM_CONF="$DIR/slurm.conf"

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# munge: reuse a running munged, else start one (as the munge user) and note it.
if ! munge -n </dev/null >/dev/null 2>&1; then
  [ -s /etc/munge/munge.key ] || { mungekey --create --force >&2 2>/dev/null || dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 2>/dev/null; }
  chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
  mkdir -p /run/munge /var/log/munge /var/lib/munge && chown munge:munge /run/munge /var/log/munge /var/lib/munge
  runuser -u munge -- munged --force
  for _ in $(seq 50); do munge -n </dev/null >/dev/null 2>&1 && break; sleep 0.1; done
fi
if [ -z "$munged_before" ]; then pgrep -x munged >"$DIR/run/munged.pid" || true; fi

alive "$DIR/run/slurmctld.pid" || slurmctld -f "$SLURM_CONF"
alive "$DIR/run/slurmd.pid" || slurmd -f "$SLURM_CONF"

for _ in $(seq 100); do
  state=$(sinfo -h -n "$NODE" -o %t 2>/dev/null || true)
  case "$state" in idle*|mix*|alloc*) break ;; esac
  sleep 0.2
done
case "${state:-}" in
  idle*|mix*|alloc*) log "node $NODE is $state" ;;
  *) log "node $NODE did not come up (state '${state:-none}'); see $DIR/log"; tail -n 20 "$DIR"/log/*.log >&2; exit 1 ;;
esac
echo "export SLURM_CONF=$SLURM_CONF"
