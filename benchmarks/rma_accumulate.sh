#!/usr/bin/env bash
# One-sided accumulates across the emulated cluster (root: it starts 4 nodes at RATE with 2 slots
# each and removes them on any exit): every variant of benchmarks/rma_accumulate.py, RUNS times each
# (a fresh launch per run: a hang ends only that run), with Open MPI's TCP progress thread off and on,
# at 4 ranks (one per node) and 8 (two per node). A run that has not finished in LIMIT seconds is a hang
# (faulthandler's watchdog prints the stacks and ends it). Writes OUT_DIR/rma-accumulate.md and .json.
#
#   bash benchmarks/rma_accumulate.sh [RATE] [OUT_DIR]    # default: 1gbit, benchmarks/results
#
# RUNS (3), MB (4), REPS (10), LIMIT (60), RANKS ("4 8") and VARIANTS override the matrix; ADD_ROWS
# names an earlier run's rows.jsonl (kept in OUT_DIR/rma-accumulate.json) to put in the same table.
set -u
cd "$(dirname "$0")/.."
RATE=${1:-1gbit}
OUT=${2:-benchmarks/results}
TMP=$(mktemp -d)
. benchmarks/_cluster.sh
start_cluster "$RATE" 2
RUNS=${RUNS:-3} MB=${MB:-4} REPS=${REPS:-10} LIMIT=${LIMIT:-60}
[ -n "${ADD_ROWS:-}" ] && cat "$ADD_ROWS" >>"$TMP/rows.jsonl"
VARIANTS=${VARIANTS:-"raccumulate raccumulate:none raccumulate:create raccumulate:dedicated accumulate get-accumulate lock"}
for n in ${RANKS:-4 8}; do
  map=$([ "$n" = 4 ] && echo node || echo slot)
  for thread in 0 1; do
    for spec in $VARIANTS; do
      variant=${spec%%:*} flags=()
      case "$spec" in
        *:none) flags=(--ordering none) ;;
        *:create) flags=(--flavor create) ;;
        *:dedicated) flags=(--dedicated) ;;
      esac
      for run in $(seq "$RUNS"); do
        log="$TMP/$n-$thread-${spec/:/-}-$run.log"
        start=$(date +%s.%N)
        OMPI_MCA_btl_tcp_progress_thread=$thread timeout -k 5 $((LIMIT + 30)) tests/cluster/mpiexec -n "$n" \
          --map-by "$map" "$PY" benchmarks/rma_accumulate.py --variant "$variant" "${flags[@]}" --mb "$MB" \
          --reps "$REPS" --timeout "$LIMIT" >"$log" 2>&1
        rc=$?
        wall=$(echo "$(date +%s.%N) - $start" | bc)
        "$PY" - "$log" "$rc" "$wall" "$n" "$thread" "$spec" "$run" "$MB" "$REPS" "$LIMIT" >>"$TMP/rows.jsonl" <<'PY'
import json, os, re, sys
log, rc, wall, n, thread, spec, run, mb, reps, limit = sys.argv[1:]
text = open(log, errors="replace").read()
row = next((json.loads(l) for l in text.splitlines() if l.startswith('{"variant"')), None)
hung = "Timeout (" in text or rc in ("124", "137")
# where the watchdog found each rank: the benchmark's own functions (MPI's C frames are not shown)
stuck_in = sorted(set(re.findall(r"rma_accumulate\.py\", line \d+ in (push|pull|main)", text))) if hung else []
print(json.dumps({"ranks": int(n), "mb": float(mb), "reps": int(reps), "limit_s": float(limit),
                  "thread": int(thread), "variant": spec, "run": int(run), "rc": int(rc),
                  "hung": hung, "ok": bool(row and row["ok"]), "s_per_exchange": row and row["s_per_exchange"],
                  "mb_s": row and row["mb_s"], "wall_s": float(wall), "stuck_in": stuck_in,
                  "tail": "" if row else text[-300:].replace(os.getcwd() + os.sep, "")}))
PY
        echo "rma_accumulate: $n ranks, thread $thread, $spec, run $run: rc $rc" >&2
      done
    done
  done
done
mkdir -p "$OUT"
"$PY" - "$TMP/rows.jsonl" "$OUT" "$RATE" <<'PY'
import json, os, statistics, subprocess, sys
rows_file, out, rate = sys.argv[1:]
rows = [json.loads(l) for l in open(rows_file)]
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
import mpi4py, numpy
from mpi4py import MPI
versions = {"mpi4py": mpi4py.__version__, "numpy": numpy.__version__,
            "mpi": MPI.Get_library_version().splitlines()[0].strip()}
meta = {"commit": commit, "rate": rate, **versions}
json.dump({"meta": meta, "rows": rows}, open(os.path.join(out, "rma-accumulate.json"), "w"), indent=1)
lines = [f"# One-sided accumulates across the emulated cluster ({rate}: a window of MB on rank 0, REPS push + pull "
         f"exchanges per rank, every rank at once)", "", f"commit {commit}; {versions['mpi']}; mpi4py {versions['mpi4py']}. "
         "Made by `bash benchmarks/rma_accumulate.sh`; each run a fresh launch; hung = not finished within the limit "
         "(faulthandler's watchdog printed every rank's stack). Time: per exchange (push + pull), the slowest rank's; "
         "MB/s: all workers' bytes through rank 0's link per second (the link: 125).", "",
         "| ranks | MB | reps | limit s | progress thread | variant | finished | hung | wrong sum | ms per exchange "
         "(median) | MB/s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
keys = []
for r in rows:
    k = (r["ranks"], r.get("mb"), r.get("reps"), r.get("limit_s"), r["thread"], r["variant"])
    if k not in keys:
        keys.append(k)
for k in keys:
    rs = [r for r in rows if (r["ranks"], r.get("mb"), r.get("reps"), r.get("limit_s"), r["thread"], r["variant"]) == k]
    done = [r for r in rs if r["ok"]]
    ms = statistics.median(r["s_per_exchange"] for r in done) * 1e3 if done else None
    mbs = statistics.median(r["mb_s"] for r in done) if done else None
    lines.append(f"| {k[0]} | {k[1]:g} | {k[2]} | {k[3]:g} | {'on' if k[4] else 'off'} | {k[5]} | {len(done)}/{len(rs)} | "
                 f"{sum(r['hung'] for r in rs)} | {sum(1 for r in rs if not r['ok'] and not r['hung'])} | "
                 f"{'-' if ms is None else f'{ms:.0f}'} | {'-' if mbs is None else f'{mbs:.0f}'} |")
open(os.path.join(out, "rma-accumulate.md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
