"""Side-by-side timing shared by the MPI benchmarks.

Two callables are timed alternately, repeat after repeat, so machine noise hits both alike.
A round's time is the max over ranks (the slowest rank sets the pace); the ratio is the
median of the per-repeat ratios ``ours / other`` with its quartiles, so one noisy repeat
moves neither.
"""

import time

import numpy as np
from mpi4py import MPI


def timed(comm, fn):
    """Seconds ``fn()`` takes on the slowest rank, all ranks starting together."""
    comm.Barrier()
    t0 = time.perf_counter()
    fn()
    return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)


def side_by_side(comm, what, mb, ours, other, repeats, warmup=1, **extra):
    """A result row: medians of both sides (ms), and ``ratio`` = median of ours/other with
    quartiles ``q1``, ``q3`` (< 1: ours is faster). ``extra`` is added to the row."""
    for _ in range(warmup):
        ours(), other()
    ta, tb = [], []
    for _ in range(repeats):
        ta.append(timed(comm, ours))
        tb.append(timed(comm, other))
    ratios = np.array(ta) / np.array(tb)
    q1, median, q3 = np.percentile(ratios, [25, 50, 75])
    return dict({"what": what, "mb": mb, "ranks": comm.size, "ours_ms": float(np.median(ta)) * 1e3,
                 "other_ms": float(np.median(tb)) * 1e3, "ratio": float(median), "q1": float(q1),
                 "q3": float(q3)}, **extra)
