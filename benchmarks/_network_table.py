"""The tables of ``benchmarks/network.sh`` from its launches' JSON rows (a helper, not a benchmark):

    python benchmarks/_network_table.py ROWS_DIR OUT_DIR RATE all|p4 PROGRESS_THREAD(0|1) "P4 FLAGS"

writes ``OUT_DIR/network.{md,json}`` (all) or ``OUT_DIR/p4-RATE.{md,json}`` (p4), with the commit
and library versions. Rows of several launches (e.g. 4 ranks in one run, 8 in another) are merged.
"""
import glob
import json
import os
import platform
import subprocess
import sys

import mpi4py
import numpy
from mpi4py import MPI

import mpigossip

tmp, out, rate, mode, thread, p4 = sys.argv[1:]
rows = [r for f in sorted(glob.glob(os.path.join(tmp, "*.json"))) for r in json.load(open(f))]
try:
    import torch
    torch_version = torch.__version__
except ImportError:
    torch_version = None
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
meta = {"commit": commit, "mpigossip": mpigossip.__version__, "command": f"bash benchmarks/network.sh {rate} OUT {mode}",
        "p4": " ".join(p4.split()),
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
