"""Rank 1 stops (SIGSTOP: hung) or dies (SIGKILL) at some point; the others must end the
job with a deadline message instead of hanging.

    lost_peer.py stop|kill [step|construct|average|tolerant]

step: after 5 PushSum steps; construct: before constructing PushSum (its Idup);
average: before the 5th AllreduceAverager.average (a blocking Allreduce under the watchdog);
tolerant: as step, with PushSum(on_failure="continue") (its persistent exchange has a deadline of
its own).
"""

import os
import signal
import sys
import time

import numpy as np
from mpi4py import MPI

import mpigossip as mg

how = sys.argv[1]
where = sys.argv[2] if len(sys.argv) > 2 else "step"
comm = MPI.COMM_WORLD
x = np.full(1000, float(comm.rank))


def lose(when):
    if comm.rank == 1 and when:
        os.kill(os.getpid(), signal.SIGSTOP if how == "stop" else signal.SIGKILL)


lose(where == "construct")
if where == "average":
    ops = mg.AllreduceAverager(x, comm=comm, timeout=3)
    call = ops.average
else:
    tolerant = {"on_failure": "continue"} if where == "tolerant" else {}
    ops = mg.PushSum(x, comm=comm, topology=mg.topology.RingGraph(), timeout=3, **tolerant)
    call = ops.step
for step in range(1000):
    lose(step == 5)
    call()
    time.sleep(0.01)
print("finished without noticing the lost peer", flush=True)
