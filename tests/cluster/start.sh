#!/usr/bin/env bash
# An emulated cluster of N nodes on this machine, for tests and benchmarks: each node a network
# namespace with its own host name (a persistent UTS namespace) and one link to a switch (a
# bridge in a namespace of its own), capped at RATE in both directions with tc tbf; a head
# namespace runs the launcher. Nothing is added to the machine's own network namespace.
# Open MPI's launcher starts its daemons inside the node namespaces through an ssh-like agent
# ($DIR/agent). Any cluster left by a killed run is removed first. Needs root.
#
#   bash tests/cluster/start.sh N RATE [SLOTS]     # e.g. 4 1gbit 1; then tests/cluster/mpiexec -n 4 ...
#   bash tests/cluster/stop.sh
#
# Nodes: node1..nodeN at 10.77.0.1..N/24 (eth0); head at 10.77.0.254; the state (hostfile,
# agent, UTS files) in $MPIGOSSIP_CLUSTER_DIR (default /tmp/mpigossip-cluster).
set -euo pipefail
N=${1:?usage: start.sh N RATE [SLOTS]}
RATE=${2:-1gbit}
SLOTS=${3:-1}
HERE=$(cd "$(dirname "$0")" && pwd)
DIR=${MPIGOSSIP_CLUSTER_DIR:-/tmp/mpigossip-cluster}
PREFIX=${MPIGOSSIP_CLUSTER_PREFIX:-mgc}
NET=${MPIGOSSIP_CLUSTER_NET:-10.77.0}
[ "$(id -u)" = 0 ] || { echo "tests/cluster/start.sh: needs root (network namespaces)" >&2; exit 2; }
[ "$N" -ge 1 ] && [ "$N" -le 64 ] || { echo "tests/cluster/start.sh: N must be in 1..64" >&2; exit 2; }
bash "$HERE/stop.sh"
mkdir -p "$DIR"

# tbf burst: at least 1.5 ms at the rate, and 128 KB (smaller bursts lose a quarter of the rate)
bits=$(python3 -c "
import re, sys
m = re.fullmatch(r'([0-9.]+)([kmg]?)bit', sys.argv[1].lower())
if not m: sys.exit('RATE must look like 1gbit, 500mbit, 2gbit')
print(int(float(m.group(1)) * {'': 1, 'k': 1e3, 'm': 1e6, 'g': 1e9}[m.group(2)]))" "$RATE")
burst=$(( bits * 15 / 10000 / 8 ))
[ "$burst" -lt 131072 ] && burst=131072

sw=$PREFIX-sw
ip netns add "$sw"
ip -n "$sw" link set lo up
ip -n "$sw" link add br0 type bridge
ip -n "$sw" link set br0 up

attach() {  # attach NS PORT ADDRESS: a veth from the switch into NS, capped both ways
  local ns=$1 port=$2 address=$3
  ip -n "$sw" link add "$port" type veth peer name eth0 netns "$ns"
  ip -n "$sw" link set "$port" master br0 up
  ip -n "$ns" link set lo up
  ip -n "$ns" addr add "$address/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip netns exec "$ns" tc qdisc add dev eth0 root tbf rate "$RATE" burst "$burst" latency 20ms
  ip netns exec "$sw" tc qdisc add dev "$port" root tbf rate "$RATE" burst "$burst" latency 20ms
}

ip netns add "$PREFIX-head"
attach "$PREFIX-head" swh "$NET.254"
: >"$DIR/hostfile"
for k in $(seq 1 "$N"); do
  ns=$PREFIX-n$k
  ip netns add "$ns"
  attach "$ns" "sw$k" "$NET.$k"
  touch "$DIR/uts-n$k"
  unshare --uts="$DIR/uts-n$k" hostname "node$k"
  echo "$NET.$k slots=$SLOTS" >>"$DIR/hostfile"
done

# The launcher's "ssh": skip ssh-style options, map the host (address or name) to its node
# namespace, run the command there with the node's host name.
cat >"$DIR/agent" <<AGENT
#!/bin/sh
while [ \$# -gt 0 ]; do
  case "\$1" in
    -o|-p|-l|-i|-F|-E|-b|-c|-m|-J|-L|-R|-D|-S|-W|-w) shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
host=\$1; shift
case "\$host" in
  $NET.*) k=\${host##*.} ;;
  node*) k=\${host#node} ;;
  *) echo "mpigossip cluster agent: unknown host \$host" >&2; exit 255 ;;
esac
exec nsenter --net=/run/netns/$PREFIX-n\$k --uts=$DIR/uts-n\$k -- /bin/sh -c "\$*"
AGENT
chmod +x "$DIR/agent"
printf 'nodes=%s rate=%s slots=%s prefix=%s net=%s\n' "$N" "$RATE" "$SLOTS" "$PREFIX" "$NET" >"$DIR/cluster"
echo "tests/cluster/start.sh: $N nodes at $RATE ($SLOTS slot(s) each); launch with tests/cluster/mpiexec" >&2
