#!/usr/bin/env bash
# What on_failure="continue" costs while no rank fails, across the emulated nodes (root): 4 nodes
# at RATE with 2 slots each, under the fault-tolerant launch (--with-ft ulfm: its 4 MiB eager
# limit, no han), benchmarks/bench_tolerant.py side by side (continue / default) at 4 and 16 MB,
# with 4 ranks (one a node: the flat ring) and 8 (two a node: the node-aware ring).
#
#   bash benchmarks/tolerant.sh [RATE] [OUT_DIR]   # default 1gbit, benchmarks/results: OUT_DIR/tolerant-RATE.json
set -u
cd "$(dirname "$0")/.."
RATE=${1:-1gbit}
OUT=${2:-benchmarks/results}
TMP=$(mktemp -d)
. benchmarks/_cluster.sh
start_cluster "$RATE" 2
mkdir -p "$OUT"
for spec in "4 node" "8 slot"; do
  set -- $spec
  for attempt in 1 2; do  # once more after the launcher's teardown hang (exit 3)
    timeout -k 10 "${LIMIT_S:-900}" tests/cluster/mpiexec --with-ft ulfm -n "$1" --map-by "$2" "$PY" \
      benchmarks/bench_tolerant.py --rate-gbit "$rate_gbit" --sizes-mb ${SIZES_MB:-4 16} \
      --repeats "${REPEATS:-15}" --out "$TMP/$1.json" && break
    [ -s "$TMP/$1.json" ] && break
  done
done
"$PY" - "$TMP" "$OUT/tolerant-$RATE.json" <<'PY'
import glob, json, os, sys
runs = [json.load(open(f)) for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.json")))]
json.dump({"command": "bash benchmarks/tolerant.sh", "runs": runs}, open(sys.argv[2], "w"), indent=2)
print(f"{sys.argv[2]}: {sum(len(r['rows']) for r in runs)} rows")
PY
