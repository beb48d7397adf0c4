#!/usr/bin/env bash
# What on_failure="continue" costs while no rank fails, across the emulated nodes (root): 4 nodes
# at RATE, one rank each, under the fault-tolerant launch (--with-ft ulfm: its 4 MiB eager limit,
# no han), benchmarks/bench_tolerant.py side by side (continue / default) at 4 and 16 MB: both
# sides share the launch.
#
#   bash benchmarks/tolerant.sh [RATE] [OUT_DIR]   # default 1gbit, benchmarks/results: OUT_DIR/tolerant-RATE.json
set -u
cd "$(dirname "$0")/.."
RATE=${1:-1gbit}
OUT=${2:-benchmarks/results}
TMP=$(mktemp -d)
. benchmarks/_cluster.sh
start_cluster "$RATE" 1
mkdir -p "$OUT"
for attempt in 1 2; do  # once more after the launcher's teardown hang (exit 3)
  timeout -k 10 "${LIMIT_S:-900}" tests/cluster/mpiexec --with-ft ulfm -n 4 --map-by node "$PY" \
    benchmarks/bench_tolerant.py --rate-gbit "$rate_gbit" --sizes-mb ${SIZES_MB:-4 16} \
    --repeats "${REPEATS:-15}" --out "$OUT/tolerant-$RATE.json" && break
  [ -s "$OUT/tolerant-$RATE.json" ] && break
done
