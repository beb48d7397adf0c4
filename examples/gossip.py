"""Gossiping SGD (Jin et al.), pull or push (mg.Every(gossip, k) for every k-th step).
    mpigossip-mpiexec -n 4 python examples/gossip.py [pull|push]"""

import sys

import numpy as np
from _problem import LeastSquares
from mpi4py import MPI

import mpigossip as mg

comm = MPI.COMM_WORLD
mode = sys.argv[1] if len(sys.argv) > 1 else "pull"
problem = LeastSquares(comm)
x = np.zeros(problem.dim)
with mg.Gossip(x, comm=comm, mode=mode, seed=0) as gossip:
    for _ in range(400):
        x -= 0.05 * problem.gradient(x)
        gossip.step()
    # The ranks run unsynchronised: one that finished early last read its peers mid-run. Once all
    # have finished, a few rounds of averaging alone bring the models together.
    comm.Barrier()
    for _ in range(10):
        gossip.step()
    comm.Barrier()
error = problem.error(x)
if comm.rank == 0:
    print(f"gossip {mode}: relative error {error:.4f}")
assert error < 0.1
