"""Run PushSum steps; rank 1 stops (SIGSTOP: hung) or dies (SIGKILL) after a few steps.
The others must end the job with a deadline message instead of hanging."""

import os
import signal
import sys
import time

import numpy as np
from mpi4py import MPI

import mpigossip as mg

how = sys.argv[1]
comm = MPI.COMM_WORLD
x = np.full(1000, float(comm.rank))
ps = mg.PushSum(x, comm=comm, topology=mg.topology.RingGraph(), timeout=3)
for step in range(1000):
    if comm.rank == 1 and step == 5:
        os.kill(os.getpid(), signal.SIGSTOP if how == "stop" else signal.SIGKILL)
    ps.step()
    time.sleep(0.01)
print("finished without noticing the lost peer", flush=True)
