"""Topologies with arbitrary weights: the user's own (a callable or a matrix per step).

Both describe column ``src`` of the mixing matrix at each step: the share ``src`` keeps
and the share it sends to each out-peer. Each step's whole matrix is built (for every
rank, as in-peers need) and validated the first time it is used: peers in range, no
repeated peer, weights finite and non-negative, each column summing to 1 (PushSum needs
column-stochastic; D-PSGD also checks the rows). The callable must be a pure function of
``(rank, step)``: every rank evaluates it for every rank and must get the same matrix.
"""

from __future__ import annotations

import abc
import math
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import numpy as np

from ..core.checks import check_integer
from .base import Topology

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence


class _Columns(Topology):
    """Shared machinery: a step's columns, built once per period key and validated."""

    def __init__(self, period: int = 0, size: int | None = None) -> None:
        check_integer(period, "period (0: aperiodic)", 0, owner=type(self).__name__)
        self._period = period
        super().__init__(size)

    @property
    def period(self) -> int:
        return self._period

    def _validate(self):
        self._columns(0)  # fail at bind (construction) on a bad first step

    @abc.abstractmethod
    def _raw_column(self, rank, step):
        """``(self_weight, [(peer, weight), ...])`` for ``rank`` at ``step``, unchecked."""

    def _columns(self, step):
        key = ("columns", step % self._period if self._period else step)
        table = self._cache.get(key)
        if table is not None:
            return table
        n, table = self.size, []
        for src in range(n):
            own, pairs = self._raw_column(src, step)
            peers = {}
            for peer, weight in pairs:
                if isinstance(peer, bool) or not isinstance(peer, (int, np.integer)) or not 0 <= peer < n:
                    raise ValueError(f"{self!r}: step {step}: column {src} names peer {peer!r}, "
                                     f"outside [0, {n})")
                weight = float(weight)
                if not (math.isfinite(weight) and weight >= 0):
                    raise ValueError(f"{self!r}: step {step}: column {src} gives peer {peer} the weight "
                                     f"{weight!r}; weights must be finite and >= 0")
                if int(peer) == src:
                    own += weight
                    continue
                if int(peer) in peers:
                    raise ValueError(f"{self!r}: step {step}: column {src} lists peer {peer} twice")
                if weight > 0:
                    peers[int(peer)] = weight
            table.append((float(own), peers))
        if len(self._cache) > 64:
            self._cache = {}
        self._cache[key] = table
        self.check_step(step)
        return table

    def _out(self, rank, step):
        return sorted(self._columns(step)[rank][1])

    def mixing_weights(self, rank: int, step: int) -> tuple[float, dict[int, float]]:
        self._check(rank, step)
        if self.size == 1:
            return 1.0, {}
        own, peers = self._columns(step)[rank]
        return own, dict(peers)

    def mixing_matrix(self, step: int) -> list[list[Fraction]]:
        n = self.size
        matrix = [[Fraction(0)] * n for _ in range(n)]
        for src in range(n):
            own, peers = self.mixing_weights(src, step)
            matrix[src][src] += Fraction(own)
            for dst, v in peers.items():
                matrix[dst][src] += Fraction(v)
        return matrix


class CallableGraph(_Columns):
    """A topology from ``fn(rank, step) -> [(peer, weight), ...]``: the shares ``rank`` sends
    at ``step``, including ``(rank, w)`` for the share it keeps (absent: it keeps nothing).

    Args:
        fn: a pure function of ``(rank, step)``; every rank calls it for every rank.
        period: the schedule repeats after ``period`` steps (0: aperiodic; results are then
            cached for the last 64 steps only).
    """

    def __init__(self, fn: Callable[..., Any], *, period: int = 0, size: int | None = None) -> None:
        if not callable(fn):
            raise ValueError(f"CallableGraph: fn must be callable (rank, step) -> [(peer, weight), ...], got {fn!r}")
        self.fn = fn
        super().__init__(period, size)

    def _params(self):
        return {"fn": getattr(self.fn, "__name__", self.fn), "period": self._period}

    def _raw_column(self, rank, step):
        try:
            pairs = [(peer, weight) for peer, weight in self.fn(rank, step)]
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{self!r}: fn({rank}, {step}) must return [(peer, weight), ...]: {exc}") from None
        return 0.0, pairs


class MatrixGraph(_Columns):
    """A topology from mixing matrices ``P[dst][src]`` (column ``src``: what ``src`` keeps on
    the diagonal and sends to each ``dst``; zeros are no edge).

    Args:
        matrices: a list of n x n matrices used in turn (step ``k`` uses
            ``matrices[k % len]``), or a callable ``step -> matrix`` (aperiodic).
    """

    def __init__(self, matrices: Sequence[Any], *, size: int | None = None) -> None:
        if callable(matrices):
            self._fn: Callable[[int], Any] = matrices
            period = 0
        else:
            try:
                mats = [np.array(m, dtype=np.float64) for m in matrices]
            except (TypeError, ValueError) as exc:
                raise ValueError(f"MatrixGraph: matrices must be a list of square matrices: {exc}") from None
            if not mats:
                raise ValueError("MatrixGraph: matrices is empty")
            self._fn, period = (lambda step: mats[step % len(mats)]), len(mats)
            self._mats = mats
        super().__init__(period, size)

    def _params(self):
        return {"period": self._period}

    def _matrix(self, step):
        key = ("matrix", step)
        m = self._cache.get(key)
        if m is None:
            m = np.array(self._fn(step), dtype=np.float64)
            if m.shape != (self.size, self.size):
                raise ValueError(f"{self!r}: step {step}: the matrix is {m.shape}, expected "
                                 f"({self.size}, {self.size}) for world size {self.size}")
            self._cache[key] = m
        return m

    def _raw_column(self, rank, step):
        column = self._matrix(step)[:, rank]
        return 0.0, [(dst, v) for dst, v in enumerate(column.tolist()) if v != 0 or dst == rank]
