#!/usr/bin/env bash
# AllReduce at the network's limit, in one command (root: starts an emulated cluster of 4 nodes at
# RATE with 2 slots each, removed on any exit):
#
#   bash benchmarks/allreduce.sh [RATE] [OUT_DIR] [SIZES_MB]   # default: 1gbit, benchmarks/results
#
# benchmarks/bench_allreduce.py at 4 ranks (one per node: 2 ranks per core here) and 8 ranks (two per
# node: 4 per core, CPU-bound on this machine), under Open MPI's default Allreduce decision and with
# its ring forced (coll_tuned_allreduce_algorithm 4), then OUT_DIR/allreduce-RATE.{json,md}.
set -u
cd "$(dirname "$0")/.."
RATE=${1:-1gbit}
OUT=${2:-benchmarks/results}
SIZES=${3:-0.0625 0.25 0.5 1 4 16}
TMP=$(mktemp -d)
. benchmarks/_cluster.sh
start_cluster "$RATE" 2
for spec in "4 node" "8 slot"; do
  set -- $spec
  for label in default ompi-ring; do
    extra=""
    [ "$label" = ompi-ring ] && extra="--mca coll_tuned_use_dynamic_rules 1 --mca coll_tuned_allreduce_algorithm 4"
    for attempt in 1 2; do  # once more after a launcher start-up fault (PMIx's listener thread)
      MPIEXEC_EXTRA="$extra" timeout -k 10 1200 tests/cluster/mpiexec -n "$1" --map-by "$2" "$PY" \
        benchmarks/bench_allreduce.py --rate-gbit "$rate_gbit" --label "$label" --sizes-mb $SIZES \
        --out "$TMP/$1-$label.json" && break
      [ -s "$TMP/$1-$label.json" ] && break
      echo "benchmarks/allreduce.sh: $1 ranks, $label: failed (attempt $attempt)" >&2
    done
  done
done
mkdir -p "$OUT"
"$PY" benchmarks/bench_allreduce.py --merge "$TMP"/*.json --rate "$RATE" --out "$OUT/allreduce-$RATE"
