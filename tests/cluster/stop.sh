#!/usr/bin/env bash
# Tear down the emulated cluster made by tests/cluster/start.sh: stop a Slurm started on it
# (tests/slurm/stop.sh --cluster, which also stops the munged it started), end every process inside its
# namespaces (by PID), delete the namespaces (their veth pairs go with them), unmount and remove
# the UTS files and the state folder. Safe to run when nothing is there.
#
#   bash tests/cluster/stop.sh
set -u
DIR=${MPIGOSSIP_CLUSTER_DIR:-/tmp/mpigossip-cluster}
PREFIX=${MPIGOSSIP_CLUSTER_PREFIX:-mgc}
[ -d "$DIR/slurm" ] && MPIGOSSIP_SLURM_DIR="$DIR/slurm" bash "$(dirname "$0")/../slurm/stop.sh" --cluster
spaces=$(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${PREFIX}-(sw|head|n[0-9]+)$" || true)
for ns in $spaces; do
  pids=$(ip netns pids "$ns" 2>/dev/null)
  [ -n "$pids" ] && kill -TERM $pids 2>/dev/null
done
for ns in $spaces; do
  for _ in 1 2 3 4 5 6 7 8 9 10; do
    [ -z "$(ip netns pids "$ns" 2>/dev/null)" ] && break
    sleep 0.2
  done
  pids=$(ip netns pids "$ns" 2>/dev/null)
  [ -n "$pids" ] && kill -KILL $pids 2>/dev/null
done
for ns in $spaces; do ip netns delete "$ns" 2>/dev/null; done
if [ -d "$DIR" ]; then
  for f in "$DIR"/uts-*; do
    [ -e "$f" ] || continue
    umount "$f" 2>/dev/null
    rm -f "$f"
  done
  rm -rf "$DIR"
fi
exit 0
