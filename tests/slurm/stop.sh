#!/usr/bin/env bash
# Stop what tests/slurm/start.sh started (and nothing else); keep the logs.
DIR=${MPIGOSSIP_SLURM_DIR:-/tmp/mpigossip-slurm}
for name in slurmd slurmctld munged; do
  pidfile="$DIR/run/$name.pid"
  if [ -f "$pidfile" ]; then
    for pid in $(cat "$pidfile"); do
      kill "$pid" 2>/dev/null && for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -9 "$pid" 2>/dev/null
    done
    rm -f "$pidfile"
  fi
done
rm -rf "$DIR/state" "$DIR/spool"
