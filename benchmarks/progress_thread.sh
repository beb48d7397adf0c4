#!/usr/bin/env bash
# Open MPI's TCP progress thread at a slow link (root): the P4 benchmark on two emulated nodes of
# one rank each, with `btl_tcp_progress_thread` on and off, alternated run by run, then the time
# model's prediction beside them (the model has no progress thread: it predicts the same for both).
#
#   bash benchmarks/progress_thread.sh [RATE] [OUT_DIR]   # default 100mbit, benchmarks/results
#
# Writes OUT_DIR/progress-thread-RATE.{json,md} (NODES or P4_MB set: progress-thread-RATE-NODESn-MBmb):
# P4_REPEATS (2) pairs of runs, P4_STEPS (20) steps, P4_ALGORITHMS (allreduce sgp osgp:4), NODES (2)
# nodes of one rank, a P4_MB (4) MB model, 200 ms of compute a step; a second table gives each
# rank's steps/s beside the model's. About 5 min here.
set -u
cd "$(dirname "$0")/.."
RATE=${1:-100mbit}
OUT=${2:-benchmarks/results}
NODES=${NODES:-2}
MB=${P4_MB:-4}
NAME=progress-thread-$RATE
if [ "$NODES" != 2 ] || [ "$MB" != 4 ]; then NAME=$NAME-${NODES}n-${MB}mb; fi
TMP=$(mktemp -d)
. benchmarks/_cluster.sh
start_cluster "$RATE" 1 "$NODES"
for repeat in $(seq 0 $(( ${P4_REPEATS:-2} - 1 ))); do
  for thread in 1 0; do
    OMPI_MCA_btl_tcp_progress_thread=$thread timeout -k 10 "${LIMIT_S:-900}" tests/cluster/mpiexec -n "$NODES" \
      --map-by node -x OMPI_MCA_btl_tcp_progress_thread "$PY" benchmarks/bench_network.py \
      --rate-gbit "$rate_gbit" --label "thread$thread" --parts p4 --compute-ms 200 --sizes-mb "$MB" \
      --p4-steps "${P4_STEPS:-20}" --p4-repeats 1 --p4-algorithms ${P4_ALGORITHMS:-allreduce sgp osgp:4} \
      --out "$TMP/thread$thread-$repeat.json" || echo "benchmarks/progress_thread.sh: thread=$thread repeat $repeat failed" >&2
  done
done
mkdir -p "$OUT"
"$PY" - "$TMP" "$OUT/$NAME" "$RATE" "$rate_gbit" "$NODES" "$MB" <<'PYEOF'
import glob, json, os, statistics, sys
from mpigossip.core import provenance
from mpigossip.sim import validation
from mpigossip.sim.timing import Costs
tmp, base, rate, rate_gbit = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
nodes, mb = sys.argv[5], sys.argv[6]
rows = []
for path in sorted(glob.glob(os.path.join(tmp, "thread*.json"))):
    thread, repeat = os.path.basename(path)[6:-5].split("-")
    for r in json.load(open(path)):
        rows.append(dict(r, progress_thread=thread == "1", repeat=int(repeat)))
costs = Costs.load("benchmarks/results/time-calibration-1gbit.json")
wrapped = os.path.join(tmp, "rows.json")   # one run's rows, as p4_table reads them
json.dump({"rows": json.load(open(sorted(glob.glob(os.path.join(tmp, "thread*.json")))[0]))}, open(wrapped, "w"))
table = validation.p4_table([wrapped], costs)
predicted = {(r["algorithm"], r["case"]): r["predicted"] for r in table}
predicted_by_rank = {(r["algorithm"], r["case"]): r["predicted_by_rank"] for r in table}
meta = {"commit": provenance.commit(), "versions": provenance.versions(),
        "command": "".join(f"{k}='{os.environ[k]}' " for k in ("P4_ALGORITHMS", "NODES", "P4_MB") if os.environ.get(k))
        + f"bash benchmarks/progress_thread.sh {rate}", "cluster": f"tests/cluster/start.sh {nodes} {rate} 1",
        "calibration": "benchmarks/results/time-calibration-1gbit.json"}
json.dump({"meta": meta, "rows": rows, "predicted": [{"algorithm": a, "case": c, "steps_per_s": v,
                                                     "by_rank": predicted_by_rank[(a, c)]}
                                                    for (a, c), v in predicted.items()]}, open(base + ".json", "w"), indent=2)
lines = [f"P4 on {nodes} emulated nodes x 1 rank at {rate}, {mb} MB, 200 ms of compute a step: steps/s summed over the ranks, "
         f"Open MPI's TCP progress thread on and off, alternated (medians over {len({r['repeat'] for r in rows})} "
         f"pairs), and the time model's prediction (`{meta['command']}` at {meta['commit']}; "
         f"{meta['versions']})", "",
         "| method | case | thread on (each run) | thread off (each run) | on / off | predicted |",
         "|---|---|---|---|---|---|"]
def runs(v):   # the median, then each run's value
    return f"{statistics.median(v):.2f} ({', '.join(f'{x:.2f}' for x in v)})"
for alg in dict.fromkeys(r["algorithm"] for r in rows):
    for case, key in (("no straggler", "steps_per_s"), ("rank 1 2x slow", "steps_per_s_straggler")):
        on = [r[key] for r in rows if r["algorithm"] == alg and r["progress_thread"]]
        off = [r[key] for r in rows if r["algorithm"] == alg and not r["progress_thread"]]
        pred = predicted.get((alg, case))
        lines.append(f"| {alg} | {case} | {runs(on)} | {runs(off)} | {statistics.median(on) / statistics.median(off):.2f} | "
                     + (f"{pred:.2f}" if pred is not None else "-") + " |")
lines += ["", "Each rank's steps/s (medians over the runs; rank 0 holds EASGD's center), the same runs:", "",
          "| method | case | rank | thread on | thread off | predicted |", "|---|---|---|---|---|---|"]
for alg in dict.fromkeys(r["algorithm"] for r in rows):
    for case, key in (("no straggler", "steps_per_s"), ("rank 1 2x slow", "steps_per_s_straggler")):
        mine = [r for r in rows if r["algorithm"] == alg and "rank_" + key in r]
        for rank in range(len(mine[0]["rank_" + key][0]) if mine else 0):
            on, off = ([v[rank] for r in mine if r["progress_thread"] == thread for v in r["rank_" + key]]
                       for thread in (True, False))
            pred = predicted_by_rank.get((alg, case))
            lines.append(f"| {alg} | {case} | {rank} | {runs(on)} | {runs(off)} | "
                         + (f"{pred[rank]:.2f}" if pred else "-") + " |")
open(base + ".md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PYEOF
