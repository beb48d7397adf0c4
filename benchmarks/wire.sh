#!/usr/bin/env bash
# Compressed messages on the emulated cluster (root: starts 4 nodes at RATE, one rank each, and
# removes them on any exit):
#
#   bash benchmarks/wire.sh [RATE] [OUT_DIR] [SIZES_MB]   # default: 1gbit benchmarks/results "16"
#
# writes OUT_DIR/wire-RATE.json (rows and metadata: commit, versions) and OUT_DIR/wire-RATE.md.
set -u
cd "$(dirname "$0")/.."
RATE=${1:-1gbit}
OUT=${2:-benchmarks/results}
SIZES=${3:-16}
. benchmarks/_cluster.sh
start_cluster "$RATE" 1
mkdir -p "$OUT"
timeout -k 10 1800 tests/cluster/mpiexec -n 4 --map-by node "$PY" benchmarks/bench_wire.py --sizes-mb $SIZES \
  --rate-gbit "$rate_gbit" --out "$OUT/wire-$RATE.json" || exit 1
"$PY" - "$OUT/wire-$RATE.json" "$RATE" > "$OUT/wire-$RATE.md" <<'PYEOF'
import json, sys
d = json.load(open(sys.argv[1]))
m = d["meta"]
print(f"Emulated cluster: {m['nodes']} nodes at {sys.argv[2]}, {m['ranks']} ranks, `bash benchmarks/wire.sh` at "
      f"{m['commit']} ({m['mpi']}, mpi4py {m['mpi4py']}, numpy {m['numpy']}, Python {m['python']}).")
print("Medians of interleaved repeats; ratio = compressed / float32 (quartiles); bytes: one message, "
      "compressed / float32; arithmetic: PushSum's encode + decode-combine of one message on one core, "
      "vs float32's combine.\n")
print("| comparison | MB | compressed ms | float32 ms | ratio (q1-q3) | bytes ratio | arithmetic ms (fp32) |")
print("|---|---|---|---|---|---|---|")
for r in d["rows"]:
    cpu = f"{r['cpu_ms']:.1f} ({r['cpu_fp32_ms']:.1f})" if r.get("cpu_ms") is not None else "-"
    print(f"| {r['what']} | {r['mb']:g} | {r['ours_ms']:.1f} | {r['other_ms']:.1f} | {r['ratio']:.3f} "
          f"({r['q1']:.2f}-{r['q3']:.2f}) | {r['wire_bytes'] / r['fp32_bytes']:.3f} | {cpu} |")
PYEOF
cat "$OUT/wire-$RATE.md"
