"""AllReduce SGD's exact averaging: ``buf = mean over ranks of buf``, in place."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from mpi4py import MPI

from ..core import buffers, kernels, watchdog
from ..core.base import Communicator, check_chunk_bytes
from ..core.checks import integer_error
from ..resilience import failures, tolerant
from ..resilience.membership import MeanJoin
from ..resilience.persistent import PersistentRequests
from ..resilience.tolerant import Survives
from .ring import ALGORITHMS, SEGMENT_BYTES, Layout, NodeRing, Ring
from .wire_allreduce import NodeWireAllreduce, WireAllreduce

if TYPE_CHECKING:
    from ..core.hints import Buffer

_COUNTED = object()  # on_failure="continue": a start() that moves nothing (one rank, or a call that only counts)


class AllreduceAverager(MeanJoin, Survives, Communicator):
    """Exact in-place mean of one buffer over ``comm``: MPI's ``Allreduce`` / ``Iallreduce``
    with SUM, or a ring over ``Isend``/``Irecv``, flat or node-aware (:mod:`mpigossip.exact.ring`),
    whichever runs nearer the network's limit for this size and layout.

    Args:
        buf: numpy array, cupy array or torch tensor; contiguous, same length and dtype on
            every rank. Updated in place.
        comm: the communicator (keyword-only).
        timeout: seconds any wait may take before the job is aborted.
        cuda_aware: override CUDA-aware MPI detection for device buffers.
        stage: force (``True``) a host staging copy; default decides from the device.
        chunk_bytes: ``average()`` reduces the buffer in chunks of this size, scaling each
            chunk right after its ``Allreduce`` while it is in cache. Default (None): 4 MiB
            when every rank shares one node (faster than one whole-buffer ``Allreduce`` at
            large sizes), the whole buffer when the ranks span nodes (over a network each chunk
            costs the algorithm's latency rounds again; docs/RESULTS.md, P1). Same on every rank.
        dup: ``False`` uses ``comm`` as it is (a private duplicate its caller owns and frees),
            see :class:`~mpigossip.core.base.Communicator`.
        wire: ``None`` (MPI's ``Allreduce`` in the buffer's dtype) or a compressed format of
            :mod:`mpigossip.core.wire`: then the mean is a reduce-scatter and an allgather over
            ``Isend``/``Irecv`` of the pre-scaled, encoded buffer (:mod:`mpigossip.exact.wire_allreduce`;
            ``chunk_bytes`` does not apply; with ``algorithm`` ``"node-ring"``, ``average()``
            first reduces inside each node in the buffer's precision and compresses only what
            crosses between nodes); every rank ends with identical values.
        algorithm: how the bytes move: ``"mpi"`` (MPI's ``Allreduce``), ``"ring"`` (a ring over
            ``Isend``/``Irecv``, segmented and pipelined), ``"node-ring"`` (reduce-scatter in
            each node's shared memory, one ring per local rank between nodes, allgather in the
            node; ``start()``/``finish()`` run the flat ring, since overlapping averagers would
            begin the node's nonblocking collectives in different orders on different ranks),
            or ``"auto"`` (default): MPI's on one node and for small buffers, the
            node-aware ring across nodes with several ranks per node, else the flat ring (the
            crossovers measured: docs/RESULTS.md). Same on every rank.
        segment_bytes: the rings' message size (63 KiB: sent eagerly by Open MPI's TCP
            transport). Same on every rank.
        layout: a :class:`mpigossip.exact.ring.Layout` of ``comm`` to share (many averagers on one
            communicator: its sub-communicators are made once); default: its own.
        on_failure: ``"abort"`` or ``"continue"``: the survivors of a failed rank go on
            (:mod:`mpigossip.resilience.failures`; launch with ``mpiexec --with-ft ulfm``). The
            mean then runs the flat ring (``algorithm`` ``"auto"`` or ``"ring"``; MPI's
            collectives and the node-aware ring's node phases do not survive a failure), the
            same schedule on persistent requests (:mod:`mpigossip.resilience.persistent`);
            an ``average()`` or a ``start()``/``finish()`` that meets a failure leaves the
            buffer as it was (a survivor whose ring had completed keeps its mean: the ranks'
            buffers may differ by that one average), the communicator shrinks to the survivors,
            and from the next mean on it is theirs. ``failures``/``members`` as for
            :class:`mpigossip.PushSum`. Not with ``wire`` or :meth:`join`.

    ``average()`` blocks; ``start()`` posts a nonblocking ``Iallreduce`` that overlaps
    with computation until ``finish()``. Do not touch ``buf`` in between. Uneven data shards:
    :meth:`join` on every rank, then a rank out of data calls :meth:`leave` (or use
    :class:`mpigossip.Join`); the mean is then over the ranks still training.
    """

    _name = "AllreduceAverager"
    _ring: Ring | NodeRing | None            # average()'s ring (None: MPI's Allreduce)
    _nonblocking_ring: Ring | None           # start()/finish()'s ring

    def __init__(self, buf: Buffer, *, comm: MPI.Intracomm, timeout: float | None = None,
                 cuda_aware: bool | None = None, stage: bool | None = None, chunk_bytes: int | None = None,
                 dup: bool = True, wire: str | None = None, algorithm: str = "auto", segment_bytes: int = SEGMENT_BYTES,
                 layout: Layout | None = None, on_failure: str = "abort") -> None:
        super().__init__(comm, timeout, dup=dup)
        error = check_chunk_bytes(chunk_bytes, auto=True) or integer_error(segment_bytes, "segment_bytes", 1)
        if algorithm not in ALGORITHMS:
            error = error or f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}"
        error = error or failures.check_on_failure(on_failure, wire)
        if on_failure == "continue" and algorithm == "mpi":
            error = error or ("algorithm='mpi' cannot survive a failed rank (MPI's collectives do not): with "
                              "on_failure='continue' use 'auto', 'ring' or 'node-ring'")
        self._validate(error)
        self._algorithm = algorithm
        self.buffer = self._check_buffer(buf, name="buf", wire=wire, same={
            "chunk_bytes": chunk_bytes, "algorithm": algorithm, "segment_bytes": segment_bytes,
            "on_failure": on_failure})
        self.members = list(range(self.size))
        self.failures: list[Any] = []
        self._tolerate(on_failure, lambda: PersistentRequests(self))
        self.wire = wire
        self.segment_bytes = segment_bytes
        self._sync = self.buffer.synchronize if self.buffer.on_device else (lambda: None)
        self._own_layout = layout is None
        self.layout = Layout(self.comm, timeout=self.timeout) if layout is None else layout
        self.algorithm = self.layout.choose(algorithm, self.buffer.nbytes, tolerant=self._exchange is not None)
        self._backup = None  # on_failure="continue": the buffer before the mean, put back if a peer fails in it
        self._tags = None    # on_failure="continue": the rings' one tag window (persistent requests keep their tags)
        self._failed = None  # on_failure="continue": the PeerFailure met in start() or test(), raised by finish()
        self._build_rings()
        self._compressed = (WireAllreduce(self.comm, self.buffer, wire, wait=self._wait, stage=stage,
                                          cuda_aware=cuda_aware) if wire is not None and self.size > 1 else None)
        self._transport = buffers.Transport(self.buffer, stage=stage, cuda_aware=cuda_aware)
        self._node_compressed = None   # average()'s node-aware form of the compressed mean
        if self._compressed is not None and self.algorithm == "node-ring":
            self._node_compressed = NodeWireAllreduce(self.layout.node, self.layout.cross, self._transport.memory,
                                                      wire, wait=self._wait, stage=stage, cuda_aware=cuda_aware)
        self._request = None
        if chunk_bytes is None:
            chunk_bytes = 4 << 20 if self.layout.one_node else max(1, self.buffer.nbytes)
        self.chunk_bytes = chunk_bytes
        self._chunk = max(1, chunk_bytes // self.buffer.dtype.itemsize)
        self.steps = 0

    _renamed = {"rounds": "steps"}

    def _build_rings(self):
        """The rings over the current communicator. ``start()``/``finish()`` always run a flat
        ring: the node-aware one's node collectives would be begun in a different order on
        different ranks when several averagers overlap (a model's buckets), which MPI's
        nonblocking collectives do not allow. With ``on_failure="continue"`` the same rings run
        on persistent requests (:class:`~mpigossip.resilience.persistent.PersistentRequests`),
        in messages under the eager limit, in one tag window."""
        self._ring = None
        self._nonblocking_ring = None
        itemsize = self.buffer.dtype.itemsize
        segment = max(1, self.segment_bytes // itemsize)
        claim = self.layout.claim_tags
        if self._exchange is not None:
            segment = min(segment, max(1, self._exchange.limit // itemsize))
            claim = self._tag_window
        options = {"synchronize": self._sync, "segment": segment, "scale": 1.0 / self.size, "claim": claim,
                   "requests": self._exchange}
        if self.algorithm in ("ring", "node-ring"):
            self._nonblocking_ring = Ring(self, self.comm, op="finish (ring)", **options)
            self._ring = self._nonblocking_ring
        if self.algorithm == "node-ring":
            self._ring = NodeRing(self, self.layout.node, self.layout.cross,
                                  op="average (node-aware ring)", **options)

    def _tag_window(self, count):
        """``on_failure="continue"``: every run's tags from one window, claimed at the first run
        on this communicator (its persistent requests are made once, with their tags), wide
        enough for any of its rings (a ring over P ranks takes 2 (P - 1) tags)."""
        if self._tags is None:
            self._tags = self.layout.claim_tags(max(count, 2 * self.size))
        return self._tags

    def step(self) -> None:
        """The blocking exact mean (:meth:`average`)."""
        self.average()

    def average(self) -> None:
        """Blocking exact mean (after :meth:`join`: over the ranks still training)."""
        if self._exchange is not None:
            self._check_idle()
            return self._tolerant_step(self._tolerant_average)
        if self._shadow_round():
            return
        self._average()
        self._rescale()

    def _average(self):
        """Blocking exact mean.

        Blocking ``Allreduce`` calls (MPI's tuned algorithms, faster than ``Iallreduce``'s for
        large buffers) reduce the buffer chunk by chunk, each chunk scaled by ``1/n`` right
        after its reduction while it is still in cache. They run under the process's watchdog
        (:mod:`mpigossip.core.watchdog`): a rank that never arrives ends the job, named, at no
        cost per call.
        """
        self._check_idle()
        if self.size == 1:
            self.steps += 1
            return
        op = f"{self._name}.average"
        if self._node_compressed is not None:
            t = self._transport
            t.before_send()
            with watchdog.watching(self.comm, self.timeout, op):
                self._node_compressed.run()
            t.after_recv()
            self.buffer.release()
            self.steps += 1
            return
        if self._compressed is not None:
            self._start()
            self._finish_average()
            return
        t = self._transport
        t.before_send()
        if self._ring is not None:  # the mean, scaled by the ring
            with watchdog.watching(self.comm, self.timeout, op):
                self._ring.run(t.memory)
            t.after_recv()
            self.buffer.release()
            self.steps += 1
            return
        in_place = not (t.staged or self.buffer.on_device)
        array, inv = self.buffer.array, 1.0 / self.size
        n = self.buffer.size
        with watchdog.watching(self.comm, self.timeout, op):
            for lo in range(0, n, self._chunk):
                hi = min(n, lo + self._chunk)
                self.comm.Allreduce(MPI.IN_PLACE, t.part(lo, hi), MPI.SUM)
                if in_place:
                    kernels.scale(array[lo:hi], inv)
        if not in_place:
            t.after_recv()
            kernels.scale(array, inv)
            self.buffer.release()
        self.steps += 1

    def _backed_up(self):
        """``on_failure="continue"``: the memory MPI reads (staged to the host if need be), with a
        copy kept to put back if a peer fails in the mean."""
        t = self._transport
        t.before_send()
        memory = t.memory
        if self._backup is None:
            self._backup = buffers.empty_like(memory, memory.size)
        self._backup[...] = memory
        return memory

    def _salvage(self):
        """A peer failed in the mean: the buffer as it was before it (the memory MPI wrote, put
        back), the ring's place forgotten, and the layout's sub-communicators revoked (a rank of
        this node still waiting in the node-aware ring's node phases for this one, gone to its
        recovery, fails out of the wait and recovers too)."""
        if self.algorithm == "node-ring":
            tolerant.revoke_all([self.layout.node, self.layout._cross])
        self._transport.memory[...] = self._backup
        for ring in (self._ring, self._nonblocking_ring):
            if ring is not None:
                ring.abandon()

    def _tolerant_average(self, k):
        """The blocking mean at step ``k`` on persistent requests; raises PeerFailure with the
        buffer as it was."""
        if self.size == 1:
            return
        memory = self._backed_up()
        try:
            self._ring.run(memory)
        except failures.PeerFailure:
            self._salvage()
            raise
        self._transport.after_recv()
        self.buffer.release()

    def _tolerant_start(self):
        self._check_idle()
        self._request = self._nonblocking_ring  # (None alone, with one rank)
        if self._skip or self.size == 1:   # a call that only counts (see Survives), or nothing to move
            self._request = _COUNTED
            return
        memory = self._backed_up()
        try:
            self._nonblocking_ring.start(memory)
        except failures.PeerFailure as exc:
            self._failed = exc

    def _tolerant_finish(self, k):
        ring, failed = self._request, self._failed
        self._request, self._failed = None, None
        if ring is _COUNTED:
            return
        try:
            if failed is not None:
                raise failed
            ring.wait()
        except failures.PeerFailure:
            self._salvage()
            raise
        self._transport.after_recv()
        self.buffer.release()

    def start(self) -> None:
        """Post the nonblocking ``Iallreduce`` (with a wire format: the reduce-scatter; with a
        ring: its first messages); returns at once (after :meth:`join`, a small blocking count of
        the ranks still training comes first)."""
        if self._exchange is not None:
            return self._tolerant_start()
        if self._shadow_round(overlap=True):
            return
        self._start()

    def _start(self):
        self._check_idle()
        if self._compressed is not None:
            self._compressed.start()
            self._request = self._compressed
            return
        self._transport.before_send()
        if self._nonblocking_ring is not None:
            self._nonblocking_ring.start(self._transport.memory)
            self._request = self._nonblocking_ring
            return
        self._request = self.comm.Iallreduce(MPI.IN_PLACE, self._transport.spec, MPI.SUM)

    def test(self) -> bool:
        """Whether the started average has completed (drives progress)."""
        if self._request is None:
            raise RuntimeError(f"{self._name}.test(): nothing started")
        if self._exchange is not None:  # a failure met here is raised (and recovered from) by finish()
            if self._request is _COUNTED or self._failed is not None:
                return True
            try:
                return self._nonblocking_ring.test()
            except failures.PeerFailure as exc:
                self._failed = exc
                return True
        if self._compressed is not None:
            return self._compressed.test()
        if self._nonblocking_ring is not None:
            return self._nonblocking_ring.test()
        return self._request.Test()

    def finish(self) -> None:
        """Complete the started average and scale by ``1/size`` (after :meth:`join`: by one over
        the ranks still training)."""
        if self._exchange is not None:
            if self._request is None:
                raise RuntimeError(f"{self._name}.finish(): start() was not called")
            if self._request is _COUNTED and not self._skip:  # one rank: nothing moved, the step counts
                self._request = None
                self.steps += 1
                return
            return self._tolerant_step(self._tolerant_finish)
        if self._joined and self.active == 0 and self._request is None:
            return  # every rank had left: start() moved nothing
        self._finish_average()
        self._rescale()

    def _finish_average(self):
        if self._request is None:
            raise RuntimeError(f"{self._name}.finish(): start() was not called")
        if self._compressed is not None:  # allgather and decode: the mean, no scaling left
            self._request = None
            self._compressed.finish()
            self.steps += 1
            return
        if self._nonblocking_ring is not None:  # scaled by the ring
            self._request = None
            self._nonblocking_ring.wait()
            self._transport.after_recv()
            self.buffer.release()
            self.steps += 1
            return
        self._wait(self._request, "finish", peer="all ranks (Iallreduce)")
        self._request = None
        self._transport.after_recv()
        self._finish()

    def _finish(self):
        if self.size > 1:
            kernels.scale(self.buffer.array, 1.0 / self.size)
            self.buffer.release()
        self.steps += 1

    def wait(self) -> None:
        """Deprecated name of :meth:`finish`."""
        warnings.warn("AllreduceAverager.wait() is deprecated: use finish()", DeprecationWarning, stacklevel=2)
        self.finish()

    def drain(self) -> None:
        """Complete a started average, if any."""
        self._check_open()
        self._complete()

    def _check_idle(self):
        self._check_open()
        if self._request is not None:
            raise RuntimeError(f"{self._name}: an average is in flight; call finish() first")

    @property
    def in_flight(self) -> bool:
        return self._request is not None

    def _complete(self):
        if self._request is not None:
            self.finish()

    def restore(self) -> None:
        """``on_failure="continue"``: put the buffer back as it was before the last mean (its
        copy kept for a failure): a caller that must mean again over the survivors (a model's
        gradient buckets, one of which met a failure) starts again from its own values."""
        if self._exchange is None:
            raise RuntimeError(f"{self._name}.restore(): only with on_failure='continue'")
        self._check_idle()
        if self._backup is None:
            return
        t = self._transport
        t.memory[...] = self._backup
        t.after_recv()   # (staged: the host copy back to the device buffer)
        self.buffer.release()

    def _rebind(self):
        """After a shrink: the layout and the rings over the survivors (the failed layout's
        communicators hold the dead rank: kept, never freed). A mean still in flight (started,
        not finished: another averager met the failure, :func:`~mpigossip.resilience.tolerant.
        recover_together`) is abandoned, the buffer as it was."""
        if self._request is not None:
            if self._request is not _COUNTED:
                self._salvage()
            self._request, self._failed = None, None
        failures.keep(self.layout)
        self.layout, self._own_layout = Layout(self.comm, timeout=self.timeout), True
        self.algorithm = self.layout.choose(self._algorithm, self.buffer.nbytes, tolerant=True)  # (node-ring:
        # the ring if the survivors' nodes now differ in size)
        self._tags = None
        self._build_rings()

    def join(self) -> None:
        """See :class:`~mpigossip.resilience.membership.MeanJoin` (not with ``on_failure="continue"``)."""
        if self._exchange is not None:
            raise RuntimeError(f"{self._name}.join(): not with on_failure='continue'")
        super().join()

    def free(self) -> None:
        if not self.closed:
            self._complete()
            if self._exchange is not None and not self.failures:
                self._exchange.free()
            if self._own_layout and not self.failures:  # (its communicators hold the failed rank)
                self.layout.free()
        self._free_comm()

    def __repr__(self):
        state = "freed" if self.closed else ("in flight" if self.in_flight else "idle")
        return (f"<AllreduceAverager {self.buffer.kind} {self.buffer.dtype} size={self.buffer.size} "
                f"ranks={self.size} {self.algorithm}{'' if self.wire is None else ' wire=' + self.wire} "
                f"steps={self.steps} {state}>")
