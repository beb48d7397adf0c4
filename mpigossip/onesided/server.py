"""An asynchronous parameter server in one-sided RMA windows (passive target).

The center variable (``size`` elements) is split into contiguous shards held in
``MPI.Win.Allocate`` windows on ranks ``0 .. servers-1``. Workers open one passive-target
epoch on every rank (``Lock_all``) and then

* ``push(delta)``: ``Raccumulate(SUM)`` into each shard, then ``Flush``;
* ``pull(out)``: ``Rget_accumulate(NO_OP)`` from each shard (an atomic read: MPI makes
  accumulate operations on one element atomic with respect to each other, so a pull
  never sees a torn element, which a plain ``Get`` racing an ``Accumulate`` may).

Server ranks take no part in either call. Across nodes (``atomicity="lock"``, the default
when the ranks do not all share memory) a push is instead ``Lock(EXCLUSIVE)`` + ``Get`` +
add + ``Put`` + ``Unlock`` per shard and a pull ``Lock(SHARED)`` + ``Get`` (:meth:`update`, a
read-modify-write per shard, serves EASGD's exchange with one get and one put): Open MPI 5's
osc/rdma over TCP was seen to hang inside ``MPI_Raccumulate`` (every rank spinning in the
call, so no deadline can fire) in 3 of 4 runs of the test suite across emulated nodes,
while exclusive locks with get/put ran without fault; osc/ucx has the opposite faults. A server rank can also be a worker
(co-located, the default: every rank trains) or dedicated: then it calls :meth:`serve`,
which only keeps it in MPI until every rank calls :meth:`free`. With Open MPI's
``Win.Allocate`` windows the target needs no progress calls; with MPIs whose passive
target progresses only inside MPI calls (MPICH, ``Win.Create``) a dedicated server's
:meth:`serve` loop provides them.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np
from mpi4py import MPI

from ..core import buffers, deadline, kernels
from ..core.base import MPIObject, shard_bounds
from ..core.checks import check_integer
from . import rma

if TYPE_CHECKING:
    from collections.abc import Callable

    from numpy.typing import DTypeLike

    from ..core.hints import Buffer


class ParameterServer(MPIObject):
    """A center variable in RMA windows, sharded over ``servers`` ranks.

    Not an averaging object itself (it has no ``step()``): its workers,
    :class:`~mpigossip.ElasticAveraging` and :class:`~mpigossip.AsyncSGD`, step. It has the
    package's state and life cycle (``state_dict()``, ``free()``, ``with``).

    Args:
        size: number of elements of the center variable (same on every rank).
        dtype: ``float32`` or ``float64`` (``float16`` where MPI has it).
        comm: communicator (keyword-only); collective construction.
        servers: how many ranks (``0 .. servers-1``) hold shards.
        init: optional host array of ``size`` elements: each server rank copies its shard
            from its own ``init`` (pass the same values on every rank); default zeros.
        atomicity: ``"accumulate"`` (MPI accumulate operations: concurrent pushes to one
            shard), ``"lock"`` (exclusive lock, get, add, put: pushes to one shard take turns),
            or ``None``: accumulate when every rank shares this node's memory, else lock.
        timeout: seconds any wait may take before the job is aborted.
    """

    _name = "ParameterServer"
    _counters = ("pushes", "pulls")
    _state_keys = ("center",)

    def _state(self):
        """The center, as this rank reads it (every rank holds a whole copy)."""
        return {"center": self.pull(np.empty(self.size_elements, self.dtype))}

    def _load_state(self, state):
        """Collective: rank 0 sets the center to ``state["center"]``, then every rank meets."""
        saved = np.asarray(state["center"], dtype=self.dtype).reshape(-1)
        error = None if saved.size == self.size_elements else \
            f"load_state_dict: the center has {saved.size} elements, expected {self.size_elements}"
        deadline.raise_collectively(self.comm, error, timeout=self.timeout, op=self._name)
        if self.rank == 0:
            current = self.pull(np.empty(self.size_elements, self.dtype))
            self.push(saved - current)
        deadline.barrier(self.comm, timeout=self.timeout, op=f"{self._name}.load_state_dict")

    def __init__(self, size: int, dtype: DTypeLike, *, comm: MPI.Intracomm, servers: int = 1,
                 init: Buffer | None = None, atomicity: str | None = None, timeout: float | None = None) -> None:
        super().__init__(comm, timeout)
        error = None
        try:
            if atomicity not in (None, "accumulate", "lock"):
                raise ValueError(f"atomicity must be 'accumulate', 'lock' or None, got {atomicity!r}")
            check_integer(size, "size", 1)
            self.dtype = np.dtype(dtype)
            self.datatype = buffers.mpi_datatype(self.dtype)
            check_integer(servers, "servers", 1, self.size)
            if servers > size:
                raise ValueError(f"servers={servers} exceeds size={size}: every shard needs an element")
            if init is not None:
                init_buf = buffers.as_buffer(init, name="init")
                init = init_buf.array.get() if init_buf.on_device else init_buf.array
                if init.size != size:
                    raise ValueError(f"init has {init.size} elements, expected size={size}")
        except (TypeError, ValueError) as exc:
            error = str(exc)
        self._validate(error)
        if atomicity is None:
            atomicity = "accumulate" if self._one_node() else "lock"
        infos = deadline.allgather(self.comm, (int(size), str(self.dtype), servers, atomicity),
                                   timeout=self.timeout, op=self._name)
        if len(set(infos)) > 1:
            self._free_comm()
            raise ValueError(f"{self._name}: (size, dtype, servers, atomicity) differ across ranks: "
                             + ", ".join(f"rank {r}: {i}" for r, i in enumerate(infos)))
        self.atomicity = atomicity
        self.size_elements = int(size)
        self.servers = servers
        self.bounds = shard_bounds(self.size_elements, servers)
        self.is_server = self.rank < servers
        lo, hi = self.bounds[self.rank] if self.is_server else (0, 0)
        self.win = rma.allocate(self.comm, (hi - lo) * self.dtype.itemsize, self.dtype.itemsize,
                                 what=self._name)
        self.shard = np.frombuffer(self.win.tomemory(), dtype=self.dtype) if hi > lo else None
        if self.shard is not None:
            self.win.Lock(self.rank, MPI.LOCK_EXCLUSIVE)
            self.shard[:] = 0 if init is None else init[lo:hi]
            self.win.Unlock(self.rank)
        deadline.barrier(self.comm, timeout=self.timeout, op=f"{self._name} init")
        if self.atomicity == "accumulate":
            self.win.Lock_all()
        self.pushes = 0
        self.pulls = 0
        # NO_OP ignores the origin's values, but Open MPI 5 takes the element count from it:
        # keep a scratch origin as long as the largest shard (origin and result must not alias).
        self._origin = np.zeros(max(hi - lo for lo, hi in self.bounds), self.dtype)
        self._scratch = np.empty_like(self._origin)  # lock mode: a shard's read-modify-write

    def _host(self, obj, name):
        buf = buffers.as_buffer(obj, name=name)
        if buf.size != self.size_elements or buf.dtype != self.dtype:
            raise ValueError(f"{self._name}: {name} must have {self.size_elements} x {self.dtype}, "
                             f"got {buf.size} x {buf.dtype}")
        return buf

    def push(self, delta: Buffer) -> None:
        """``center += delta``, atomically per element; visible to all once this returns."""
        self._check_open()
        buf = self._host(delta, "delta")
        if buf.on_device:
            buf.acquire()
            data = buf.array.get()  # blocks until the copy (and the work before it) is done
        else:
            data = buf.array
        if self.atomicity == "lock":
            for s, (lo, hi) in self._rotated():
                shard = self._scratch[:hi - lo]
                self.win.Lock(s, MPI.LOCK_EXCLUSIVE)
                self._wait(rma.rget(self.win, shard, self.datatype, s), "push (Rget)", peer=s)
                kernels.weighted_sum(shard, shard, 1.0, [data[lo:hi]], [1.0])
                self._wait(rma.rput(self.win, shard, self.datatype, s), "push (Rput)", peer=s)
                self.win.Unlock(s)
        else:
            requests, owners = self._per_shard(
                lambda s, lo, hi: rma.raccumulate(self.win, data[lo:hi], self.datatype, s))
            self._wait(requests, "push (Raccumulate)", peer=owners)
            for s in range(self.servers):
                self.win.Flush(s)
        self.pushes += 1

    def update(self, fn: Callable[..., Any]) -> None:
        """Read-modify-write of the center, shard by shard (one lock at a time, starting at
        this rank's own shard): ``fn(lo, hi, shard)``
        changes ``shard`` (a host array holding ``center[lo:hi]`` as read) in place, and the
        change is written back. Lock mode: each shard under an exclusive lock, ``Get`` then
        ``Put`` (no other push between this read and this write; the shard crosses the link
        twice, not three times as in :meth:`pull` + :meth:`push`; other workers pipeline on
        the other shards meanwhile). Accumulate mode: an atomic read, then the difference
        accumulated (as :meth:`pull` + :meth:`push`)."""
        self._check_open()
        for s, (lo, hi) in self._rotated():
            shard = self._scratch[:hi - lo]
            if self.atomicity == "lock":
                self.win.Lock(s, MPI.LOCK_EXCLUSIVE)
                self._wait(rma.rget(self.win, shard, self.datatype, s), "update (Rget)", peer=s)
                fn(lo, hi, shard)
                self._wait(rma.rput(self.win, shard, self.datatype, s), "update (Rput)", peer=s)
                self.win.Unlock(s)
            else:
                self._wait(rma.rget_accumulate(self.win, self._origin, shard, self.datatype, s),
                           "update (Rget_accumulate)", peer=s)
                before = shard.copy()
                fn(lo, hi, shard)
                kernels.weighted_sum(shard, shard, 1.0, [before], [-1.0])
                self._wait(rma.raccumulate(self.win, shard, self.datatype, s), "update (Raccumulate)", peer=s)
                self.win.Flush(s)
        self.pulls += 1
        self.pushes += 1

    def _rotated(self):
        """``(server, (lo, hi))`` for every shard, starting at this rank's own (rank modulo
        servers): workers taking one shard's lock at a time then start spread over the shards
        instead of queueing on the first."""
        start = self.rank % self.servers
        return [(s, self.bounds[s]) for s in list(range(start, self.servers)) + list(range(start))]

    def _per_shard(self, post):
        """Post ``post(server, lo, hi)``'s requests for every shard; return them and a callable
        naming the servers that the unfinished ones wait for."""
        requests, server = [], []
        for s, (lo, hi) in enumerate(self.bounds):
            posted = post(s, lo, hi)
            requests += posted
            server += [s] * len(posted)
        return requests, lambda pending: sorted({server[i] for i in pending})

    def pull(self, out: Buffer) -> Buffer:
        """Copy the current center into ``out`` (atomic per element)."""
        self._check_open()
        buf = self._host(out, "out")
        host = np.empty(buf.size, self.dtype) if buf.on_device else buf.array
        if self.atomicity == "lock":
            for s, (lo, hi) in self._rotated():
                self.win.Lock(s, MPI.LOCK_SHARED)
                self._wait(rma.rget(self.win, host[lo:hi], self.datatype, s), "pull (Rget)", peer=s)
                self.win.Unlock(s)
        else:
            requests, owners = self._per_shard(
                lambda s, lo, hi: rma.rget_accumulate(self.win, self._origin, host[lo:hi], self.datatype, s))
            self._wait(requests, "pull (Rget_accumulate)", peer=owners)
        if buf.on_device:
            buf.acquire()          # the user's pending work on out comes before our copy
            buf.array.set(host)    # pageable host memory: returns once host is no longer read
            buf.release()
        self.pulls += 1
        return out

    def serve(self, poll: float = 1e-3) -> None:
        """Dedicated server ranks: stay in MPI (driving passive-target progress) until every
        rank has called :meth:`free`, then free. No deadline: a server waits for its workers."""
        self._check_open()
        request = self.comm.Ibarrier()
        while not request.Test():
            time.sleep(poll)
        self._release()

    def free(self) -> None:
        """Collective: wait (with deadline) for every rank, then release the window."""
        if self.closed:
            return
        deadline.barrier(self.comm, timeout=self.timeout, op=f"{self._name}.free")
        self._release()

    def _release(self):
        if self.atomicity == "accumulate":
            self.win.Unlock_all()
        self.win.Free()
        self._free_comm()

    def __repr__(self):
        role = "server" if self.is_server else "worker"
        state = "freed" if self.closed else "open"
        return (f"<ParameterServer size={self.size_elements} {self.dtype} servers={self.servers} {self.atomicity} "
                f"rank={self.rank}/{self.size} ({role}) pushes={self.pushes} pulls={self.pulls} {state}>")
