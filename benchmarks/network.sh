#!/usr/bin/env bash
# The network benchmark in one command (root: it starts an emulated cluster of 4 nodes at RATE
# with 2 slots each, and removes it on any exit):
#
#   bash benchmarks/network.sh [RATE] [OUT_DIR] [all|p4]   # default: 1gbit, benchmarks/results, all
#
# "p4" runs only the straggler part, at 1 and 16 MB (P4_MB), P4_REPEATS (3) interleaved repeats of
# P4_STEPS (20) steps, with Open MPI's TCP progress thread on unless OMPI_MCA_btl_tcp_progress_thread
# is set (0 turns it off), and writes OUT_DIR/p4-RATE.md and p4-RATE.json (about 40 minutes).
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
    MPIEXEC_EXTRA="$*" timeout -k 10 "${LIMIT_S:-900}" tests/cluster/mpiexec -n "$n" --map-by "$map" "$PY" \
      benchmarks/bench_network.py --rate-gbit "$rate_gbit" --label "$label" --parts $parts \
      --out "$TMP/$n-$label.json" && return 0
    [ -s "$TMP/$n-$label.json" ] && return 0
  done
  echo "benchmarks/network.sh: $n ranks, $label: failed" >&2
}
P4="p4 --compute-ms 200 --sizes-mb ${P4_MB:-1 16} --p4-steps ${P4_STEPS:-20} --p4-repeats ${P4_REPEATS:-3}
    --p4-algorithms allreduce sgp osgp:4 agp gossip-pull easgd adpsgd"
if [ "$MODE" = p4 ]; then
  export OMPI_MCA_btl_tcp_progress_thread=${OMPI_MCA_btl_tcp_progress_thread:-1} LIMIT_S=2400
  run 4 node straggler "$P4"
  run 8 slot straggler "$P4"
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
"$PY" - "$TMP" "$OUT" "$RATE" "$MODE" "${OMPI_MCA_btl_tcp_progress_thread:-0}" "$P4" <<'PY'
import glob, json, os, platform, subprocess, sys
import mpi4py, numpy
from mpi4py import MPI
tmp, out, rate, mode, thread, p4 = sys.argv[1:]
rows = [r for f in sorted(glob.glob(os.path.join(tmp, "*.json"))) for r in json.load(open(f))]
try:
    import torch
    torch_version = torch.__version__
except ImportError:
    torch_version = None
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
meta = {"commit": commit, "command": f"bash benchmarks/network.sh {rate} OUT {mode}", "p4": " ".join(p4.split()),
        "cluster": f"tests/cluster/start.sh 4 {rate} 2 (4 emulated nodes on one 2-core machine)",
        "tcp_progress_thread": thread == "1", "python": platform.python_version(), "mpi4py": mpi4py.__version__,
        "mpi": MPI.Get_library_version().split(",")[0], "numpy": numpy.__version__, "torch": torch_version}
name = "network" if mode == "all" else f"p4-{rate}"
json.dump({"meta": meta, "rows": rows}, open(os.path.join(out, name + ".json"), "w"), indent=2)
lines = [f"Emulated cluster: 4 nodes at {rate}, `bash benchmarks/network.sh {rate} OUT {mode}` at {commit}; "
         f"Open MPI's TCP progress thread {'on' if thread == '1' else 'off'}."]
if mode == "all":
    lines += ["Medians of paired repeats, ratio = ours / raw (quartiles), link = the link's limit / time.", "",
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
    repeats = p4[0].get("repeats", 1)
    lines += ["", f"P4: every step sleeps {p4[0]['compute_ms']:g} ms (rank 1: twice that), then a small forward/backward "
              "and the algorithm's step; every algorithm communicates every step. Throughput = sum over ranks of each "
              f"rank's own steps per second; medians of {repeats} interleaved repeat(s), kept = with / without the "
              "straggler (range over repeats), x AllReduce = against AllReduce in the same repeat with the "
              "straggler; in step = mean ms inside the algorithm's step() without the straggler; link = one "
              "model's bytes at the link's rate.", "",
              "| ranks | MB | algorithm | steps/s | with rank 1 2x slow | kept (range) | x AllReduce, straggler | "
              "in step ms | link ms |", "|---|---|---|---|---|---|---|---|---|"]
    for r in p4:
        lo, hi = r.get("keep_range", [r["keep"], r["keep"]])
        lines.append(f"| {r['ranks']} | {r['mb']:g} | {r['algorithm']} | {r['steps_per_s']:.2f} | "
                     f"{r['steps_per_s_straggler']:.2f} | {r['keep']:.3f} ({lo:.2f}-{hi:.2f}) | "
                     f"{r.get('vs_allreduce_straggler', float('nan')):.2f} | {r.get('exchange_ms', float('nan')):.0f} | "
                     f"{r.get('link_ms', float('nan')):.0f} |")
if mode == "all":
    lines += ["", "Every raw Allreduce algorithm tried (ms): " + "; ".join(
        f"{r['ranks']} ranks {r['mb']:g} MB {r['algorithm']} {r['other_ms']:.0f}" for r in rows if r["what"].startswith("P1"))]
open(os.path.join(out, name + ".md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
