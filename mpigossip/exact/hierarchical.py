"""Hierarchical averaging: the exact mean inside each node, a decentralized (or exact)
average between nodes.

Built from two communicators: a :class:`~mpigossip.exact.node.NodeMean` over each node's
shared-memory window, and one inter-node communicator per *local index*: local rank
``r`` of every node runs it on slice ``r`` of the node mean, in place in shared memory,
with local rank ``r`` of the other nodes. So each node's link carries one model per step
whatever the number of ranks per node (each of ``L`` ranks sends ``1/L`` of it), and the
inter-node arithmetic is spread over all of the node's ranks; the slices are then gathered
on every rank. Every node must have the same number of ranks (checked).

:meth:`Hierarchical.allocate` puts the buffer itself in the window (no copy in or out:
see :mod:`mpigossip.exact.node`). With :class:`~mpigossip.decentralized.pushsum.PushSum` between nodes the PushSum weight is the same on
every rank of a node (every slice sees the same graph and weights): :attr:`weight`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from mpi4py import MPI

from ..core import deadline
from ..core.base import Communicator
from ..core.checks import check_integer
from .node import NodeMean

if TYPE_CHECKING:

    from numpy.typing import DTypeLike

    from ..core.hints import Buffer


class Hierarchical(Communicator):
    """Node mean, then ``inter`` between nodes, on one flat buffer.

    Args:
        x: numpy/cupy/torch buffer, same length and dtype on every rank; updated in place.
        comm: communicator (keyword-only); collective construction.
        inter: the inter-node communicator class (:class:`~mpigossip.PushSum`,
            :class:`~mpigossip.DPSGD`, :class:`~mpigossip.Gossip` with ``mode="push"``,
            :class:`~mpigossip.AllreduceAverager`), or ``None`` for the node mean only.
        node_size: ranks per node (see :class:`~mpigossip.exact.node.NodeMean`; default: those
            sharing memory).
        timeout: seconds any wait may take before the job is aborted.
        **options: passed to ``inter`` (e.g. ``topology=``, ``seed=``); its graph is over nodes.
    """

    _name = "Hierarchical"

    def __init__(self, x: Buffer, *, comm: MPI.Intracomm, inter: Any = None, node_size: int | None = None,
                 timeout: float | None = None, _allocate: tuple[int, np.dtype] | None = None, **options: Any) -> None:
        super().__init__(comm, timeout)
        error = None
        if inter is not None and not (isinstance(inter, type) and issubclass(inter, Communicator)):
            error = f"inter must be a communicator class (e.g. mpigossip.PushSum) or None, got {inter!r}"
        self._validate(error)
        try:
            self.node = NodeMean(x, comm=self.comm, node_size=node_size, timeout=self.timeout, _allocate=_allocate)
        except (TypeError, ValueError):
            self._free_comm()
            raise
        self.buffer = self.node.buffer
        sizes = deadline.allgather(self.comm, self.node.local_size, timeout=self.timeout, op=self._name)
        error = None
        if len(set(sizes)) > 1:
            per_node = sorted(set(sizes))
            error = (f"every node must have the same number of ranks for hierarchical averaging; "
                     f"found nodes with {', '.join(map(str, per_node))} ranks")
        if error is None and inter is not None:
            error = inter._hierarchical_error(options)
        try:
            deadline.raise_collectively(self.comm, error, timeout=self.timeout, op=self._name)
        except ValueError:
            self.node.free()
            self._free_comm()
            raise
        self.nodes = self.size // self.node.local_size
        # Local rank r of every node, ordered by node (their world ranks' order).
        self.across = self.comm.Split(self.node.local_rank, key=self.rank)
        self.inter: Any = None
        if inter is not None:
            try:
                self.inter = inter(self.node.part, comm=self.across, timeout=self.timeout, **options)
            except (TypeError, ValueError):
                self.across.Free()
                self.node.free()
                self._free_comm()
                raise
        self.steps = 0

    @classmethod
    def allocate(cls, size: int, dtype: DTypeLike, *, comm: MPI.Intracomm, inter: Any = None,
                 node_size: int | None = None, timeout: float | None = None, **options: Any) -> Hierarchical:
        """Hierarchical averaging whose buffer is this rank's segment of the node's shared
        window, :attr:`array` (zeros; valid until :meth:`free`): no copy in or out (collective)."""
        check_integer(size, "size", 1)
        return cls(None, comm=comm, inter=inter, node_size=node_size, timeout=timeout,
                   _allocate=(size, np.dtype(dtype)), **options)

    @property
    def array(self) -> Buffer:
        """The buffer averaged (the shared segment after :meth:`allocate`)."""
        return self.buffer.array

    _renamed = {"step_count": "steps"}
    _state_keys = ("inter",)

    @property
    def weight(self) -> float:
        """The PushSum weight of this node (1.0 without PushSum between nodes)."""
        return getattr(self.inter, "weight", 1.0)

    @weight.setter
    def weight(self, value: float) -> None:
        self.inter.weight = float(value)

    def step(self) -> None:
        """Node mean, one inter-node round on this rank's slice, gather (collective)."""
        self._check_open()
        self.node.reduce()
        if self.inter is not None:
            self.inter.step()
        self.node.gather()
        self.steps += 1

    def drain(self) -> None:
        """The inter-node communicator's :meth:`drain`."""
        self._check_open()
        if self.inter is not None:
            self.inter.drain()

    @property
    def in_flight(self) -> bool:
        return self.inter is not None and not self.inter.closed and self.inter.in_flight

    def _state(self):
        return {"inter": self.inter.state_dict() if self.inter is not None else {}}

    def _load_state(self, state):
        if self.inter is not None:
            self.inter.load_state_dict(state["inter"])

    def free(self) -> None:
        """Collective: release the inter-node communicator, the window and communicators."""
        if self.closed:
            return
        if self.inter is not None:
            self.inter.free()
        if self.across != MPI.COMM_NULL:
            self.across.Free()
        self.node.free()
        self._free_comm()

    def __repr__(self):
        state = "freed" if self.closed else "open"
        inter = type(self.inter).__name__ if self.inter is not None else None
        return (f"<Hierarchical {self.buffer.kind} {self.buffer.dtype} size={self.buffer.size} rank={self.rank}/"
                f"{self.size} nodes={self.nodes} x {self.node.local_size} inter={inter} steps={self.steps} "
                f"{state}>")
