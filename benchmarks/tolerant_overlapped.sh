#!/usr/bin/env bash
# What on_failure="continue" costs the methods that overlap their messages with the caller's work
# (OSGP, AGP, GradientAllReduce's buckets), across the emulated nodes (root): continue / default
# side by side (benchmarks/bench_tolerant.py, the caller's work 8 ms per MB, about a 1 Gbit
# link's time for the message) at 4 and 16 MB, in three shapes: 2 nodes of one rank (a core
# per rank), 4 nodes of one rank, and 4 nodes of two (8 ranks on this machine's 2 cores).
#
#   bash benchmarks/tolerant_overlapped.sh [RATE] [OUT_DIR]   # OUT_DIR/tolerant-RATE-overlapped.json
set -u
cd "$(dirname "$0")/.."
RATE=${1:-1gbit}
OUT=${2:-benchmarks/results}
TMP=$(mktemp -d)
. benchmarks/_cluster.sh
mkdir -p "$OUT"
ONLY="PushSum.start+finish AsyncPushSum.start+finish GradientAllReduce.backward"
for shape in "2 1 2 node" "4 1 4 node" "4 2 8 slot"; do   # nodes, slots, ranks, mapping
  set -- $shape
  start_cluster "$RATE" "$2" "$1"
  for attempt in 1 2; do  # once more after the launcher's teardown hang (exit 3)
    timeout -k 10 "${LIMIT_S:-900}" tests/cluster/mpiexec --with-ft ulfm -n "$3" --map-by "$4" "$PY" \
      benchmarks/bench_tolerant.py --rate-gbit "$rate_gbit" --sizes-mb ${SIZES_MB:-4 16} \
      --repeats "${REPEATS:-15}" --compute-ms-per-mb 8 --only $ONLY --out "$TMP/$1x$2.json" && break
    [ -s "$TMP/$1x$2.json" ] && break
  done
done
"$PY" - "$TMP" "$OUT/tolerant-$RATE-overlapped.json" <<'PY'
import glob, json, os, sys
runs = [json.load(open(f)) for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.json")))]
json.dump({"command": "bash benchmarks/tolerant_overlapped.sh", "runs": runs}, open(sys.argv[2], "w"), indent=2)
print(f"{sys.argv[2]}: {sum(len(r['rows']) for r in runs)} rows")
PY
