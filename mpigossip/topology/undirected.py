"""Undirected graphs with symmetric, doubly stochastic weights (D-PSGD's mixing).

Every edge is used both ways: a rank's out-peers are its in-peers. Weights:

* ``"metropolis"`` (Metropolis-Hastings): ``W_ij = 1 / (1 + max(d_i, d_j))``, the rest on
  the diagonal; symmetric, hence doubly stochastic, on any graph, even irregular.
* ``"lazy"``: half of that, ``W_ij = 1 / (2 max(d_i, d_j))``: at least 1/2 on the diagonal.
  On a ring (1/4), a torus (1/8) or a matching (1/2) the weights are powers of two, so
  averaging dyadic data is exact.
"""

from __future__ import annotations

import abc
import math
from fractions import Fraction

from ..core.checks import check_integer
from .base import Topology, _num_hops

WEIGHTS = ("metropolis", "lazy")


class UndirectedGraph(Topology):
    """Base: subclasses define :meth:`neighbors` (symmetric: ``j in N(i)`` iff ``i in N(j)``)."""

    def __init__(self, weights: str = "metropolis", size: int | None = None) -> None:
        if weights not in WEIGHTS:
            raise ValueError(f"{type(self).__name__}: weights must be one of {WEIGHTS}, got {weights!r}")
        self.weights = weights
        super().__init__(size)

    def _params(self):
        return {"weights": self.weights}

    @abc.abstractmethod
    def neighbors(self, rank: int, step: int) -> list[int]:
        """Sorted distinct neighbours of ``rank`` at ``step`` (never ``rank``) for a bound size > 1."""

    def _out(self, rank, step):
        return self.neighbors(rank, step)

    def in_peers(self, rank: int, step: int) -> list[int]:
        self._check(rank, step)
        return [] if self.size == 1 else self.neighbors(rank, step)

    def mixing_weights(self, rank: int, step: int) -> tuple[float, dict[int, float]]:
        self._check(rank, step)
        if self.size == 1:
            return 1.0, {}
        mine = self.neighbors(rank, step)
        half = 2 if self.weights == "lazy" else 1
        peers = {}
        for j in mine:
            d = max(len(mine), len(self.neighbors(j, step)))
            peers[j] = 1.0 / (half * d) if half == 2 else 1.0 / (1 + d)
        return 1.0 - math.fsum(peers.values()), peers

    def mixing_matrix(self, step: int) -> list[list[Fraction]]:
        n = self.size
        matrix = [[Fraction(0)] * n for _ in range(n)]
        half = 2 if self.weights == "lazy" else 1
        for i in range(n):
            mine = self.neighbors(i, step) if n > 1 else []
            for j in mine:
                d = max(len(mine), len(self.neighbors(j, step)))
                matrix[j][i] = Fraction(1, 2 * d) if half == 2 else Fraction(1, 1 + d)
            matrix[i][i] = 1 - sum((matrix[j][i] for j in mine), Fraction(0))
        return matrix


class UndirectedRing(UndirectedGraph):
    """Ring: neighbours ``i - 1`` and ``i + 1`` (one neighbour at n = 2)."""

    def neighbors(self, rank: int, step: int) -> list[int]:
        return sorted({(rank - 1) % self.size, (rank + 1) % self.size} - {rank})


class UndirectedExponentialGraph(UndirectedGraph):
    """Static exponential graph: neighbours ``i +- 2^j`` for ``2^j < n`` (Lian et al.'s
    choice for D-PSGD at scale)."""

    def neighbors(self, rank: int, step: int) -> list[int]:
        out = set()
        for j in range(_num_hops(self.size)):
            out |= {(rank + 2 ** j) % self.size, (rank - 2 ** j) % self.size}
        return sorted(out - {rank})


class TorusGraph(UndirectedGraph):
    """2-D torus of ``rows x (n / rows)`` ranks (row-major); default ``rows``: the largest
    divisor of n not above its square root. Neighbours: up, down, left, right."""

    def __init__(self, rows: int | None = None, weights: str = "metropolis", size: int | None = None) -> None:
        if rows is not None:
            check_integer(rows, "rows", 1, owner="TorusGraph")
        self.rows = rows
        super().__init__(weights, size)

    def _params(self):
        return {"rows": self.rows, "weights": self.weights}

    def shape(self) -> tuple[int, int]:
        rows = self.rows
        if rows is None:
            rows = max(r for r in range(1, math.isqrt(self.size) + 1) if self.size % r == 0)
        return rows, self.size // rows

    def _validate(self):
        if self.rows is not None and self.size % self.rows:
            raise ValueError(f"TorusGraph(rows={self.rows}) does not divide world size {self.size}")

    def neighbors(self, rank: int, step: int) -> list[int]:
        rows, cols = self.shape()
        r, c = divmod(rank, cols)
        out = {((r + 1) % rows) * cols + c, ((r - 1) % rows) * cols + c,
               r * cols + (c + 1) % cols, r * cols + (c - 1) % cols}
        return sorted(out - {rank})


class PairedExponentialGraph(UndirectedGraph):
    """Time-varying matching: at step ``k`` rank ``i`` pairs with ``i XOR 2^(k mod m)``
    (``m = ceil(log2 n)``), if that rank exists. With n a power of two and the default
    weights (1/2 each) the plain average is exact after ``log2 n`` steps."""

    @property
    def period(self) -> int:
        return max(1, _num_hops(self.size))

    def neighbors(self, rank: int, step: int) -> list[int]:
        partner = rank ^ (1 << (step % self.period))
        return [partner] if partner < self.size else []
