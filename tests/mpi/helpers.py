"""Shared helpers of the MPI tests."""

import numpy as np
from mpi4py import MPI


def comm():
    return MPI.COMM_WORLD


def global_sum(c, array):
    """Exact-enough global sum of a float64 array (Allreduce SUM of float64)."""
    out = np.array(array, dtype=np.float64, copy=True)
    c.Allreduce(MPI.IN_PLACE, out, MPI.SUM)
    return out


def consensus_distance(c, x):
    """sqrt(mean_i ||x_i - mean x||^2)."""
    mean = global_sum(c, x) / c.size
    local = float(np.sum((np.asarray(x, np.float64) - mean) ** 2))
    return (c.allreduce(local) / c.size) ** 0.5


def same_on_all_ranks(c, value):
    return all(v == value for v in c.allgather(value))


def one_node(c):
    """Whether every rank of ``c`` shares one node (the same answer on every rank)."""
    shared = c.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return bool(c.allreduce(shared.Get_size() == c.size, op=MPI.LAND))
    finally:
        shared.Free()
