#!/usr/bin/env bash
# Stop what tests/slurm/start.sh started (and nothing else); keep the logs.
#
#   bash tests/slurm/stop.sh              # the one-node cluster
#   bash tests/slurm/stop.sh --cluster    # the one across the emulated nodes (tests/cluster/stop.sh calls it)
if [ "${1:-}" = --cluster ]; then
  DIR=${MPIGOSSIP_SLURM_DIR:-${MPIGOSSIP_CLUSTER_DIR:-/tmp/mpigossip-cluster}/slurm}
else
  DIR=${MPIGOSSIP_SLURM_DIR:-/tmp/mpigossip-slurm}
fi
[ -d "$DIR/run" ] || exit 0
# The daemons first (slurmd on every node, then the controller), munged last.
for pidfile in "$DIR"/run/slurmd*.pid "$DIR/run/slurmctld.pid" "$DIR/run/munged.pid"; do
  [ -f "$pidfile" ] || continue
  for pid in $(cat "$pidfile"); do
    kill "$pid" 2>/dev/null && for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null
  done
  rm -f "$pidfile"
done
rm -rf "$DIR/state" "$DIR/spool" "$DIR/tmp"
exit 0
