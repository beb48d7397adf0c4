"""The exact mean on persistent requests, for ``AllreduceAverager(on_failure="continue")``.

A ring allreduce (reduce-scatter, then allgather, one block of the buffer per rank) whose
messages are persistent requests made once per communicator (``2 (n - 1)`` rounds, one send
and one receive each, in pieces under the eager limit: :func:`mpigossip.resilience.failures.pieces`;
with Open MPI's ob1 a non-persistent request to a dead peer may end the job:
:mod:`mpigossip.resilience.failures`). The buffer is copied before the ring and put back if a peer fails
in it, so a mean that met a failure leaves the buffer as it was; the communicator then
shrinks to the survivors and the next mean is theirs.
"""

import numpy as np

from ..core import buffers, kernels
from ..core.base import shard_bounds
from . import failures

_TAG = 3


class PersistentRing:
    """The ring of one :class:`~mpigossip.AllreduceAverager` over its current communicator.

    ``owner``: its ``comm``, ``size``, ``rank``, ``buffer``, ``timeout`` and ``_name``.
    """

    def __init__(self, owner, *, stage=None, cuda_aware=None):
        self.owner = owner
        self._t = buffers.Transport(owner.buffer, stage=stage, cuda_aware=cuda_aware)
        self._backup = None
        self._tmp = None
        self._rounds = None  # [(receives, sends, block received, add it?)] per round (pieces under the eager limit)

    def _memory_like(self, size):
        """Scratch of the kind MPI reads (host numpy when staged or on the host)."""
        if self._t.staged or not self.owner.buffer.on_device:
            return np.empty(size, dtype=self.owner.buffer.dtype)
        return buffers.scratch(self.owner.buffer, size).array

    def _build(self):
        owner = self.owner
        n, r, comm = owner.size, owner.rank, owner.comm
        memory = self._t.memory
        bounds = shard_bounds(owner.buffer.size, n)
        longest = max(hi - lo for lo, hi in bounds)
        self._tmp = self._memory_like(max(1, longest))
        right, left = (r + 1) % n, (r - 1) % n
        dtype = owner.buffer.datatype
        rounds = []
        for s in range(n - 1):  # reduce-scatter: block r - s goes right, block r - s - 1 comes in and is added
            lo, hi = bounds[(r - s) % n]
            rlo, rhi = bounds[(r - s - 1) % n]
            rounds.append((failures.recv_init(comm, [self._tmp[:rhi - rlo], dtype], left, _TAG),
                           failures.send_init(comm, [memory[lo:hi], dtype], right, _TAG), (rlo, rhi), True))
        for s in range(n - 1):  # allgather: the reduced block r + 1 - s goes right, block r - s comes in
            lo, hi = bounds[(r + 1 - s) % n]
            rlo, rhi = bounds[(r - s) % n]
            rounds.append((failures.recv_init(comm, [memory[rlo:rhi], dtype], left, _TAG),
                           failures.send_init(comm, [memory[lo:hi], dtype], right, _TAG), (rlo, rhi), False))
        self._rounds = rounds

    def run(self, k):
        """The mean at step ``k``; raises :class:`~mpigossip.resilience.failures.PeerFailure` with the
        buffer as it was."""
        owner = self.owner
        n = owner.size
        if n == 1:
            return
        t = self._t
        t.before_send()
        op = f"{owner._name}.average (step {k}, ring)"
        if self._rounds is None:
            with failures.raised_as_failure(op):  # a revoked communicator fails these at once
                self._build()
        memory = t.memory
        if self._backup is None:
            self._backup = self._memory_like(memory.size)
        self._backup[...] = memory
        on_device = not (t.staged or not owner.buffer.on_device)
        try:
            for recvs, sends, (lo, hi), add in self._rounds:
                with failures.raised_as_failure(op):
                    failures.start(recvs + sends)
                failures.wait(recvs + sends, comm=owner.comm, timeout=owner.timeout, op=op,
                              peer=lambda pending: sorted({(owner.rank - 1) % n, (owner.rank + 1) % n}))
                if add:
                    kernels.weighted_sum(memory[lo:hi], memory[lo:hi], 1.0, [self._tmp[:hi - lo]], [1.0])
                    if on_device:
                        owner.buffer.synchronize()  # the block is sent in the next round
        except failures.PeerFailure:
            memory[...] = self._backup
            raise
        kernels.scale(memory, 1.0 / n)
        t.after_recv()
        owner.buffer.release()

    def abandon(self):
        """The communicator failed: keep its requests alive (never freed); rebuild on the next."""
        if self._rounds is not None:
            failures.keep(*[r for recvs, sends, _, _ in self._rounds for r in recvs + sends])
        self._rounds = None

    def free(self):
        """Free the requests (no failure was met on this communicator)."""
        for recvs, sends, _, _ in self._rounds or ():
            for r in recvs + sends:
                r.Free()
        self._rounds = None
