"""Survivors send their last messages and leave at once: every message must arrive.

    mpiexec --with-ft ulfm --mca btl tcp,self -n N python tests/scripts/exit_drain.py [--no-drain]

The last rank dies (SIGKILL) before any message; the others shrink, then each sends
``--count`` eager messages to every other survivor (more than the sockets take at once: the
TCP transport queues the rest and writes them after the sends have returned), receives
theirs, and ends with :func:`mpigossip.resilience.failures.exit` on its default communicator
(the shrink's). A rank that left with messages still queued made a peer's receive fail with
MPI_ERR_PROC_FAILED (in 5 of 6 runs at 6 ranks before exit drained; 0 of 6 since). ``--no-drain``: leave
without waiting for the others (how exit was). Each survivor prints ``exit_drain: {json}``.
"""

import argparse
import json
import os
import signal

from mpi4py import MPI

from mpigossip.resilience import failures

p = argparse.ArgumentParser()
p.add_argument("--no-drain", action="store_true", help="leave at once, as failures.exit did before it drained")
p.add_argument("--bytes", type=int, default=60000, help="per message (under the TCP transport's eager limit)")
p.add_argument("--count", type=int, default=32, help="messages to each peer")
a = p.parse_args()

world = MPI.COMM_WORLD
world.Set_errhandler(MPI.ERRORS_RETURN)
if world.Get_rank() == world.Get_size() - 1:
    os.kill(os.getpid(), signal.SIGKILL)
try:
    world.Barrier()
except MPI.Exception:
    pass
comm = failures.shrink(world, 0, timeout=30, op="exit_drain").comm
rank, size = comm.Get_rank(), comm.Get_size()
payload = bytearray(a.bytes)
sends = [comm.Isend(payload, dest=d, tag=7) for _ in range(a.count) for d in range(size) if d != rank]
error = None
try:
    received = 0
    for _ in range(a.count):
        for s in range(size):
            if s != rank:
                status = MPI.Status()
                comm.Recv(bytearray(a.bytes), source=s, tag=7, status=status)
                received += status.Get_count()
    MPI.Request.Waitall(sends)
except MPI.Exception as exc:
    error, received = exc.Get_error_string().strip(), -1
ok = error is None and received == a.bytes * a.count * (size - 1)
print("exit_drain: " + json.dumps({"rank": rank, "ok": ok, "error": error}), flush=True)
if a.no_drain:
    failures._leave(0 if ok else 1)
failures.exit(0 if ok else 1)
