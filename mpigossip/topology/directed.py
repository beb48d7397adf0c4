"""Directed schedules: exponential graphs (ours, the SGP paper's, N-peer, bipartite), ring,
complete, random peers. Uniform weights: see :class:`~mpigossip.topology.base.Topology`."""

from __future__ import annotations

import abc
import math
import random
from collections.abc import Sequence

from ..core.checks import check_integer
from .base import Topology, _check_peers, _num_hops


class OffsetGraph(Topology):
    """A directed schedule from a list of hop offsets shared by every rank.

    At step ``k`` rank ``i`` sends to ``i + o`` (mod n) for the ``peers`` offsets
    ``o = offsets[(k*peers + t) mod m]``, ``t < peers``: the list (the reference code's
    "phone book") is cycled ``peers`` at a time. Offsets are distinct and non-zero modulo
    the world size, so a step's out-peers are distinct and every rank has as many in-peers
    as out-peers (``i - o``): the graph is regular. Subclasses define :meth:`offsets`.

    ``peers`` may also be a schedule, a list such as ``[1, 1, 2]``: step ``k`` then uses
    ``peers[k % len]`` offsets, taken where the previous step's ended.
    """

    _what = "offset"

    def __init__(self, peers: int | Sequence[int] = 1, size: int | None = None) -> None:
        owner = type(self).__name__
        if isinstance(peers, (list, tuple)):
            if not peers:
                raise ValueError(f"{owner}: the peers schedule is empty")
            self._schedule: tuple[int, ...] = tuple(_check_peers(owner, p) for p in peers)
            self.peers: int | list[int] = list(self._schedule)
        else:
            one = _check_peers(owner, peers)
            self.peers = one
            self._schedule = (one,)
        super().__init__(size)

    def peers_at(self, step: int) -> int:
        """How many out-peers every rank has at ``step``."""
        return self._schedule[step % len(self._schedule)]

    def _start(self, step):
        """Index in the offset list of ``step``'s first offset (before reduction modulo m)."""
        cycles, pos = divmod(step, len(self._schedule))
        return cycles * sum(self._schedule) + sum(self._schedule[:pos])

    def _params(self):
        return {"peers": self.peers}

    def offsets(self) -> list[int]:
        """The offsets for the bound size, distinct and non-zero modulo it."""
        out, seen = [], {0}
        for o in self._raw_offsets():
            if o % self.size not in seen:
                seen.add(o % self.size)
                out.append(o)
        return out

    @abc.abstractmethod
    def _raw_offsets(self):
        """Candidate offsets in schedule order (duplicates modulo the size are dropped)."""

    def _validate(self):
        m = len(self.offsets()) if self.size > 1 else 0
        if self.size > 1 and max(self._schedule) > m:
            raise ValueError(self._too_few(m))

    def _too_few(self, m):
        return (f"{type(self).__name__}(peers={self.peers}) has only {m} distinct {self._what}(s) "
                f"at world size {self.size}")

    @property
    def period(self) -> int:
        m = len(self.offsets()) if self.size > 1 else 1
        return len(self._schedule) * (m // math.gcd(m, sum(self._schedule)))

    def hops(self, step: int) -> list[int]:
        """Offsets used at ``step``."""
        book = self.offsets() if self.size > 1 else []
        start = self._start(step)
        return [book[(start + t) % len(book)] for t in range(self.peers_at(step))] if book else []

    def _out(self, rank, step):
        return sorted((rank + h) % self.size for h in self.hops(step))


class ExponentialGraph(OffsetGraph):
    """Time-varying directed exponential graph (SGP's default in our code; the reference's
    one-peer schedule).

    At step ``k`` rank ``i`` sends to ``peers`` ranks ``i + 2^j`` (mod n), with the hop
    exponents ``j = (k*peers + t) mod m`` for ``t < peers``, ``m = floor(log2(n-1)) + 1``:
    one peer cycles through hops 1, 2, 4, ... With n a power of two and one peer, the
    de-biased average is exact after log2(n) steps.
    """

    _what = "exponential hop"

    def _raw_offsets(self):
        return [2 ** j for j in range(_num_hops(self.size))]

    def _too_few(self, m):
        return (f"ExponentialGraph(peers={self.peers}) needs at least {2 ** (max(self._schedule) - 1) + 1} ranks: "
                f"world size {self.size} has only {m} distinct exponential hop(s)")


class AlternatingExponentialGraph(OffsetGraph):
    """The SGP paper's directed exponential graph: hops ``+1, -1, +2, -2, +4, -4, ...``
    (powers of two up to ``n-1``, each forward then backward), cycled ``peers`` per step.

    Offsets equal modulo n are used once (``+2^j`` and ``-2^j`` coincide when ``2^(j+1) = n``).
    Unlike :class:`ExponentialGraph`, one period does not give the exact average at
    power-of-two sizes (the backward hops repeat the forward ones' reach): it mixes more
    slowly per step but reaches each rank from both sides.
    """

    _what = "signed exponential hop"

    def _raw_offsets(self):
        out = []
        for j in range(_num_hops(self.size)):
            out += [2 ** j, -(2 ** j)]
        return out


class NPeerExponentialGraph(OffsetGraph):
    """The reference code's N-peer exponential schedule: offsets ``t * (peers+1)^j`` for
    ``t = 1..peers`` and ``(peers+1)^j <= n-1``, cycled ``peers`` per step (base ``peers+1``
    hops). With one peer it is :class:`ExponentialGraph`; with ``peers = n - 1`` every
    rank talks to all others at once.
    """

    _what = "N-peer offset"

    def __init__(self, peers: int = 1, size: int | None = None) -> None:
        if not isinstance(peers, int) or isinstance(peers, bool):
            raise ValueError(f"NPeerExponentialGraph: peers must be an integer >= 1 (it sets the base), got {peers!r}")
        super().__init__(peers, size)

    def _raw_offsets(self):
        base, out, power = self.peers + 1, [], 1
        while power <= self.size - 1:
            out += [t * power for t in range(1, self.peers + 1)]
            power *= base
        return out


class BipartiteExponentialGraph(OffsetGraph):
    """Directed exponential graph with odd hops only (1, 3, 5, 9, 17, ...).

    Every edge joins an even rank to an odd one, so the graph is bipartite (SGP's
    bipartite variant, forward hops); it needs an even world size. ``peers`` hops are used
    per step, cycling through the hop list like :class:`ExponentialGraph`. With
    ``alternating=True`` the hops are signed like the SGP paper's code: ``+1, -1, +3, -3, ...``.
    """

    _what = "odd hop"

    def __init__(self, peers: int = 1, alternating: bool = False, size: int | None = None) -> None:
        self.alternating = bool(alternating)
        super().__init__(peers, size)

    def _params(self):
        return {"peers": self.peers, "alternating": self.alternating}

    def hop_list(self) -> list[int]:
        return self.offsets()

    def _raw_offsets(self):
        out = []
        for h in [1] + [2 ** j + 1 for j in range(1, 64) if 2 ** j + 1 < self.size]:
            out += [h, -h] if self.alternating else [h]
        return out

    def _validate(self):
        if self.size % 2:
            raise ValueError(f"BipartiteExponentialGraph needs an even world size, got {self.size}")
        super()._validate()


class RingGraph(Topology):
    """Ring: each rank sends to ``rank + 1`` (and ``rank - 1`` if ``bidirectional``)."""

    def __init__(self, bidirectional: bool = False, size: int | None = None) -> None:
        self.bidirectional = bool(bidirectional)
        super().__init__(size)

    def _params(self):
        return {"bidirectional": self.bidirectional}

    def _out(self, rank, step):
        peers = {(rank + 1) % self.size}
        if self.bidirectional:
            peers.add((rank - 1) % self.size)
        return sorted(peers)


class CompleteGraph(Topology):
    """Every rank sends to every other rank each step (weights 1/n: exact averaging)."""

    def _out(self, rank, step):
        return [r for r in range(self.size) if r != rank]


class RandomPeers(Topology):
    """Each rank picks ``peers`` random out-peers each step from a seed shared by all ranks.

    All ranks draw the whole step's choice from ``Random((seed, step))``, so in-peers are
    known without communication. Out-degree is constant, in-degree varies: the graph is
    not regular and PushSum weights then vary. With ``allow_self=True`` (gossip, as in
    Jin et al.) a rank may pick itself; :meth:`out_peers` then may contain ``rank``.
    """

    def __init__(self, peers: int = 1, seed: int = 0, allow_self: bool = False, size: int | None = None) -> None:
        _check_peers("RandomPeers", peers)
        check_integer(seed, "seed", owner="RandomPeers")
        self.peers = peers
        self.seed = seed
        self.allow_self = bool(allow_self)
        super().__init__(size)

    def _params(self):
        return {"peers": self.peers, "seed": self.seed, "allow_self": self.allow_self}

    def _validate(self):
        avail = self.size if self.allow_self else self.size - 1
        if self.size > 1 and self.peers > avail:
            raise ValueError(f"RandomPeers(peers={self.peers}) needs at least "
                             f"{self.peers + (0 if self.allow_self else 1)} ranks, got {self.size}")

    @property
    def period(self) -> int:
        return 0  # aperiodic: no repetition is assumed

    def choices(self, step: int) -> list[list[int]]:
        """Every rank's out-peers at ``step`` (a list indexed by rank)."""
        cached = self._cache.get(("choices", step))
        if cached is not None:
            return cached
        rng = random.Random(f"{self.seed}:{step}")
        table = []
        for rank in range(self.size):
            if self.allow_self:
                picks = rng.sample(range(self.size), self.peers)
            else:  # draw among the n-1 others: skip over this rank
                picks = [p + (p >= rank) for p in rng.sample(range(self.size - 1), self.peers)]
            table.append(sorted(picks))
        if len(self._cache) > 64:
            self._cache.clear()
        self._cache[("choices", step)] = table
        return table

    def _out(self, rank, step):
        return self.choices(step)[rank]

    def out_peers(self, rank: int, step: int) -> list[int]:
        self._check(rank, step)
        if self.size == 1:
            return [0] if self.allow_self else []
        return list(self._out(rank, step))

    def in_peers(self, rank: int, step: int) -> list[int]:
        self._check(rank, step)
        if self.size == 1:
            return [0] if self.allow_self else []
        return [src for src, dsts in enumerate(self.choices(step)) if rank in dsts]
