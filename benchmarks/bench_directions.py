"""One-sided and two-sided transfers in one direction and in several at once, between nodes of
one rank each (#43: the time model's rule for one-sided gets).

    tests/cluster/start.sh 3 1gbit 1
    OMPI_MCA_btl_tcp_progress_thread=1 tests/cluster/mpiexec -n 3 --map-by node \\
        -x OMPI_MCA_btl_tcp_progress_thread python benchmarks/bench_directions.py --out FILE

Each case moves ``--mb`` MB per transfer, ``--repeats`` times after a barrier, with the package's
own calls (``rma.rget``/``rma.rput`` in its pieces under a shared lock, waits polling as
``deadline.wait`` does; ``Sendrecv`` for the two-sided exchange); each transfer's time is given
as a multiple of one model's time at ``--rate-gbit`` (the emulated link's payload rate,
``link_payload`` of it). Cases (two ranks; the ring needs three): a get one way, gets both ways
at once, a ring of gets (rank r reads rank r+1), puts both ways, a send one way, a ``Sendrecv``
both ways, and the same exchange in 4 MB pieces all posted at once (at or below the emulated
cluster's TCP eager limit); with three ranks, rings (rank r reads, or sends to, rank r+1): gets,
sends whole and in 4 MB pieces.
"""

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

from mpigossip.core import provenance
from mpigossip.onesided import rma


def _wait(requests):
    while not MPI.Request.Testall(requests):
        time.sleep(1e-3)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rate-gbit", type=float, default=1.0)
    parser.add_argument("--link-payload", type=float, default=0.945,
                        help="the payload fraction of the link's rate (0.945: MPI ping-pong at 1 Gbit here)")
    parser.add_argument("--out")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    n = int(args.mb * 2 ** 20)
    win = MPI.Win.Allocate(n, 1, comm=comm)
    send, recv = np.ones(n, dtype=np.uint8), np.empty(n, dtype=np.uint8)
    other = (rank + 1) % size

    def get(target):
        win.Lock(target, MPI.LOCK_SHARED)
        _wait(rma.rget(win, recv, MPI.BYTE, target))
        win.Unlock(target)

    def put(target):
        win.Lock(target, MPI.LOCK_SHARED)
        _wait(rma.rput(win, send, MPI.BYTE, target))
        win.Unlock(target)

    piece = 4 << 20   # the cluster's btl_tcp_eager_limit (tests/cluster/mpiexec): each piece sent eagerly

    def exchange(to, source, step=n):   # a message to one rank and one from another (in pieces of step bytes)
        reqs = [comm.Irecv(recv[lo:lo + step], source=source) for lo in range(0, n, step)]
        reqs += [comm.Isend(send[lo:lo + step], dest=to) for lo in range(0, n, step)]
        _wait(reqs)

    cases = {   # name -> what each rank does (None: nothing)
        "get one way": {1: lambda: get(0)},
        "gets both ways": {0: lambda: get(1), 1: lambda: get(0)},
        "puts both ways": {0: lambda: put(1), 1: lambda: put(0)},
        "send one way": {0: lambda: comm.Send(send, dest=1), 1: lambda: comm.Recv(recv, source=0)},
        "sendrecv both ways": {r: (lambda r=r: comm.Sendrecv(send, dest=1 - r, recvbuf=recv, source=1 - r))
                               for r in (0, 1)},
        "4 MB pieces both ways": {r: (lambda r=r: exchange(1 - r, 1 - r, piece)) for r in (0, 1)},
    }
    if size >= 3:
        before = (rank - 1) % size
        cases["ring of gets"] = {r: (lambda: get(other)) for r in range(size)}
        cases["ring of sends"] = {r: (lambda: exchange(other, before)) for r in range(size)}
        cases["ring of sends, 4 MB pieces"] = {r: (lambda: exchange(other, before, piece)) for r in range(size)}
    link_s = n / (args.rate_gbit * 1e9 / 8 * args.link_payload)
    rows = []
    for name, work in cases.items():
        mine = work.get(rank)
        times = []
        for _ in range(args.repeats):
            comm.Barrier()
            t0 = time.perf_counter()
            if mine is not None:
                mine()
            times.append(time.perf_counter() - t0)
        every = comm.gather(times if mine is not None else None)
        if rank == 0:
            each = [t for ts in every if ts for t in ts]
            rows.append({"case": name, "ranks": sorted(r for r, ts in enumerate(every) if ts), "seconds": each,
                         "median_s": statistics.median(each), "link_s": link_s,
                         "vs_link": statistics.median(each) / link_s})
            print(f"{name:20s} {statistics.median(each):.3f} s = {statistics.median(each) / link_s:.2f}x one "
                  f"model's link time (each: {', '.join(f'{t:.3f}' for t in each)})", flush=True)
    comm.Barrier()
    win.Free()
    if rank == 0 and args.out:
        meta = {"commit": provenance.commit(), "versions": provenance.versions(), "command": " ".join(sys.argv),
                "ranks": size, "mb": args.mb, "rate_gbit": args.rate_gbit,
                "progress_thread": os.environ.get("OMPI_MCA_btl_tcp_progress_thread", "unset")}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
