"""A least-squares problem split over ranks, shared by the examples (numpy only)."""

import numpy as np
from mpi4py import MPI


class LeastSquares:
    """Rank i holds rows (A_i, b_i) of one regression problem; f(x) = mean_i ||A_i x - b_i||^2 / (2 m)."""

    def __init__(self, comm, dim=50, rows=200, seed=0):
        truth = np.random.default_rng(seed).standard_normal(dim)
        rng = np.random.default_rng(seed + 1 + comm.rank)
        self.A = rng.standard_normal((rows, dim))
        self.b = self.A @ truth + 0.1 * rng.standard_normal(rows)
        # The exact minimiser of the global objective, for reporting.
        gram = comm.allreduce(self.A.T @ self.A, op=MPI.SUM)
        rhs = comm.allreduce(self.A.T @ self.b, op=MPI.SUM)
        self.solution = np.linalg.solve(gram, rhs)
        self.comm, self.dim, self.rows = comm, dim, rows
        self.rng = np.random.default_rng(seed + 100 + comm.rank)

    def gradient(self, x, batch=20):
        idx = self.rng.integers(0, self.rows, batch)
        A, b = self.A[idx], self.b[idx]
        return A.T @ (A @ x - b) / batch

    def error(self, x):
        """max over ranks of ||x - x*|| / ||x*||."""
        return self.comm.allreduce(float(np.linalg.norm(x - self.solution) / np.linalg.norm(self.solution)),
                                   op=MPI.MAX)
