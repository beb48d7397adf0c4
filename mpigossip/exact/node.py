"""The exact mean of one buffer over the ranks of each node, in an MPI-3 shared-memory window.

Ranks are grouped per node (``Split_type(COMM_TYPE_SHARED)``). Each rank owns one
segment of a ``Win.Allocate_shared`` window as long as the buffer, and one slice of the
buffer (``1/L`` of it for ``L`` ranks on the node). Two ways to use it:

* :meth:`NodeMean.allocate`: the buffer *is* this rank's segment (:attr:`NodeMean.array`;
  the torch wrappers put the model there). A mean is then a node barrier, one pass in
  which every rank averages its own slice over the ``L`` segments and writes the mean into
  that slice of every segment, block by block while the block is in cache, and a barrier.
  Per rank that reads the model once and writes it once, against about five passes for
  an exchange plus a combine, and no messages at all.
* ``NodeMean(x)``: any buffer (also device memory); it is copied into the segment first and
  the mean copied back at the end: two more passes.

Between the reduce and the gather the node mean of a rank's slice sits in shared memory
(:attr:`NodeMean.part`), where an inter-node communicator can work on it
(:class:`mpigossip.exact.hierarchical.Hierarchical`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import numpy as np
from mpi4py import MPI

from ..core import buffers, deadline, kernels, nodes
from ..core.base import Communicator, shard_bounds
from ..core.checks import check_integer

if TYPE_CHECKING:
    from numpy.typing import DTypeLike

    from ..core.hints import Buffer


class NodeMean(Communicator):
    """Exact in-place mean of ``x`` over the ranks sharing this rank's node.

    Args:
        x: numpy/cupy/torch buffer, same length and dtype on every rank, at least as many
            elements as ranks on a node; updated in place.
        comm: communicator (keyword-only); collective construction.
        node_size: ranks per group; default: all ranks that share memory
            (``COMM_TYPE_SHARED``). A divisor of that splits each node into groups of that
            many consecutive ranks (a socket, a GPU's NUMA domain, or emulated nodes on one
            machine, as the tests do).
        timeout: seconds any wait may take before the job is aborted.
    """

    _name = "NodeMean"

    def __init__(self, x: Buffer, *, comm: MPI.Intracomm, node_size: int | None = None, timeout: float | None = None,
                 _allocate: tuple[int, np.dtype] | None = None) -> None:
        super().__init__(comm, timeout)
        shared = nodes.node_comm(self.comm, key=self.rank)
        error = None
        if node_size is not None and (isinstance(node_size, bool) or not isinstance(node_size, int)
                                      or node_size < 1 or shared.Get_size() % node_size):
            error = (f"node_size must be a positive divisor of the {shared.Get_size()} ranks sharing "
                     f"rank {self.rank}'s memory, got {node_size!r}")
        try:
            deadline.raise_collectively(self.comm, error, timeout=self.timeout, op=self._name)
        except ValueError:
            shared.Free()
            self._free_comm()
            raise
        if node_size is None or node_size == shared.Get_size():
            self.node = shared
        else:
            self.node = cast(MPI.Intracomm, shared.Split(shared.Get_rank() // node_size, key=self.rank))
            shared.Free()
        self.local_rank, self.local_size = self.node.Get_rank(), self.node.Get_size()
        self.in_window = _allocate is not None
        if _allocate is not None:
            x = np.zeros(_allocate[0], dtype=_allocate[1])  # stands for the segment in the checks
        try:
            self.buffer = buffers.check_buffer(x, comm=self.comm, op=self._name, name="x", timeout=self.timeout)
            error = None
            if self.buffer.size < self.local_size:
                error = (f"x has {self.buffer.size} elements, fewer than the {self.local_size} ranks of "
                         f"rank {self.rank}'s node: every rank needs a slice")
            deadline.raise_collectively(self.comm, error, timeout=self.timeout, op=self._name)
        except (TypeError, ValueError):
            self.node.Free()
            self._free_comm()
            raise
        dtype, n = self.buffer.dtype, self.buffer.size
        self.bounds = shard_bounds(n, self.local_size)
        self.lo, self.hi = self.bounds[self.local_rank]
        self.win = MPI.Win.Allocate_shared(n * dtype.itemsize, dtype.itemsize, comm=self.node)
        self.segments = []
        for r in range(self.local_size):
            memory, _ = self.win.Shared_query(r)
            self.segments.append(np.frombuffer(memory, dtype=dtype)[:n])  # type: ignore[call-overload]
        self.win.Lock_all()
        self.steps = 0
        if self.in_window:
            self.segments[self.local_rank][:] = 0  # others read it only after the next barrier
            self.buffer = buffers.as_buffer(self.segments[self.local_rank], name="x")

    @classmethod
    def allocate(cls, size: int, dtype: DTypeLike, *, comm: MPI.Intracomm, node_size: int | None = None,
                 timeout: float | None = None) -> NodeMean:
        """A node mean whose buffer is this rank's shared segment, :attr:`array` (zeros):
        compute on it in place, and :meth:`average` moves no extra copy (collective). The
        array is valid until :meth:`free`: copy out what must outlive it."""
        check_integer(size, "size", 1)
        return cls(None, comm=comm, node_size=node_size, timeout=timeout, _allocate=(int(size), np.dtype(dtype)))

    @property
    def array(self) -> Buffer:
        """The buffer this node mean works on (the shared segment after :meth:`allocate`)."""
        return self.buffer.array

    @property
    def part(self) -> np.ndarray:
        """This rank's slice of the node mean in shared memory (valid between :meth:`reduce`
        and :meth:`gather`): a contiguous numpy view that other communicators may update."""
        return self.segments[self.local_rank][self.lo:self.hi]

    def _barrier(self, what):
        self.win.Sync()
        deadline.barrier(self.node, timeout=self.timeout, op=f"{self._name}.{what}")
        self.win.Sync()

    def reduce(self) -> None:
        """Afterwards :attr:`part` holds the node mean of this rank's slice (collective per
        node). Until :meth:`gather`, only this rank reads or writes its slice of any segment."""
        self._check_open()
        mine = self.segments[self.local_rank]
        if not self.in_window:
            if self.buffer.on_device:
                self.buffer.acquire()
                self.buffer.array.get(out=mine, blocking=True)
            else:
                np.copyto(mine, self.buffer.array)
        self._barrier("reduce")
        self._mean_slice(broadcast=False)

    def _mean_slice(self, broadcast):
        """This rank's slice: the mean over the segments into its own segment and, with
        ``broadcast``, into every other segment too, block by block while it is in cache."""
        lo, hi = self.lo, self.hi
        me = self.local_rank
        inv = 1.0 / self.local_size
        mine = self.segments[me]
        step = kernels.CPU_BLOCK
        for b in range(lo, hi, step):
            e = min(hi, b + step)
            others = [s[b:e] for r, s in enumerate(self.segments) if r != me]
            kernels.weighted_sum(mine[b:e], mine[b:e], inv, others, [inv] * len(others))
            if broadcast:
                for other in others:
                    np.copyto(other, mine[b:e])

    def _broadcast_slice(self):
        lo, hi = self.lo, self.hi
        for r, s in enumerate(self.segments):
            if r != self.local_rank:
                np.copyto(s[lo:hi], self.segments[self.local_rank][lo:hi])

    def gather(self) -> None:
        """Every slice's value into every rank's buffer (collective per node); then the
        segments may be reused."""
        self._check_open()
        if self.in_window:
            self._broadcast_slice()  # this rank still owns its slice of every segment
        else:
            self._barrier("gather")
            x = self.buffer.array
            for s, (lo, hi) in zip(self.segments, self.bounds):
                if self.buffer.on_device:
                    x[lo:hi].set(s[lo:hi])  # pageable source: returns once s is no longer read
                else:
                    np.copyto(x[lo:hi], s[lo:hi])
            self.buffer.release()
        self._barrier("gather (done)")  # nobody touches a segment another still reads or writes
        self.steps += 1

    _renamed = {"rounds": "steps"}

    def step(self) -> None:
        """The node mean (:meth:`average`)."""
        self.average()

    def average(self) -> None:
        """The node mean, in place in the buffer on every rank of the node (collective per
        node). In the window: one barrier, one pass (mean and copies of each block while it
        is in cache), one barrier."""
        if not self.in_window:
            self.reduce()
            self.gather()
            return
        self._check_open()
        self._barrier("average")
        self._mean_slice(broadcast=True)
        self._barrier("average (done)")
        self.steps += 1

    def free(self) -> None:
        """Collective: release the window and the communicators."""
        if self.closed:
            return
        deadline.barrier(self.comm, timeout=self.timeout, op=f"{self._name}.free")
        self.win.Unlock_all()
        self.win.Free()
        self.node.Free()
        self._free_comm()

    def __repr__(self):
        state = "freed" if self.closed else "open"
        return (f"<NodeMean {self.buffer.kind} {self.buffer.dtype} size={self.buffer.size} rank={self.rank}/"
                f"{self.size} local {self.local_rank}/{self.local_size} steps={self.steps} {state}>")
