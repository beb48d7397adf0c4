#!/usr/bin/env bash
# What on_failure="continue" costs while no rank fails, across the emulated nodes (root), under the
# fault-tolerant launch (--with-ft ulfm: its 4 MiB eager limit, no han): benchmarks/bench_tolerant.py
# side by side (continue / default) at 4 and 16 MB.
# - default: 4 nodes of 2 slots, with 4 ranks (one a node: the flat ring) and 8 (two a node: the
#   node-aware ring), every pair: OUT_DIR/tolerant-RATE.json;
# - overlapped: the methods that overlap their messages with the caller's work (OSGP, AGP,
#   GradientAllReduce's buckets), the work 8 ms per MB (about a 1 Gbit link's time for the
#   message), on 2 nodes of one rank (a core per rank), 4 of one and 4 of two (8 ranks on this
#   machine's 2 cores): OUT_DIR/tolerant-RATE-overlapped.json.
#
#   bash benchmarks/tolerant.sh [RATE] [OUT_DIR] [overlapped]   # default 1gbit, benchmarks/results
set -u
cd "$(dirname "$0")/.."
RATE=${1:-1gbit}
OUT=${2:-benchmarks/results}
MODE=${3:-}
TMP=$(mktemp -d)
. benchmarks/_cluster.sh
mkdir -p "$OUT"
if [ "$MODE" = overlapped ]; then
  shapes=("2 1 2 node" "4 1 4 node" "4 2 8 slot")   # nodes, slots, ranks, mapping
  options=(--compute-ms-per-mb 8 --only PushSum.start+finish AsyncPushSum.start+finish GradientAllReduce.backward)
  name=tolerant-$RATE-overlapped
else
  shapes=("4 2 4 node" "4 2 8 slot")
  options=()
  name=tolerant-$RATE
fi
started=
for shape in "${shapes[@]}"; do
  set -- $shape
  [ "$started" = "$1x$2" ] || start_cluster "$RATE" "$2" "$1"
  started=$1x$2
  for attempt in 1 2; do  # once more after the launcher's teardown hang (exit 3)
    timeout -k 10 "${LIMIT_S:-900}" tests/cluster/mpiexec --with-ft ulfm -n "$3" --map-by "$4" "$PY" \
      benchmarks/bench_tolerant.py --rate-gbit "$rate_gbit" --sizes-mb ${SIZES_MB:-4 16} \
      --repeats "${REPEATS:-15}" "${options[@]}" --out "$TMP/$1x$2-$3.json" && break
    [ -s "$TMP/$1x$2-$3.json" ] && break
  done
done
"$PY" - "$TMP" "$OUT/$name.json" "bash benchmarks/tolerant.sh $RATE ${OUT} $MODE" <<'PY'
import glob, json, os, sys
runs = [json.load(open(f)) for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.json")))]
json.dump({"command": sys.argv[3].strip(), "runs": runs}, open(sys.argv[2], "w"), indent=2)
print(f"{sys.argv[2]}: {sum(len(r['rows']) for r in runs)} rows")
PY
