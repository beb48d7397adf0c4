"""Stochastic Gradient Push: gradients at z = x / w, applied to x, then PushSum mixing.
    mpigossip-mpiexec -n 4 python examples/sgp.py [--overlap]"""

import sys

import numpy as np
from _problem import LeastSquares
from mpi4py import MPI

import mpigossip as mg

comm = MPI.COMM_WORLD
problem = LeastSquares(comm)
overlap = "--overlap" in sys.argv
x = np.zeros(problem.dim)
z = np.zeros_like(x)
with mg.PushSum(x, comm=comm, topology=mg.topology.ExponentialGraph(peers=1), z=z,
                max_delay=1 if overlap else 0) as ps:
    for step in range(300):
        if overlap:
            ps.start()            # share sent now; gradient computed while it travels
            x -= 0.05 * problem.gradient(z)
            ps.finish()           # adds what arrived, fused with z = x / w
        else:
            x -= 0.05 * problem.gradient(z)
            ps.step()             # z updated in the same pass
    ps.drain()
    z = ps.debiased()
error = problem.error(z)
if comm.rank == 0:
    print(f"sgp{' (overlap)' if overlap else ''}: relative error {error:.4f}, weight {ps.weight:.3f}")
assert error < 0.05
