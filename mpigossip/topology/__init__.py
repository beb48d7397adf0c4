"""Topologies: who talks to whom at each step, and with which weights, as pure functions
of (rank, size, step).

Every rank computes the same graph without communicating, so a receiver always knows
which in-peers to expect. A topology is created unbound (``ExponentialGraph(peers=1)``)
and bound to a world size by :meth:`Topology.bind`, which validates it; communicators bind
it to their communicator's size. Nothing here knows about MPI or arrays.

* :mod:`.directed`: schedules with uniform weights (PushSum/SGP, gossip);
* :mod:`.undirected`: symmetric doubly stochastic graphs (D-PSGD);
* :mod:`.weighted`: the user's own, from a callable or matrices, validated.
"""

from __future__ import annotations

from .base import TOLERANCE, Topology
from .directed import (
    AlternatingExponentialGraph,
    BipartiteExponentialGraph,
    CompleteGraph,
    ExponentialGraph,
    NPeerExponentialGraph,
    OffsetGraph,
    RandomPeers,
    RingGraph,
)
from .undirected import (
    WEIGHTS,
    PairedExponentialGraph,
    TorusGraph,
    UndirectedExponentialGraph,
    UndirectedGraph,
    UndirectedRing,
)
from .weighted import CallableGraph, MatrixGraph

__all__ = ["TOLERANCE", "Topology", "AlternatingExponentialGraph", "BipartiteExponentialGraph", "CompleteGraph",
           "ExponentialGraph", "NPeerExponentialGraph", "OffsetGraph", "RandomPeers", "RingGraph", "WEIGHTS",
           "PairedExponentialGraph", "TorusGraph", "UndirectedExponentialGraph", "UndirectedGraph", "UndirectedRing",
           "CallableGraph", "MatrixGraph", "NAMES", "UNDIRECTED", "make"]

_BUILDERS = {
    "exponential": lambda peers, seed: ExponentialGraph(peers=peers),
    "alternating": lambda peers, seed: AlternatingExponentialGraph(peers=peers),
    "npeer": lambda peers, seed: NPeerExponentialGraph(peers=peers),
    "bipartite": lambda peers, seed: BipartiteExponentialGraph(peers=peers),
    "bipartite-alternating": lambda peers, seed: BipartiteExponentialGraph(peers=peers, alternating=True),
    "ring": lambda peers, seed: RingGraph(),
    "ring2": lambda peers, seed: RingGraph(bidirectional=True),
    "complete": lambda peers, seed: CompleteGraph(),
    "random": lambda peers, seed: RandomPeers(peers=peers, seed=seed),
    "undirected-ring": lambda peers, seed: UndirectedRing(),
    "undirected-exponential": lambda peers, seed: UndirectedExponentialGraph(),
    "torus": lambda peers, seed: TorusGraph(),
    "paired": lambda peers, seed: PairedExponentialGraph(),
}

#: Names accepted by :func:`make` (and the command line's ``--topology``).
NAMES = tuple(_BUILDERS)

#: The names whose mixing matrix is doubly stochastic at every size (D-PSGD can use them).
UNDIRECTED = ("undirected-ring", "undirected-exponential", "torus", "paired", "ring2", "complete")


def make(name: str, *, peers: int = 1, seed: int = 0) -> Topology:
    """Build a topology by name: one of :data:`NAMES` (``peers`` and ``seed`` apply where the
    graph has them)."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown topology {name!r}; choose from {', '.join(NAMES)}")
    return _BUILDERS[name](peers, seed)
