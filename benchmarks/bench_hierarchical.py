"""Hierarchical averaging benchmark: the node mean in shared memory against AllReduce on
the same ranks, and hierarchical SGP against flat SGP.

    mpigossip-mpiexec -n 4 python benchmarks/bench_hierarchical.py [--node-size L] [--sizes-mb 16 32 64]
        [--repeats 15] [--parts node sgp] [--out FILE]

* ``node``: ``NodeMean.average()`` (buffer in the shared window: ``NodeMean.allocate``) vs ``AllreduceAverager.average()`` over the ranks of one
  node (``--node-size``, default: those sharing memory). Target: >= 1.5x faster at 2 and 4
  local ranks. Run it on one node (world size = node size).
* ``sgp``: ``Hierarchical(inter=PushSum).step()`` vs ``PushSum.step()`` over all ranks, same
  graph (exponential) and bytes. On the emulated cluster (``tests/cluster/mpiexec``, 2 ranks
  per node) the node's link carries one model instead of two: target >= 1.8x faster.

Each pair is timed alternately, repeat after repeat; a round's time is the max over ranks;
the ratio is the median of per-repeat ratios (other / ours: > 1 means ours is faster),
with its quartiles.
"""

import argparse
import json

import _timing  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
import numpy as np
from mpi4py import MPI

import mpigossip as mg
from mpigossip import topology as T


def side_by_side(comm, what, mb, ours, other, repeats, **extra):
    """The shared timing with the ratio turned into a speedup (other / ours: > 1 = ours faster)."""
    row = _timing.side_by_side(comm, what, mb, ours, other, repeats, **extra)
    ratio, q1, q3 = row.pop("ratio"), row.pop("q1"), row.pop("q3")
    return dict(row, speedup=1 / ratio, q1=1 / q3, q3=1 / q1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--node-size", type=int, default=None, help="ranks per node (default: shared memory)")
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[16, 32, 64])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--parts", nargs="+", default=["node", "sgp"], choices=["node", "sgp"])
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rows = []
    for mb in args.sizes_mb:
        n = int(mb * 2 ** 20) // 4
        x = np.random.default_rng(comm.rank).standard_normal(n).astype(np.float32)
        y = x.copy()
        if "node" in args.parts:
            nm = mg.NodeMean.allocate(n, np.float32, comm=comm, node_size=args.node_size)
            nm.array[:] = x
            node = comm.Split(comm.rank // nm.local_size if args.node_size else 0, key=comm.rank)
            if args.node_size is None:
                node.Free()
                node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
            ar = mg.AllreduceAverager(y, comm=node)
            rows.append(side_by_side(comm, "node mean / AllreduceAverager", mb, nm.average, ar.average,
                                     args.repeats, local_ranks=nm.local_size))
            nm.free()
            ar.free()
            node.Free()
        if "sgp" in args.parts:
            h = mg.Hierarchical.allocate(n, np.float32, comm=comm, inter=mg.PushSum, node_size=args.node_size,
                                         topology=T.ExponentialGraph())
            h.array[:] = x
            flat = mg.PushSum(y, comm=comm, topology=T.ExponentialGraph())
            rows.append(side_by_side(comm, "hierarchical SGP step / flat SGP step", mb, h.step, flat.step,
                                     args.repeats, local_ranks=h.node.local_size, nodes=h.nodes))
            h.free()
            flat.free()
        if comm.rank == 0:
            r = rows[-1]
            print(f"{mb:g} MB done", flush=True)
    if comm.rank == 0:
        print("| what | MB | ranks | local ranks | ours ms | other ms | speedup (q1-q3) |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['what']} | {r['mb']:g} | {r['ranks']} | {r['local_ranks']} | {r['ours_ms']:.1f} | "
                  f"{r['other_ms']:.1f} | {r['speedup']:.2f} ({r['q1']:.2f}-{r['q3']:.2f}) |")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
