"""Communication benchmark: mpigossip's communicators against raw mpi4py on the same bytes.

    mpigossip-mpiexec -n 4 python benchmarks/bench_comm.py [--sizes-mb 4 16 64] [--repeats 25] [--kind numpy|torch]
        [--out FILE]

Each pair (ours, other) is timed alternately in the same run, repeat after repeat, so
machine noise hits both sides alike. A round's time is the max over ranks (the slowest
rank sets the pace). The ratio is the median of the per-repeat ratios ours/other, with
its quartiles, so one noisy repeat moves neither.

Two kinds of "other": the raw MPI call on the same bytes (the issue's targets), and the
raw MPI call followed by the arithmetic the algorithm cannot skip (the 1/n of a mean,
PushSum's combine, done by the same kernels): that second ratio is the cost of the
communicator itself. ``--kind torch``: the communicators hold a torch tensor (the raw calls
the same bytes as numpy). Every row records the commit and the versions.
"""

import argparse
import json

import numpy as np
from _timing import side_by_side  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
from mpi4py import MPI

import mpigossip as mg
from mpigossip.core import kernels, provenance


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[4, 16, 64])
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--kind", choices=("numpy", "torch"), default="numpy", help="the communicators' buffer")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    stamp = {"kind": args.kind, "commit": provenance.commit(), "versions": provenance.versions()}
    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    rows = []
    for mb in args.sizes_mb:
        n = int(mb * 2 ** 20) // 4
        x = np.random.default_rng(rank).standard_normal(n).astype(np.float32)
        raw = x.copy()
        inv = 1.0 / size
        if args.kind == "torch":
            import torch
            x = torch.from_numpy(x)

        def allreduce():
            comm.Allreduce(MPI.IN_PLACE, raw, MPI.SUM)

        def allreduce_and_scale():
            comm.Allreduce(MPI.IN_PLACE, raw, MPI.SUM)
            kernels.scale(raw, inv)

        avg = mg.AllreduceAverager(x, comm=comm)
        rows.append(side_by_side(comm, "AllreduceAverager.average / Allreduce", mb, avg.average, allreduce,
                                 args.repeats))
        rows.append(side_by_side(comm, "AllreduceAverager.average / Allreduce+scale", mb, avg.average,
                                 allreduce_and_scale, args.repeats))
        avg.free()

        if size > 1:
            ps = mg.PushSum(x, comm=comm, topology=mg.topology.ExponentialGraph(peers=1))
            bound = ps.topology
            recv = np.empty_like(raw)
            step = [0]

            def exchange():  # the same messages PushSum sends, without arithmetic
                k = step[0]
                step[0] += 1
                (dst,), (src,) = bound.out_peers(rank, k), bound.in_peers(rank, k)
                MPI.Request.Waitall([comm.Irecv(recv, source=src, tag=7), comm.Isend(raw, dest=dst, tag=7)])

            def exchange_and_combine():  # plus the combine PushSum must do: raw = (raw + recv) / 2
                exchange()
                kernels.weighted_sum(raw, raw, 0.5, [recv], [0.5])

            rows.append(side_by_side(comm, "PushSum.step / Isend+Irecv", mb, ps.step, exchange, args.repeats))
            rows.append(side_by_side(comm, "PushSum.step / Isend+Irecv+combine", mb, ps.step,
                                     exchange_and_combine, args.repeats))
            avg = mg.AllreduceAverager(raw, comm=comm)
            rows.append(side_by_side(comm, "PushSum.step / AllreduceAverager.average", mb, ps.step, avg.average,
                                     args.repeats))
            avg.free()
            ps.free()
    if rank == 0:
        print(f"{'comparison':<44} {'MB':>5} {'ranks':>5} {'ours ms':>8} {'other ms':>8} {'ratio':>6} "
              f"{'quartiles':>11}")
        for r in rows:
            print(f"{r['what']:<44} {r['mb']:>5g} {r['ranks']:>5} {r['ours_ms']:>8.2f} {r['other_ms']:>8.2f} "
                  f"{r['ratio']:>6.3f} {r['q1']:>5.2f}-{r['q3']:<5.2f}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump([dict(r, **stamp) for r in rows], f, indent=2)


if __name__ == "__main__":
    main()
