"""Communication benchmark: mpigossip's communicators against raw mpi4py on the same bytes.

    mpigossip-mpiexec -n 4 python benchmarks/bench_comm.py [--sizes-mb 4 16 64] [--repeats 15] [--out FILE]

Each pair (ours, raw) is timed alternately in the same run, repeat after repeat, and the
ratio of medians is reported, so machine noise hits both sides alike. Times are the max
over ranks of each round (the slowest rank sets the pace).
"""

import argparse
import json
import statistics
import time

import numpy as np
from mpi4py import MPI

import mpigossip as mg


def timed(comm, fn):
    comm.Barrier()
    t0 = time.perf_counter()
    fn()
    return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)


def side_by_side(comm, a, b, repeats):
    ta, tb = [], []
    a(), b()  # warm up
    for _ in range(repeats):
        ta.append(timed(comm, a))
        tb.append(timed(comm, b))
    return statistics.median(ta), statistics.median(tb)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[4, 16, 64])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    rows = []
    for mb in args.sizes_mb:
        n = int(mb * 2 ** 20) // 4
        x = np.random.default_rng(rank).standard_normal(n).astype(np.float32)
        raw = x.copy()

        avg = mg.AllreduceAverager(x, comm=comm)
        ours, theirs = side_by_side(comm, avg.average,
                                    lambda: comm.Allreduce(MPI.IN_PLACE, raw, MPI.SUM), args.repeats)
        rows.append({"what": "AllreduceAverager.average / Allreduce", "mb": mb, "ranks": size,
                     "ours_ms": ours * 1e3, "raw_ms": theirs * 1e3, "ratio": ours / theirs})
        avg.free()

        if size > 1:
            topo = mg.topology.ExponentialGraph(peers=1)
            ps = mg.PushSum(x, comm=comm, topology=topo)
            bound = ps.topology
            recv = np.empty_like(raw)
            step = [0]

            def raw_exchange():  # the same messages PushSum sends, without arithmetic
                k = step[0]
                step[0] += 1
                (dst,), (src,) = bound.out_peers(rank, k), bound.in_peers(rank, k)
                MPI.Request.Waitall([comm.Irecv(recv, source=src, tag=7), comm.Isend(raw, dest=dst, tag=7)])

            ours, theirs = side_by_side(comm, ps.step, raw_exchange, args.repeats)
            rows.append({"what": "PushSum.step / raw Isend+Irecv", "mb": mb, "ranks": size,
                         "ours_ms": ours * 1e3, "raw_ms": theirs * 1e3, "ratio": ours / theirs})
            avg = mg.AllreduceAverager(raw, comm=comm)
            ours, theirs = side_by_side(comm, ps.step, avg.average, args.repeats)
            rows.append({"what": "PushSum.step / AllreduceAverager.average", "mb": mb, "ranks": size,
                         "ours_ms": ours * 1e3, "raw_ms": theirs * 1e3, "ratio": ours / theirs})
            avg.free()
            ps.free()
    if rank == 0:
        print(f"{'comparison':<42} {'MB':>6} {'ranks':>5} {'ours ms':>9} {'other ms':>9} {'ratio':>6}")
        for r in rows:
            print(f"{r['what']:<42} {r['mb']:>6g} {r['ranks']:>5} {r['ours_ms']:>9.2f} {r['raw_ms']:>9.2f} "
                  f"{r['ratio']:>6.3f}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
