#!/usr/bin/env bash
# The network benchmark in one command (root: it starts an emulated cluster of 4 nodes at RATE
# with 2 slots each, and removes it on any exit):
#
#   bash benchmarks/network.sh [RATE] [OUT_DIR]      # default: 1gbit, benchmarks/results
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
PY=$(pwd)/.venv/bin/python
TMP=$(mktemp -d)
trap 'bash tests/cluster/stop.sh; rm -rf "$TMP"' EXIT
bash tests/cluster/start.sh 4 "$RATE" 2 || exit 1
rate_gbit=$("$PY" -c "import re,sys; m=re.fullmatch(r'([0-9.]+)([kmg]?)bit', sys.argv[1]); \
print(float(m.group(1)) * {'': 1e-9, 'k': 1e-6, 'm': 1e-3, 'g': 1}[m.group(2)])" "$RATE")
# Open MPI's tuned Allreduce algorithms (coll_tuned_allreduce_algorithm)
ALGOS="1:basic-linear 2:nonoverlapping 3:recursive-doubling 4:ring 5:segmented-ring 6:rabenseifner"
run() {  # RANKS MAP LABEL "PARTS [BENCH FLAGS]" [MCA...]
  local n=$1 map=$2 label=$3 parts=$4
  shift 4
  for attempt in 1 2; do  # once more after the launcher's teardown hang (exit 3)
    MPIEXEC_EXTRA="$*" timeout -k 10 900 tests/cluster/mpiexec -n "$n" --map-by "$map" "$PY" \
      benchmarks/bench_network.py --rate-gbit "$rate_gbit" --label "$label" --parts $parts \
      --out "$TMP/$n-$label.json" && return 0
    [ -s "$TMP/$n-$label.json" ] && return 0
  done
  echo "benchmarks/network.sh: $n ranks, $label: failed" >&2
}
for spec in "4 node" "8 slot"; do
  set -- $spec
  run "$1" "$2" default "p1 p2 p3"
  run "$1" "$2" straggler "p4 --sizes-mb 1 --compute-ms 200"
  for a in $ALGOS; do
    run "$1" "$2" "${a#*:}" p1 --mca coll_tuned_use_dynamic_rules 1 --mca coll_tuned_allreduce_algorithm "${a%%:*}"
  done
done
mkdir -p "$OUT"
"$PY" - "$TMP" "$OUT" "$RATE" <<'PY'
import glob, json, os, sys
tmp, out, rate = sys.argv[1:]
rows = [r for f in sorted(glob.glob(os.path.join(tmp, "*.json"))) for r in json.load(open(f))]
json.dump(rows, open(os.path.join(out, "network.json"), "w"), indent=2)
lines = [f"Emulated cluster: 4 nodes at {rate}, `bash benchmarks/network.sh`; medians of paired repeats, "
         "ratio = ours / raw (quartiles), link = the link's limit / time.", "",
         "| comparison | MB | ranks | raw algorithm | ours ms | raw ms | ratio (q1-q3) | link ours | link raw |",
         "|---|---|---|---|---|---|---|---|---|"]
def line(r):
    link = (f"{r['link_ours']:.2f} | {r['link_other']:.2f}") if "link_ours" in r else "- | -"
    return (f"| {r['what']} | {r['mb']:g} | {r['ranks']} | {r['algorithm']} | {r['ours_ms']:.1f} | {r['other_ms']:.1f} | "
            f"{r['ratio']:.3f} ({r['q1']:.2f}-{r['q3']:.2f}) | {link} |")
for ranks in sorted({r["ranks"] for r in rows}):
    for mb in sorted({r["mb"] for r in rows}):
        p1 = [r for r in rows if r["ranks"] == ranks and r["mb"] == mb and r["what"].startswith("P1")]
        if p1:
            best = min(p1, key=lambda r: r["other_ms"])
            lines.append(line(dict(best, algorithm=best["algorithm"] + " (fastest raw)")))
            default = [r for r in p1 if r["algorithm"] == "default"]
            if default and default[0] is not best:
                lines.append(line(default[0]))
        lines += [line(r) for r in rows if r["ranks"] == ranks and r["mb"] == mb and r["what"][:2] in ("P2", "P3")]
p4 = [r for r in rows if r["what"].startswith("P4")]
if p4:
    lines += ["", f"P4: every step sleeps {p4[0]['compute_ms']:g} ms (rank 1: twice that), then a small forward/backward "
              "and the algorithm's step; throughput = sum over ranks of each rank's own steps per second.", "",
              "| ranks | MB | algorithm | steps/s | with rank 1 2x slow | kept |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['ranks']} | {r['mb']:g} | {r['algorithm']} | {r['steps_per_s']:.2f} | "
              f"{r['steps_per_s_straggler']:.2f} | {r['keep']:.3f} |" for r in p4]
lines += ["", "Every raw Allreduce algorithm tried (ms): " + "; ".join(
    f"{r['ranks']} ranks {r['mb']:g} MB {r['algorithm']} {r['other_ms']:.0f}" for r in rows if r["what"].startswith("P1"))]
open(os.path.join(out, "network.md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
