"""Elastic Averaging SGD over the one-sided parameter server (and async SGD with --async).
    mpigossip-mpiexec -n 4 python examples/easgd.py [--async]"""

import sys

import numpy as np
from _problem import LeastSquares
from mpi4py import MPI

import mpigossip as mg

comm = MPI.COMM_WORLD
problem = LeastSquares(comm)
x = np.zeros(problem.dim)
with mg.ParameterServer(problem.dim, np.float64, comm=comm, servers=1, init=x) as server:
    if "--async" in sys.argv:
        worker = mg.AsyncSGD(x, server, share=1 / comm.size)  # each pushes 1/P of its update
        for step in range(300):
            x -= 0.05 * problem.gradient(x)
            worker.step()  # push (x - x_pulled) / P, pull the center into x
    else:
        worker = mg.Every(mg.ElasticAveraging(x, server, beta=0.9), 4)  # every 4th step; each moves by 0.9 / P
        for step in range(600):
            x -= 0.05 * problem.gradient(x)
            worker.step()
    comm.Barrier()
    center = server.pull(np.empty_like(x))
error = problem.error(center)
if comm.rank == 0:
    print(f"{'async sgd' if '--async' in sys.argv else 'easgd'}: center relative error {error:.4f}")
assert error < 0.1
