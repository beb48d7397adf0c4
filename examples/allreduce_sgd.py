"""AllReduce SGD: average the updates exactly every step.   mpigossip-mpiexec -n 4 python examples/allreduce_sgd.py"""

import numpy as np
from _problem import LeastSquares
from mpi4py import MPI

import mpigossip as mg

comm = MPI.COMM_WORLD
problem = LeastSquares(comm)
x = np.zeros(problem.dim)
update = np.empty_like(x)
with mg.AllreduceAverager(update, comm=comm) as averager:
    for step in range(300):
        update[:] = -0.05 * problem.gradient(x)
        averager.start()          # Iallreduce: overlaps with whatever comes next
        averager.finish()         # update is now the mean over ranks
        x += update
error = problem.error(x)
if comm.rank == 0:
    print(f"allreduce_sgd: relative error {error:.4f}")
assert error < 0.05
