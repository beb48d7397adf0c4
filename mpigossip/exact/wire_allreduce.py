"""AllReduce's mean in a compressed wire format, without an MPI datatype for it.

Reduce-scatter, then allgather, both over ``Isend``/``Irecv`` (each rank sends ``2 (P - 1) /
P`` of the buffer's wire bytes, as a ring allreduce does):

1. every rank encodes ``x / P`` (pre-scaled, so no sum of P values can overflow the format
   or the buffer's precision) and sends shard ``j`` to rank ``j``;
2. rank ``r`` adds the ``P - 1`` copies of its shard it received to its own ``x_r / P`` in
   one decoding pass, in the buffer's precision: the mean of shard ``r``;
3. it encodes that mean, sends it to every other rank and sets its own shard to the decoded
   value, so that every rank ends with identical bytes; the others decode it into place.

Each shard is encoded once on its way in and once on its way out, never re-encoded at each
hop as a ring of partial sums would be. :class:`NodeWireAllreduce` is the node-aware form
(``algorithm="node-ring"``, the choice across nodes with several ranks per node): the node's
ranks reduce-scatter in the buffer's precision over shared memory, the ranks with one local
rank run the compressed exchange above between the nodes on their shard, and the node
allgathers; only ``2 (N - 1) / N`` of the model in wire bytes crosses a node's link (N
nodes), where the flat exchange sends every rank's off-node shards.

Used by :class:`mpigossip.AllreduceAverager` when ``wire`` is set.
"""

import numpy as np
from mpi4py import MPI

from ..core import buffers, kernels
from ..core import wire as wire_mod
from ..core.base import shard_bounds

_TAG_REDUCE, _TAG_GATHER = 1, 2


class WireAllreduce:
    """The buffers and requests of a compressed mean over ``comm`` (owned by one AllreduceAverager).

    Args:
        comm: the communicator of the mean.
        buf: the :class:`mpigossip.core.buffers.Buffer` averaged in place.
        fmt: the wire format.
        wait: ``wait(requests, op, peer=...)``, the averager's deadline-guarded wait.
        stage, cuda_aware: as for :class:`mpigossip.core.buffers.Transport`.
    """

    def __init__(self, comm, buf, fmt, *, wait, stage=None, cuda_aware=None):
        self.comm, self.buffer, self._wait = comm, buf, wait
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.code = code = wire_mod.Wire(fmt, buf.dtype)
        p, n = self.size, buf.size
        per = -(-n // p)
        shard = -(-per // code.align) * code.align  # n / P rounded up to whole int8 blocks: covers n
        self.bounds = [(min(n, r * shard), min(n, (r + 1) * shard)) for r in range(p)]
        self.slot = code.nbytes(shard)  # bytes of one received shard
        self._send = buffers.Transport(buffers.raw(buf, code.nbytes(n)), stage=stage, cuda_aware=cuda_aware)
        self._recv = buffers.Transport(buffers.raw(buf, self.slot * p), stage=stage, cuda_aware=cuda_aware)
        self._requests = None

    def _wire(self, r):
        """Byte range of shard ``r`` in the send buffer."""
        lo, hi = self.bounds[r]
        at = self.code.offset(lo)
        return at, at + self.code.nbytes(hi - lo)

    def _post(self, tag, sources, send_shards, dests):
        """Irecv shard data from ``sources`` into their slots; Isend ``send_shards[i]`` to ``dests[i]``."""
        comm, me = self.comm, self.rank
        requests, peers = [], []
        for src in sources:
            lo, hi = self.bounds[me if tag == _TAG_REDUCE else src]
            at = src * self.slot
            requests.append(comm.Irecv(self._recv.part(at, at + self.code.nbytes(hi - lo)), source=src, tag=tag))
            peers.append(src)
        for shard, dst in zip(send_shards, dests):
            requests.append(comm.Isend(self._send.part(*self._wire(shard)), dest=dst, tag=tag))
            peers.append(dst)
        return requests, peers

    def start(self):
        """Encode ``x / P`` and post the reduce-scatter."""
        buf, code = self.buffer, self.code
        p, me = self.size, self.rank
        buf.synchronize()  # the user's writes to x, and no device work still reads our buffers
        x, send = buf.array, self._send.buffer.array
        for r, (lo, hi) in enumerate(self.bounds):
            if r != me and hi > lo:
                at, end = self._wire(r)
                code.encode(x[lo:hi], send[at:end], scale=1.0 / p)
        self._send.before_send()
        others = [r for r in range(p) if r != me and self.bounds[me][1] > self.bounds[me][0]]
        dests = [r for r in range(p) if r != me and self.bounds[r][1] > self.bounds[r][0]]
        self._requests = self._post(_TAG_REDUCE, others, dests, dests)

    def test(self):
        """Whether the reduce-scatter's messages have all arrived (drives progress)."""
        return MPI.Request.Testall(self._requests[0])

    def finish(self):
        """Complete the reduce-scatter, average our shard, allgather every shard."""
        buf, code = self.buffer, self.code
        p, me = self.size, self.rank
        requests, peers = self._requests
        self._requests = None
        self._wait(requests, "finish (reduce-scatter)", peer=lambda pending: sorted({peers[i] for i in pending}))
        self._recv.after_recv()
        x, recv, send = buf.array, self._recv.buffer.array, self._send.buffer.array
        lo, hi = self.bounds[me]
        others = [r for r in range(p) if r != me]
        if hi > lo:
            size = code.nbytes(hi - lo)
            parts = [recv[r * self.slot:r * self.slot + size] for r in others]
            code.decode_sum(x[lo:hi], x[lo:hi], 1.0 / p, parts, [1.0] * len(parts))
            at, end = self._wire(me)
            code.encode(x[lo:hi], send[at:end])
            code.decode(send[at:end], x[lo:hi])  # ours as every other rank will have it
        buf.synchronize()  # the decode has read the slots MPI rewrites next; the encode wrote what it sends
        if hi > lo:
            self._send.before_send()
        sources = [r for r in others if self.bounds[r][1] > self.bounds[r][0]]
        dests = others if hi > lo else []
        requests, peers = self._post(_TAG_GATHER, sources, [me] * len(dests), dests)
        self._wait(requests, "finish (allgather)", peer=lambda pending: sorted({peers[i] for i in pending}))
        self._recv.after_recv()
        for r in sources:
            rlo, rhi = self.bounds[r]
            code.decode(recv[r * self.slot:r * self.slot + code.nbytes(rhi - rlo)], x[rlo:rhi])
        buf.release()


class NodeWireAllreduce:
    """The node-aware compressed mean: a reduce-scatter inside the node (MPI on ``node``, the
    buffer's precision), :class:`WireAllreduce` between the nodes on this rank's shard (over
    ``cross``: the ranks with this local rank, one per node), an allgather inside the node.
    Every node must have the same number of ranks. Blocking (:meth:`run`) only: the node's
    collectives would begin in different orders on different ranks when several averagers
    overlap, which MPI's nonblocking collectives do not allow.

    Args:
        node, cross: the layout's communicators (:class:`mpigossip.exact.ring.Layout`).
        memory: the array the mean is computed in (the buffer's, or its host copy when staged).
        fmt, wait, stage, cuda_aware: as for :class:`WireAllreduce`.
    """

    def __init__(self, node, cross, memory, fmt, *, wait, stage=None, cuda_aware=None):
        self.node, self.memory = node, memory
        self.local = node.Get_size()
        self.bounds = shard_bounds(memory.size, self.local)
        lo, hi = self.bounds[node.Get_rank()]
        self.counts = [b - a for a, b in self.bounds]
        self.displs = [a for a, _ in self.bounds]
        self.datatype = buffers.mpi_datatype(memory.dtype)
        whole = buffers.scratch(buffers.as_buffer(memory), max(1, hi - lo)).array
        self.shard = buffers.Buffer(whole[:hi - lo], whole[:hi - lo], "numpy" if isinstance(whole, np.ndarray)
                                    else "cupy")
        # Every node has the same shards: the cross ranks of an empty shard all skip the exchange.
        self.cross = (WireAllreduce(cross, self.shard, fmt, wait=wait, stage=stage, cuda_aware=cuda_aware)
                      if hi > lo and cross.Get_size() > 1 else None)

    def run(self):
        """The mean of ``memory`` over every rank, in place."""
        x, shard = self.memory, self.shard.array
        if self.local == 1:
            shard[...] = x
        else:
            self.node.Reduce_scatter(x, shard, self.counts, MPI.SUM)
            kernels.scale(shard, 1.0 / self.local)   # the node's mean: the cross exchange averages the nodes
        if self.cross is not None:
            self.cross.start()
            self.cross.finish()
        if self.local == 1:
            x[...] = shard
        else:
            self.shard.synchronize()   # the decode has written what the node gathers
            self.node.Allgatherv(shard, [x, self.counts, self.displs, self.datatype])
