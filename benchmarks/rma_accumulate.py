"""One-sided accumulates across nodes, raw mpi4py (no mpigossip): does a variant finish, and how fast?

The parameter server's exchange in its smallest form: rank 0 holds an ``n``-element float64
window (``Win.Allocate`` or ``Win.Create``), every rank (rank 0 too, as a co-located server)
pushes ``+1`` into all of it and reads it back, ``--reps`` times, then checks the sum
(``size * reps`` everywhere: lost or doubled updates show). Variants of the push:

* ``raccumulate``: ``Lock_all``; ``Raccumulate(SUM)`` in pieces of ``--piece-kb``, ``Waitall``,
  ``Flush``; read back with ``Rget_accumulate(NO_OP)`` (mpigossip's ``atomicity="accumulate"``);
* ``accumulate``: the same with blocking ``Accumulate`` + ``Flush``;
* ``get-accumulate``: ``Rget_accumulate(SUM)`` (fetch and add in one call);
* ``lock``: ``Lock(EXCLUSIVE)`` + ``Get`` + add + ``Put`` + ``Unlock`` (mpigossip's ``atomicity="lock"``).

``--ordering none`` passes ``accumulate_ordering=none`` to the window; ``--compute-ms`` sleeps
between exchanges (a training step); ``--dedicated`` makes rank 0 a server only, which waits
inside MPI (polling an ``Ibarrier``, as ``ParameterServer.serve()``) while the others push. A
hang is caught by ``faulthandler``'s watchdog thread, which runs even while the main thread spins
inside an MPI call: after ``--timeout`` seconds it prints every thread's stack and ends the
process (status 1; the launcher ends the rest). Rank 0 prints one JSON line:
``{"variant", ..., "ok", "s_per_exchange", "mb_s"}``.

    tests/cluster/mpiexec -n 4 --map-by node .venv/bin/python benchmarks/rma_accumulate.py \\
        --variant raccumulate --mb 4 --reps 20

``benchmarks/rma_accumulate.sh`` runs every variant several times on the emulated cluster and
writes the table (benchmarks/results/rma-accumulate.*).
"""

import argparse
import faulthandler
import json
import sys
import time

import numpy as np
from mpi4py import MPI

VARIANTS = ("raccumulate", "accumulate", "get-accumulate", "lock")


def pieces(n, piece):
    return [(lo, min(lo + piece, n)) for lo in range(0, n, piece)]


def push(win, variant, ones, scratch, parts):
    dt = MPI.DOUBLE
    if variant == "raccumulate":
        MPI.Request.Waitall([win.Raccumulate([ones[lo:hi], dt], 0, target=(lo, hi - lo, dt), op=MPI.SUM)
                             for lo, hi in parts])
        win.Flush(0)
    elif variant == "accumulate":
        for lo, hi in parts:
            win.Accumulate([ones[lo:hi], dt], 0, target=(lo, hi - lo, dt), op=MPI.SUM)
        win.Flush(0)
    elif variant == "get-accumulate":
        MPI.Request.Waitall([win.Rget_accumulate([ones[lo:hi], dt], [scratch[lo:hi], dt], 0,
                                                 target=(lo, hi - lo, dt), op=MPI.SUM) for lo, hi in parts])
        win.Flush(0)
    else:  # lock: exclusive lock, get, add, put
        win.Lock(0, MPI.LOCK_EXCLUSIVE)
        MPI.Request.Waitall([win.Rget([scratch[lo:hi], dt], 0, target=(lo, hi - lo, dt)) for lo, hi in parts])
        scratch += ones
        MPI.Request.Waitall([win.Rput([scratch[lo:hi], dt], 0, target=(lo, hi - lo, dt)) for lo, hi in parts])
        win.Unlock(0)


def pull(win, variant, out, origin, parts):
    dt = MPI.DOUBLE
    if variant == "lock":
        win.Lock(0, MPI.LOCK_SHARED)
        MPI.Request.Waitall([win.Rget([out[lo:hi], dt], 0, target=(lo, hi - lo, dt)) for lo, hi in parts])
        win.Unlock(0)
    else:
        MPI.Request.Waitall([win.Rget_accumulate([origin[:hi - lo], dt], [out[lo:hi], dt], 0,
                                                 target=(lo, hi - lo, dt), op=MPI.NO_OP) for lo, hi in parts])
        win.Flush(0)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", choices=VARIANTS, default="raccumulate")
    p.add_argument("--mb", type=float, default=4.0, help="window size in MB (default: 4)")
    p.add_argument("--reps", type=int, default=20, help="exchanges per rank (default: 20)")
    p.add_argument("--piece-kb", type=int, default=64, help="largest request in KiB (default: 64, as mpigossip.onesided.rma)")
    p.add_argument("--flavor", choices=["allocate", "create"], default="allocate")
    p.add_argument("--ordering", choices=["default", "none"], default="default")
    p.add_argument("--compute-ms", type=float, default=0.0, help="sleep between exchanges (default: 0)")
    p.add_argument("--dedicated", action="store_true", help="rank 0 only serves (stays inside MPI)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds before a hang is declared (default: 60)")
    args = p.parse_args(argv)
    faulthandler.dump_traceback_later(args.timeout, exit=True)   # exits with status 1 after printing
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    n = int(args.mb * 1e6) // 8
    info = MPI.Info.Create()
    if args.ordering == "none":
        info.Set("accumulate_ordering", "none")
    nbytes = n * 8 if rank == 0 else 0
    if args.flavor == "allocate":
        win = MPI.Win.Allocate(nbytes, 8, info, comm=comm)
        window = np.frombuffer(win.tomemory(), dtype=np.float64) if rank == 0 else None
    else:
        window = np.zeros(n if rank == 0 else 0)
        win = MPI.Win.Create(window, 8, info, comm=comm)
    if rank == 0:
        win.Lock(0, MPI.LOCK_EXCLUSIVE)
        window[:] = 0.0
        win.Unlock(0)
    comm.Barrier()
    parts = pieces(n, max(1, args.piece_kb * 1024 // 8))
    ones, scratch, out = np.ones(n), np.empty(n), np.empty(n)
    origin = np.zeros(max(hi - lo for lo, hi in parts))
    if args.variant != "lock":
        win.Lock_all()
    workers = size - 1 if args.dedicated else size
    t0 = time.perf_counter()
    if args.dedicated and rank == 0:
        done = comm.Ibarrier()
        while not done.Test():
            time.sleep(1e-4)
    else:
        for _ in range(args.reps):
            if args.compute_ms:
                time.sleep(args.compute_ms / 1e3)
            push(win, args.variant, ones, scratch, parts)
            pull(win, args.variant, out, origin, parts)
        if args.dedicated:
            comm.Ibarrier().Wait()
    elapsed = time.perf_counter() - t0
    if args.variant != "lock":
        win.Unlock_all()
    comm.Barrier()
    ok = True
    if rank == 0:
        win.Lock(0, MPI.LOCK_SHARED)
        ok = bool(np.all(window == workers * args.reps))
        win.Unlock(0)
    slowest = comm.allreduce(0.0 if args.dedicated and rank == 0 else elapsed, op=MPI.MAX)
    win.Free()
    faulthandler.cancel_dump_traceback_later()
    if rank == 0:
        per = (slowest - args.reps * args.compute_ms / 1e3) / args.reps
        print(json.dumps({"variant": args.variant, "flavor": args.flavor, "ordering": args.ordering,
                          "ranks": size, "mb": args.mb, "reps": args.reps, "piece_kb": args.piece_kb,
                          "compute_ms": args.compute_ms, "dedicated": args.dedicated, "ok": ok, "s_per_exchange": per,
                          # each rank's exchange moves the window there and back (push + pull)
                          "mb_s": 2 * args.mb * workers / per if per > 0 else None}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
