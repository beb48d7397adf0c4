"""The base of every topology: binding to a world size, in-peers from out-peers, mixing
weights and their validation.

Mixing weights are uniform unless a subclass says otherwise: a rank keeps ``1/(d_out + 1)``
of its mass and sends the same share to each of its ``d_out`` out-peers, so the mixing
matrix is column-stochastic. ``P[dst][src]`` is the share of ``src``'s mass that ``dst``
receives; column ``src`` is what :meth:`Topology.mixing_weights` returns for ``src``.
"""

from __future__ import annotations

import abc
import math
from fractions import Fraction

from ..core.checks import check_integer

#: Tolerance of the sums checked by :meth:`Topology.check_step` (weights are floats).
TOLERANCE = 1e-12


class Topology(abc.ABC):
    """Base class. Subclasses define :meth:`_out` and, if not 1, :attr:`period`."""

    #: Whether the graph, as bound, may send a rank's message to itself.
    allow_self = False
    #: The world size once bound (:meth:`bind`); None before, which every method checks.
    size: int

    def __init__(self, size: int | None = None) -> None:
        self.size = None  # type: ignore[assignment]  # unbound
        if size is not None:
            self._bind_inplace(size)

    # -- binding ------------------------------------------------------------------------
    def bind(self, size: int) -> Topology:
        """A copy of this topology bound to ``size`` ranks; ``ValueError`` if it cannot be."""
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        clone._bind_inplace(size)
        return clone

    def _bind_inplace(self, size):
        check_integer(size, "world size", 1, owner=repr(self))
        self.size = size
        self._cache = {}
        self._validate()

    def _validate(self):
        """Raise ``ValueError`` if the graph cannot be built on ``self.size`` ranks."""

    def _check(self, rank, step):
        if self.size is None:
            raise ValueError(f"{self!r} is not bound to a world size; call .bind(size)")
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside [0, {self.size})")
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")

    # -- the graph ----------------------------------------------------------------------
    @property
    def period(self) -> int:
        """Number of steps after which the sequence of graphs repeats."""
        return 1

    @abc.abstractmethod
    def _out(self, rank, step):
        """Out-peers of ``rank`` at ``step`` for a bound size > 1 (sorted, distinct)."""

    def out_peers(self, rank: int, step: int) -> list[int]:
        """Ranks that ``rank`` sends to at ``step`` (sorted, no duplicates)."""
        self._check(rank, step)
        if self.size == 1:
            return []
        return self._out(rank, step)

    def in_peers(self, rank: int, step: int) -> list[int]:
        """Ranks that send to ``rank`` at ``step`` (sorted): ``s`` such that ``rank in out_peers(s)``."""
        self._check(rank, step)
        if self.size == 1:
            return []
        key = step % self.period if self.period else step
        table = self._cache.get(key)
        if table is None:
            if len(self._cache) > 64:
                self._cache = {}
            table = [[] for _ in range(self.size)]
            for src in range(self.size):
                for dst in self._out(src, step):
                    table[dst].append(src)
            self._cache[key] = table
        return list(table[rank])

    def mixing_weights(self, rank: int, step: int) -> tuple[float, dict[int, float]]:
        """``(self_weight, {peer: weight})``: uniform ``1/(d_out+1)`` shares, summing to 1."""
        peers = self.out_peers(rank, step)
        share = 1.0 / (len(peers) + 1)
        return share, {p: share for p in peers}

    def check_step(self, step: int, *, doubly: bool = False) -> None:
        """Raise ``ValueError`` unless the mixing matrix at ``step`` is column-stochastic (every
        rank keeps and sends all its mass), and, with ``doubly``, also row-stochastic (every
        rank receives total weight 1: the plain average is preserved, as D-PSGD needs).
        The message names the first column or row that fails. Deterministic: every rank
        that checks the same step raises the same error."""
        key = (step % self.period if self.period else step, doubly)
        checked = self._cache.setdefault("checked", set())
        if key in checked:
            return
        rows = [0.0] * self.size
        for src in range(self.size):
            own, peers = self.mixing_weights(src, step)
            column = [own, *peers.values()]
            if any(not (math.isfinite(v) and v >= 0) for v in column):
                raise ValueError(f"{self!r}: step {step}: column {src} has a negative or non-finite weight: "
                                 f"{own!r} (self), {peers!r}")
            total = math.fsum(column)
            if abs(total - 1.0) > TOLERANCE:
                raise ValueError(f"{self!r}: step {step}: column {src} of the mixing matrix sums to {total!r}, "
                                 f"not 1: rank {src} must keep and send exactly all of its mass")
            rows[src] += own
            for dst, v in peers.items():
                rows[dst] += v
        if doubly:
            for dst, total in enumerate(rows):
                if abs(total - 1.0) > TOLERANCE:
                    raise ValueError(f"{self!r}: step {step}: row {dst} of the mixing matrix sums to {total!r}, "
                                     f"not 1: it must be doubly stochastic (rank {dst} must receive total weight 1)")
        if len(checked) > 256:
            checked.clear()
        checked.add(key)

    def mixing_matrix(self, step: int) -> list[list[Fraction]]:
        """Column-stochastic ``P`` as nested lists of exact ``Fraction``: ``P[dst][src]``."""
        n = self.size
        matrix = [[Fraction(0)] * n for _ in range(n)]
        for src in range(n):
            peers = self.out_peers(src, step)
            share = Fraction(1, len(peers) + 1)
            matrix[src][src] += share
            for dst in peers:
                matrix[dst][src] += share
        return matrix

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self._params().items())
        bound = f", size={self.size}" if self.size is not None else ""
        return f"{type(self).__name__}({args}{bound})"

    def _params(self):
        return {}


def _check_peers(owner, peers):
    check_integer(peers, "peers", 1, owner=owner)
    return peers


def _num_hops(size):
    """Number of distinct exponential hops 2^0..2^(m-1) < size: m = floor(log2(size-1)) + 1."""
    return (size - 1).bit_length() if size > 1 else 0
