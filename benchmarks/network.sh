#!/usr/bin/env bash
# The network benchmark in one command (root: it starts an emulated cluster of 4 nodes at RATE
# with 2 slots each, and removes it on any exit):
#
#   bash benchmarks/network.sh [RATE] [OUT_DIR] [all|p4]   # default: 1gbit, benchmarks/results, all
#
# "p4" runs only the straggler part, at 1 and 16 MB (P4_MB), P4_REPEATS (3) interleaved repeats of
# P4_STEPS (20) steps, with Open MPI's TCP progress thread on unless OMPI_MCA_btl_tcp_progress_thread
# is set (0 turns it off), and writes OUT_DIR/p4-RATE.md and p4-RATE.json (4 ranks: about 18 minutes;
# P4_RANKS="4 8" picks the world sizes; 8 ranks at 16 MB take far longer: EASGD's center serialises).
# P4_ALGORITHMS overrides the list (osgp:D: max_delay D; easgd:S: the center on S server ranks).
# benchmarks/_network_table.py TMP OUT RATE MODE THREAD P4 rebuilds the tables from the rows' JSON files.
#
# For 4 ranks (one per node, TCP only) and 8 ranks (two per node): bench_network.py once per Open
# MPI tuned Allreduce algorithm (P1: AllreduceAverager vs raw Allreduce under the same algorithm,
# side by side) and once with the default decision (P1; P2: PushSum vs raw Isend/Irecv; P3: SGP vs
# AllReduce training steps through the torch wrappers; P4: straggler throughput). Then a table
# (OUT_DIR/network.md, rows in network.json): per size and world size, the fastest raw Allreduce
# and our ratio under it, P2, P3, and P4's throughput kept with one rank 2x slow.
set -u
cd "$(dirname "$0")/.."
RATE=${1:-1gbit}
OUT=${2:-benchmarks/results}
MODE=${3:-all}
case "$MODE" in all|p4) ;; *) echo "benchmarks/network.sh: mode is all or p4, not $MODE" >&2; exit 2 ;; esac
TMP=$(mktemp -d)
. benchmarks/_cluster.sh
start_cluster "$RATE" 2
# Open MPI's tuned Allreduce algorithms (coll_tuned_allreduce_algorithm)
ALGOS="1:basic-linear 2:nonoverlapping 3:recursive-doubling 4:ring 5:segmented-ring 6:rabenseifner"
run() {  # RANKS MAP LABEL "PARTS [BENCH FLAGS]" [MCA...]
  local n=$1 map=$2 label=$3 parts=$4
  shift 4
  for attempt in 1 2; do  # once more after the launcher's teardown hang (exit 3)
    MPIEXEC_EXTRA="$*" timeout -k 10 "${LIMIT_S:-900}" tests/cluster/mpiexec -n "$n" --map-by "$map" "$PY" \
      benchmarks/bench_network.py --rate-gbit "$rate_gbit" --label "$label" --parts $parts \
      --out "$TMP/$n-$label.json" && return 0
    [ -s "$TMP/$n-$label.json" ] && return 0
  done
  echo "benchmarks/network.sh: $n ranks, $label: failed" >&2
}
P4="p4 --compute-ms 200 --sizes-mb ${P4_MB:-1 16} --p4-steps ${P4_STEPS:-20} --p4-repeats ${P4_REPEATS:-3}
    --p4-algorithms ${P4_ALGORITHMS:-allreduce sgp osgp:4 agp gossip-pull easgd adpsgd}"
if [ "$MODE" = p4 ]; then
  export OMPI_MCA_btl_tcp_progress_thread=${OMPI_MCA_btl_tcp_progress_thread:-1} LIMIT_S=2400
  for n in ${P4_RANKS:-4 8}; do
    run "$n" "$([ "$n" = 4 ] && echo node || echo slot)" straggler "$P4"
  done
else
  for spec in "4 node" "8 slot"; do
    set -- $spec
    run "$1" "$2" default "p1 p2 p3"
    run "$1" "$2" straggler "p4 --sizes-mb 1 --compute-ms 200"
    for a in $ALGOS; do
      run "$1" "$2" "${a#*:}" p1 --mca coll_tuned_use_dynamic_rules 1 --mca coll_tuned_allreduce_algorithm "${a%%:*}"
    done
  done
fi
mkdir -p "$OUT"
"$PY" benchmarks/_network_table.py "$TMP" "$OUT" "$RATE" "$MODE" "${OMPI_MCA_btl_tcp_progress_thread:-0}" "$P4"
