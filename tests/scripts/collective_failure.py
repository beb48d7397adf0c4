"""A rank dies while the others are in a collective with a deadline: what the survivors see.

    mpiexec --with-ft ulfm -n N python tests/scripts/collective_failure.py

The last rank dies (SIGKILL) at once; the others enter :func:`mpigossip.core.deadline.allgather`
on ``MPI_COMM_WORLD`` (errors returned), which meets the death: each survivor records the
error class it got (``MPI_Testall`` itself says only ``MPI_ERR_IN_STATUS``; the class that
matters, ``MPI_ERR_PROC_FAILED`` or ``MPI_ERR_REVOKED``, is in the request's status, and
:func:`~mpigossip.core.deadline.testall` raises that one). Then
:func:`mpigossip.resilience.failures.shrink`, whose own exchange meets the death of a rank the
hook ``MPIGOSSIP_CRASH_IN_RECOVERY=R:exchange`` kills after the shrink: the survivors must shrink
again, not end. Each survivor prints ``collective_failure: {json}``.
"""

import json
import os
import signal

from mpi4py import MPI

from mpigossip.core import deadline
from mpigossip.resilience import failures

world = MPI.COMM_WORLD
world.Set_errhandler(MPI.ERRORS_RETURN)
rank, size = world.Get_rank(), world.Get_size()
if rank == size - 1:
    os.kill(os.getpid(), signal.SIGKILL)
got = None
for _ in range(100):   # until the death is met (some rounds may complete before it is known)
    try:
        deadline.allgather(world, rank, timeout=30, op="collective_failure")
    except MPI.Exception as exc:
        got = exc.Get_error_class()
        break
names = {getattr(MPI, n): n for n in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED", "ERR_IN_STATUS")}
rec = failures.shrink(world, 0, timeout=30, op="collective_failure")
row = {"rank": rank, "class": names.get(got, got), "as_failure": got in failures.FAILED, "lost": rec.lost,
       "size": rec.comm.Get_size()}
print("collective_failure: " + json.dumps(row), flush=True)
failures.exit(0)
