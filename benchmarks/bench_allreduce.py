"""AllReduce at the network's limit: every algorithm of ``AllreduceAverager`` side by side,
against the bandwidth limit and against MPI's own ``Allreduce``, per size.

    mpiexec -n P python benchmarks/bench_allreduce.py [--sizes-mb 0.0625 0.25 1 4 16]
        [--repeats 7] [--rate-gbit 1] [--label NAME] [--out FILE]

For each size, the algorithms ``mpi`` (MPI's ``Allreduce`` under the launch's settings:
``--label`` names them), ``ring`` and ``node-ring`` (:mod:`mpigossip.exact.ring`), what ``auto``
picks, and a raw mpi4py ``Allreduce`` (``MPI.IN_PLACE``) followed by the ``1/P`` pass, are
timed in turn, repeat after repeat (machine noise hits all alike); a round's time is the
slowest rank's. Reports medians (ms), each one's ratio to the bandwidth limit
``2 (N - 1) / N x S`` at the link's rate (N nodes: the bytes the busiest node link carries in
one direction), and to the raw ``Allreduce``. ``benchmarks/allreduce.sh`` runs it on the
emulated cluster at 4 ranks (one per node) and 8 (two per node), under Open MPI's default
decision and its ring forced.
"""

import argparse
import json
import os
import sys
import time

import numpy as np
from mpi4py import MPI

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import mpigossip as mg  # noqa: E402
from mpigossip.exact.ring import Layout  # noqa: E402
from mpigossip.reproduce import setup  # noqa: E402

ALGORITHMS = ("mpi", "ring", "node-ring")


def timed(comm, fn):
    comm.Barrier()
    t0 = time.perf_counter()
    fn()
    return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[0.0625, 0.25, 1, 4, 16])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rate-gbit", type=float, default=1.0)
    parser.add_argument("--label", default="default")
    parser.add_argument("--segment-kb", type=float, nargs="+", default=None,
                        help="the rings' segment_bytes / 1024 (default: AllreduceAverager's); several: each "
                             "timed side by side, as ring@KB and node-ring@KB")
    parser.add_argument("--out", default=None)
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="no run: merge these results into OUT.json/.md")
    parser.add_argument("--rate", default="1gbit", help="with --merge: the link rate's name")
    args = parser.parse_args()
    if args.merge:
        return merge(args.merge, args.out, args.rate)
    comm = MPI.COMM_WORLD
    layout = Layout(comm, timeout=120)
    nodes = layout.nodes or comm.size
    rows = []
    for mb in args.sizes_mb:
        n = max(1, int(mb * (1 << 20)) // 4)
        x = np.ones(n, np.float32)
        probe = mg.AllreduceAverager(x, comm=comm, layout=layout)
        auto, default_segment = probe.algorithm, probe.segment_bytes
        probe.free()
        segments = [int(kb * 1024) for kb in args.segment_kb] if args.segment_kb else [default_segment]
        avgs = {"mpi": mg.AllreduceAverager(x, comm=comm, algorithm="mpi", layout=layout)}
        for seg in segments:
            for a in ALGORITHMS[1:]:
                name = a if len(segments) == 1 else f"{a}@{seg / 1024:g}"
                avgs[name] = mg.AllreduceAverager(x, comm=comm, algorithm=a, layout=layout, segment_bytes=seg)

        def raw(x=x):
            comm.Allreduce(MPI.IN_PLACE, x, MPI.SUM)
            np.multiply(x, np.float32(1.0 / comm.size), out=x)

        fns = dict({a: avg.average for a, avg in avgs.items()}, raw=raw)
        for fn in fns.values():  # warm-up
            fn()
        times = {k: [] for k in fns}
        for _ in range(args.repeats):
            for k, fn in fns.items():
                times[k].append(timed(comm, fn))
        limit = 2 * (nodes - 1) / nodes * x.nbytes / (args.rate_gbit * 1e9 / 8) if nodes > 1 else float("nan")
        med = {k: float(np.median(v)) for k, v in times.items()}
        row = {"mb": mb, "bytes": int(x.nbytes), "ranks": comm.size, "nodes": nodes, "label": args.label,
               "segment_kb": [seg / 1024 for seg in segments],
               "auto": auto, "limit_ms": limit * 1e3, "ms": {k: v * 1e3 for k, v in med.items()},
               "vs_limit": {k: v / limit for k, v in med.items()},
               "vs_raw": {k: float(np.median(np.array(times[k]) / np.array(times["raw"]))) for k in fns},
               "range_ms": {k: [min(v) * 1e3, max(v) * 1e3] for k, v in times.items()}}
        rows.append(row)
        if comm.rank == 0:
            print(f"{mb:g} MB, {comm.size} ranks on {nodes} nodes ({args.label}, segments {'/'.join(f'{seg / 1024:g}' for seg in segments)} KiB), limit {limit * 1e3:.1f} ms, "
                  f"auto={auto}: " + ", ".join(f"{k} {row['ms'][k]:.1f} ms ({row['vs_limit'][k]:.2f}x)"
                                                for k in fns), flush=True)
        for a in avgs.values():
            a.free()
    layout.free()
    if comm.rank == 0 and args.out:
        with open(args.out, "w") as f:
            command = " ".join(os.path.basename(a) if a == args.out else a for a in sys.argv)  # no machine path
            json.dump({"meta": {"commit": setup.commit(), "versions": setup.versions(), "command": command,
                                "repeats": args.repeats, "rate_gbit": args.rate_gbit, "machine": setup.machine()},
                       "rows": rows}, f, indent=1)


def merge(paths, out, rate):
    """One table from the launches' results: per ranks and size, every algorithm's time and its
    ratio to the limit, what auto picks, and MPI's default and Open MPI's ring as baselines."""
    runs = [json.load(open(p)) for p in paths]
    rows = [r for run in runs for r in run["rows"]]
    meta = dict(runs[0]["meta"], launches=[run["meta"]["command"] for run in runs])
    seg = "/".join(f"{kb:g}" for kb in rows[0]["segment_kb"])
    lines = [f"AllReduce of float32 buffers on 4 emulated nodes at {rate} (`bash benchmarks/allreduce.sh`), "
             f"at {meta['commit']} ({meta['versions']}); medians of {meta['repeats']} interleaved repeats, a round's "
             "time the slowest rank's. limit: 2 (N-1)/N x size at the link's rate (N nodes). `mpi`: "
             "AllreduceAverager over MPI's Allreduce; `raw`: mpi4py's Allreduce + the 1/P pass; `ring`, "
             f"`node-ring`: mpigossip.exact.ring (segments of {seg} KiB); `auto`: what AllreduceAverager picks. "
             "Ranks per core: 4 ranks = 2 per core, 8 ranks = 4 per core (this machine has 2 cores: the 8-rank "
             "rows are CPU-bound, TCP and the reductions competing).", ""]
    for ranks in sorted({r["ranks"] for r in rows}):
        lines += [f"**{ranks} ranks** ({ranks // 4} per node)", "",
                  "| MB | limit ms | auto | mpi (default) | raw (default) | raw (Open MPI ring) | ring | node-ring "
                  "| auto / limit | auto / best raw |", "|---|---|---|---|---|---|---|---|---|---|"]
        for mb in sorted({r["mb"] for r in rows if r["ranks"] == ranks}):
            by = {r["label"]: r for r in rows if r["ranks"] == ranks and r["mb"] == mb}
            d, o = by.get("default"), by.get("ompi-ring")
            if d is None:
                continue
            cell = lambda r, k: f"{r['ms'][k]:.1f} ({r['vs_limit'][k]:.2f}x)" if r else "-"  # noqa: E731
            best_raw = min(d["ms"]["raw"], o["ms"]["raw"] if o else float("inf"))
            auto = d["ms"][d["auto"]]
            lines.append(f"| {mb:g} | {d['limit_ms']:.1f} | {d['auto']} | {cell(d, 'mpi')} | {cell(d, 'raw')} | "
                         f"{cell(o, 'raw')} | {cell(d, 'ring')} | {cell(d, 'node-ring')} | "
                         f"{auto / d['limit_ms']:.2f} | {auto / best_raw:.2f} |")
        lines.append("")
    with open(out + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
