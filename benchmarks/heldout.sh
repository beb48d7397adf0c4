#!/usr/bin/env bash
# The time model's held-out shapes (root): the P4 straggler benchmark on cluster shapes, link
# rates and model sizes its calibration never saw (the calibration ran on 4 nodes x 2 ranks at
# 1 Gbit with 1 and 16 MB models), one rank per node, then `timemodel validate` on them.
#
#   bash benchmarks/heldout.sh [OUT_DIR]     # default benchmarks/results: OUT_DIR/p4-heldout.json
#
# SHAPES (default below: what benchmarks/results/p4-heldout.json ran) lists NODES:RATE:MB[,MB...] runs; P4_STEPS (20) and P4_REPEATS (2) as
# in network.sh; Open MPI's TCP progress thread on, as the calibration and the P4 rows ran. Two
# nodes of one rank each on this 2-core machine give every rank a core of its own: the regime
# the predictions past this machine assume (`timemodel predict`); three or more share the
# cores, as the calibrated rows did. Each shape starts a fresh emulated cluster. The rows keep
# their link rate and the machine's cores, which the validation reads. About an hour here (the default shapes, two repeats).
set -u
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results}
SHAPES=${SHAPES:-"2:1gbit:4,64 2:500mbit:4 2:100mbit:4 3:1gbit:4,64 3:500mbit:4"}
TMP=$(mktemp -d)
. benchmarks/_cluster.sh
export OMPI_MCA_btl_tcp_progress_thread=${OMPI_MCA_btl_tcp_progress_thread:-1}
for shape in $SHAPES; do
  IFS=: read -r nodes rate sizes <<<"$shape"
  start_cluster "$rate" 1 "$nodes"
  for attempt in 1 2; do  # once more after the launcher's teardown hang (exit 3)
    timeout -k 10 "${LIMIT_S:-1800}" tests/cluster/mpiexec -n "$nodes" --map-by node "$PY" \
      benchmarks/bench_network.py --rate-gbit "$rate_gbit" --label heldout --parts p4 --compute-ms 200 \
      --sizes-mb ${sizes//,/ } --p4-steps "${P4_STEPS:-20}" --p4-repeats "${P4_REPEATS:-2}" \
      --p4-algorithms ${P4_ALGORITHMS:-allreduce sgp osgp:4 agp gossip-pull easgd adpsgd} \
      --out "$TMP/$nodes-$rate.json" && break
    [ -s "$TMP/$nodes-$rate.json" ] && break
  done
  [ -s "$TMP/$nodes-$rate.json" ] || echo "benchmarks/heldout.sh: $shape: failed" >&2
  bash tests/cluster/stop.sh
done
mkdir -p "$OUT"
"$PY" - "$TMP" "$OUT/p4-heldout.json" "$SHAPES" <<'EOF'
import glob, json, os, sys
from mpigossip.core import provenance
tmp, out, shapes = sys.argv[1:]
rows = [r for f in sorted(glob.glob(os.path.join(tmp, "*.json"))) for r in json.load(open(f))]
meta = {"commit": provenance.commit(), "versions": provenance.versions(), "command": "bash benchmarks/heldout.sh",
        "shapes": shapes, "cluster": "tests/cluster/start.sh NODES RATE 1 (emulated nodes on one machine)",
        "tcp_progress_thread": True}
json.dump({"meta": meta, "rows": rows}, open(out, "w"), indent=2)
print(f"{out}: {len(rows)} rows")
EOF
