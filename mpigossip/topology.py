"""Topologies: who talks to whom at each step, as pure functions of (rank, size, step).

Every rank computes the same graph without communicating, so a receiver always knows
which in-peers to expect. A topology is created unbound (``ExponentialGraph(peers=1)``)
and bound to a world size by :meth:`Topology.bind`, which validates it; communicators bind
it to their communicator's size. Nothing here knows about MPI or arrays.

Mixing weights are uniform: a rank keeps ``1/(d_out + 1)`` of its mass and sends the
same share to each of its ``d_out`` out-peers, so every mixing matrix is column-stochastic.
"""

import abc
import math
import random
from fractions import Fraction


class Topology(abc.ABC):
    """Base class. Subclasses define :meth:`_out` and, if not 1, :attr:`period`."""

    #: Whether the graph, as bound, may send a rank's message to itself.
    allow_self = False

    def __init__(self, size=None):
        self.size = None
        if size is not None:
            self._bind_inplace(size)

    # -- binding ------------------------------------------------------------------------
    def bind(self, size):
        """A copy of this topology bound to ``size`` ranks; ``ValueError`` if it cannot be."""
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        clone._bind_inplace(size)
        return clone

    def _bind_inplace(self, size):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{self!r}: world size must be an integer >= 1, got {size!r}")
        self.size = size
        self._validate()
        self._cache = {}

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
    def period(self):
        """Number of steps after which the sequence of graphs repeats."""
        return 1

    @abc.abstractmethod
    def _out(self, rank, step):
        """Out-peers of ``rank`` at ``step`` for a bound size > 1 (sorted, distinct)."""

    def out_peers(self, rank, step):
        """Ranks that ``rank`` sends to at ``step`` (sorted, no duplicates)."""
        self._check(rank, step)
        if self.size == 1:
            return []
        return self._out(rank, step)

    def in_peers(self, rank, step):
        """Ranks that send to ``rank`` at ``step`` (sorted): ``s`` such that ``rank in out_peers(s)``."""
        self._check(rank, step)
        if self.size == 1:
            return []
        key = step % self.period if self.period else step
        table = self._cache.get(key)
        if table is None:
            if len(self._cache) > 64:
                self._cache.clear()
            table = [[] for _ in range(self.size)]
            for src in range(self.size):
                for dst in self._out(src, step):
                    table[dst].append(src)
            self._cache[key] = table
        return list(table[rank])

    def mixing_weights(self, rank, step):
        """``(self_weight, {peer: weight})``: uniform ``1/(d_out+1)`` shares, summing to 1."""
        peers = self.out_peers(rank, step)
        share = 1.0 / (len(peers) + 1)
        return share, {p: share for p in peers}

    def mixing_matrix(self, step):
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
    if isinstance(peers, bool) or not isinstance(peers, int) or peers < 1:
        raise ValueError(f"{owner}: peers must be an integer >= 1, got {peers!r}")
    return peers


def _num_hops(size):
    """Number of distinct exponential hops 2^0..2^(m-1) < size: m = floor(log2(size-1)) + 1."""
    return (size - 1).bit_length() if size > 1 else 0


class ExponentialGraph(Topology):
    """Time-varying directed exponential graph (SGP's default).

    At step ``k`` rank ``i`` sends to ``peers`` ranks ``i + 2^j`` (mod n), with the hop
    exponents ``j = (k*peers + t) mod m`` for ``t < peers``, ``m = floor(log2(n-1)) + 1``:
    one peer cycles through hops 1, 2, 4, ... With n a power of two and one peer, the
    de-biased average is exact after log2(n) steps.
    """

    def __init__(self, peers=1, size=None):
        self.peers = _check_peers("ExponentialGraph", peers)
        super().__init__(size)

    def _params(self):
        return {"peers": self.peers}

    def _validate(self):
        m = _num_hops(self.size)
        if self.size > 1 and self.peers > m:
            raise ValueError(f"ExponentialGraph(peers={self.peers}) needs at least "
                             f"{2 ** (self.peers - 1) + 1} ranks: world size {self.size} "
                             f"has only {m} distinct exponential hop(s)")

    @property
    def period(self):
        m = _num_hops(self.size)
        return m // math.gcd(m, self.peers) if m else 1

    def hops(self, step):
        """Hop distances used at ``step``."""
        m = _num_hops(self.size)
        return [2 ** ((step * self.peers + t) % m) for t in range(self.peers)] if m else []

    def _out(self, rank, step):
        return sorted((rank + h) % self.size for h in self.hops(step))


class BipartiteExponentialGraph(Topology):
    """Directed exponential graph with odd hops only (1, 3, 5, 9, 17, ...).

    Every edge joins an even rank to an odd one, so the graph is bipartite (SGP's
    bipartite variant); it needs an even world size. ``peers`` hops are used per step,
    cycling through the hop list like :class:`ExponentialGraph`.
    """

    def __init__(self, peers=1, size=None):
        self.peers = _check_peers("BipartiteExponentialGraph", peers)
        super().__init__(size)

    def _params(self):
        return {"peers": self.peers}

    def hop_list(self):
        hops = [1] + [2 ** j + 1 for j in range(1, 64) if 2 ** j + 1 < self.size]
        return hops

    def _validate(self):
        if self.size % 2:
            raise ValueError(f"BipartiteExponentialGraph needs an even world size, got {self.size}")
        if self.size > 1 and self.peers > len(self.hop_list()):
            raise ValueError(f"BipartiteExponentialGraph(peers={self.peers}) has only "
                             f"{len(self.hop_list())} distinct odd hop(s) at world size {self.size}")

    @property
    def period(self):
        m = len(self.hop_list()) if self.size > 1 else 1
        return m // math.gcd(m, self.peers)

    def _out(self, rank, step):
        hops = self.hop_list()
        m = len(hops)
        return sorted((rank + hops[(step * self.peers + t) % m]) % self.size for t in range(self.peers))


class RingGraph(Topology):
    """Ring: each rank sends to ``rank + 1`` (and ``rank - 1`` if ``bidirectional``)."""

    def __init__(self, bidirectional=False, size=None):
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

    def __init__(self, peers=1, seed=0, allow_self=False, size=None):
        _check_peers("RandomPeers", peers)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"RandomPeers: seed must be an integer, got {seed!r}")
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
    def period(self):
        return 0  # aperiodic: no repetition is assumed

    def choices(self, step):
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

    def out_peers(self, rank, step):
        self._check(rank, step)
        if self.size == 1:
            return [0] if self.allow_self else []
        return list(self._out(rank, step))

    def in_peers(self, rank, step):
        self._check(rank, step)
        if self.size == 1:
            return [0] if self.allow_self else []
        return [src for src, dsts in enumerate(self.choices(step)) if rank in dsts]


#: Names accepted by :func:`make` (and the command line's ``--topology``).
NAMES = ("exponential", "bipartite", "ring", "ring2", "complete", "random")


def make(name, *, peers=1, seed=0):
    """Build a topology by name: one of :data:`NAMES`."""
    if name == "exponential":
        return ExponentialGraph(peers=peers)
    if name == "bipartite":
        return BipartiteExponentialGraph(peers=peers)
    if name == "ring":
        return RingGraph()
    if name == "ring2":
        return RingGraph(bidirectional=True)
    if name == "complete":
        return CompleteGraph()
    if name == "random":
        return RandomPeers(peers=peers, seed=seed)
    raise ValueError(f"unknown topology {name!r}; choose from {', '.join(NAMES)}")
