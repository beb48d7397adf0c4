"""The job of the cross-node fault tests (tests/cluster/faults.sh): ROUNDS rounds of PushSum
and AllreduceAverager on 1 MB buffers (``pushsum``: PushSum only, so that every wait is one
of the package's deadline-guarded ones), then exact checks.

    fault_job.py ROUNDS [both|pushsum]

Prints "fault_job: started" once every rank has done a round (the harness cuts links after
it) and, after the checks pass, "fault_job: done, exact" (the completion marker: Open MPI's
launcher exits 0 even when it aborted the job, so the harness looks for this line). The
values are small integers scaled by powers of two, so every sum and mean is exact.
"""

import sys
import time

import numpy as np
from mpi4py import MPI

import mpigossip as mg

total = int(sys.argv[1])
mode = sys.argv[2] if len(sys.argv) > 2 else "both"
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
n = 1 << 17  # 1 MB of float64
x = np.arange(n, dtype=np.float64) % 97 + rank
y = np.full(n, float(rank))
total_x = sum(np.arange(n, dtype=np.float64) % 97 + r for r in range(size))
with mg.PushSum(x, comm=comm) as pushsum, mg.AllreduceAverager(y, comm=comm) as averager:
    for rounds in range(1, total + 1):
        pushsum.step()
        if mode == "both":
            averager.average()
        if rounds == 1 and rank == 0:
            print("fault_job: started", flush=True)
        time.sleep(0.02)
    weight = comm.allreduce(pushsum.weight)
    sum_x = np.empty(n)
    comm.Allreduce(x, sum_x)
    expected_y = (size - 1) / 2
    ok = np.array_equal(sum_x, total_x) and weight == size and (mode != "both" or np.all(y == expected_y))
    ok = comm.allreduce(ok, op=MPI.LAND)
if rank == 0:
    print(f"fault_job: {rounds} rounds; " + ("done, exact" if ok else "WRONG RESULTS"), flush=True)
sys.exit(0 if ok else 1)
