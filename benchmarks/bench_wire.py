"""Compressed messages against the buffer's own dtype, side by side in one launch.

    mpiexec -n 4 python benchmarks/bench_wire.py [--sizes-mb 16] [--repeats 9] [--rate-gbit 1] [--node-aware]
        [--out FILE.json]

For each size and wire format (bf16, fp16, int8), alternately, repeat after repeat:

* ``PushSum.step`` with ``wire=FMT`` / the same step in float32 (exponential graph, one peer);
* ``AllreduceAverager.average`` with ``wire=FMT`` (reduce-scatter + allgather of encoded
  shards) / the float32 one (MPI's ``Allreduce``);
* with ``--node-aware`` (several ranks per node): ``AllreduceAverager.average`` with
  ``wire=FMT`` node-aware (``algorithm="node-ring"``) / the flat compressed one;

and, on one rank with no messages, the arithmetic alone: PushSum's encode-with-kept-error plus
decode-combine of one message, over float32's combine (``cpu_ms``). Each row gives the
median time of each side, the median ratio (quartiles), and the bytes one rank sends. Run it
on several nodes (``benchmarks/wire.sh`` starts the emulated cluster): on one node shared
memory moves bytes faster than the formats save.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np
from mpi4py import MPI

import mpigossip as mg
from mpigossip.core import kernels
from mpigossip.core.wire import FORMATS, Wire

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import side_by_side  # noqa: E402


def arithmetic_ms(n, fmt, repeats=5):
    """Median ms of PushSum's compressed arithmetic for one message (encode keeping the error,
    then decode-combine), and of float32's combine, on this rank alone."""
    rng = np.random.default_rng(0)
    x, r = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    code = Wire(fmt, np.float32)
    wire = np.empty(code.nbytes(n), np.uint8)
    ours, plain = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        code.encode(x, wire, share=0.5)
        code.decode_sum(x, x, 1.0, [wire], [0.5])
        ours.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        kernels.weighted_sum(x, x, 0.5, [r], [0.5], keep_recvs=True)
        plain.append(time.perf_counter() - t0)
    return float(np.median(ours)) * 1e3, float(np.median(plain)) * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[16])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--rate-gbit", type=float, default=1.0, help="each node's link rate, for the table")
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    parser.add_argument("--node-aware", action="store_true",
                        help="also the node-aware compressed mean (algorithm='node-ring': reduce inside each node, "
                        "compress between nodes) against the flat one, per format (several ranks per node)")
    parser.add_argument("--out", help="write the rows and the run's metadata as JSON here")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    nodes = len(set(comm.allgather(MPI.Get_processor_name())))
    rows = []
    for mb in args.sizes_mb:
        n = int(mb * 2 ** 20) // 4
        x = np.random.default_rng(comm.rank).standard_normal(n).astype(np.float32)
        y = x.copy()
        topo = mg.topology.ExponentialGraph(peers=1)
        with mg.PushSum(y, comm=comm, topology=topo) as plain_ps, mg.AllreduceAverager(y, comm=comm) as plain_ar:
            for fmt in args.formats:
                code = Wire(fmt, np.float32)
                extra = dict(format=fmt, nodes=nodes, rate_gbit=args.rate_gbit,
                             wire_bytes=code.nbytes(n), fp32_bytes=4 * n)
                cpu, cpu32 = arithmetic_ms(n, fmt) if comm.rank == 0 else (None, None)
                with mg.PushSum(x, comm=comm, topology=topo, wire=fmt) as ps:
                    rows.append(side_by_side(comm, f"PushSum.step {fmt} / float32", mb, ps.step, plain_ps.step,
                                             args.repeats, cpu_ms=cpu, cpu_fp32_ms=cpu32, **extra))
                with mg.AllreduceAverager(x, comm=comm, wire=fmt) as ar:
                    rows.append(side_by_side(comm, f"AllreduceAverager {fmt} / float32", mb, ar.average,
                                             plain_ar.average, args.repeats, **extra))
                shown = 2
                if args.node_aware:
                    z = x.copy()
                    with mg.AllreduceAverager(x, comm=comm, wire=fmt, algorithm="node-ring") as node_ar, \
                            mg.AllreduceAverager(z, comm=comm, wire=fmt, algorithm="mpi") as flat_ar:
                        rows.append(side_by_side(comm, f"AllreduceAverager {fmt} node-aware / flat", mb,
                                                 node_ar.average, flat_ar.average, args.repeats, **extra))
                    shown = 3
                if comm.rank == 0:
                    for r in rows[-shown:]:
                        print(f"{r['what']:<36} {mb:g} MB {comm.size} ranks/{nodes} nodes: {r['ours_ms']:.1f} ms vs "
                              f"{r['other_ms']:.1f} ms, ratio {r['ratio']:.3f} ({r['q1']:.2f}-{r['q3']:.2f})"
                              + (f", arithmetic {cpu:.1f} ms vs {cpu32:.1f}" if r["what"].startswith("PushSum")
                                 else ""), flush=True)
    if comm.rank == 0 and args.out:
        import mpi4py
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
        meta = {"commit": commit, "mpigossip": mg.__version__, "command": " ".join(sys.argv), "ranks": comm.size, "nodes": nodes,
                "python": platform.python_version(), "mpi4py": mpi4py.__version__,
                "mpi": MPI.Get_library_version().split(",")[0], "numpy": np.__version__}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
