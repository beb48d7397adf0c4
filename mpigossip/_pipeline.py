"""The synchronous mixing step shared by PushSum and D-PSGD: send ``x`` to the out-peers,
receive the in-peers' ``x``, and combine ``x = a * x + sum_j b_j * x_j`` in one fused pass.

``x`` goes out in chunks (zero-copy); chunk ``i`` of every in-peer is received into slot
``i % slots``, combined into ``x`` once the sends of our own chunk ``i`` have completed
(the out-peers have read it), and the slot is reposted for chunk ``i + slots``. Each chunk
is combined while later ones are still on the wire; receive memory is ``slots *
chunk_bytes`` per in-peer, not a copy of the model. A staged buffer (device memory without
CUDA-aware MPI) goes in one piece.
"""

from . import buffers, kernels
from ._checks import check_integer
from . import topology as topo_mod


def bind_mixing(topology, default, size, *, slots, what):
    """Check the arguments a pipelined communicator shares (``slots``, its topology) and return
    the topology (``default`` if None) bound to ``size``; ``TypeError``/``ValueError`` otherwise.
    ``what`` names the peers in the message (e.g. "distinct peers")."""
    check_integer(slots, "slots", 1)
    if topology is None:
        topology = default
    if not isinstance(topology, topo_mod.Topology):
        raise TypeError(f"topology must be a mpigossip.topology.Topology, got {topology!r}")
    if topology.allow_self:
        raise ValueError(f"{topology!r} may send to self; {what}")
    return topology.bind(size)


class Pipeline:
    """Receive slots and chunking for one buffer (owned by one communicator).

    Args:
        owner: the communicator (its ``comm``, ``buffer`` and ``_wait``).
        transport: the :class:`~mpigossip.buffers.Transport` of ``owner.buffer``.
        chunk_bytes, slots: as the communicators document them.
    """

    def __init__(self, owner, transport, *, chunk_bytes, slots, stage=None, cuda_aware=None):
        self.owner, self.x = owner, transport
        buf = owner.buffer
        n = buf.size
        self.chunk = n if transport.staged else min(n, max(1, chunk_bytes // buf.dtype.itemsize))
        self.slots = 1 if transport.staged else min(slots, -(-n // self.chunk))
        self._stage, self._cuda_aware = stage, cuda_aware
        self._pipe = []

    def _slot(self, index):
        while len(self._pipe) <= index:
            size = self.chunk * self.slots
            self._pipe.append(buffers.Transport(buffers.scratch(self.owner.buffer, size), stage=self._stage,
                                                cuda_aware=self._cuda_aware))
        return self._pipe[index]

    def run(self, outs, ins, tag, op, *, self_weight, weights, before_combine=None, z=None, w=1.0):
        """One mixing step. ``weights[j]`` scales what ``ins[j]`` sends; ``before_combine()``
        runs after the first receives are posted and before the first combine (PushSum waits
        for its weight messages there) and returns ``w`` for the fused de-bias into ``z``."""
        owner, buf = self.owner, self.owner.buffer
        comm = owner.comm
        buf.synchronize()  # x written (the user's work and ours), no device work reads the slots
        self.x.before_send()
        n, chunk, nslots = buf.size, self.chunk, self.slots
        bounds = [(lo, min(n, lo + chunk)) for lo in range(0, n, chunk)]
        # Same (source, tag) for every chunk: MPI matches them in order (non-overtaking).
        sends = [[comm.Isend(self.x.part(lo, hi), dest=dst, tag=tag) for dst in outs] for lo, hi in bounds]
        slots = [self._slot(j) for j in range(len(ins))]
        recvs = {}

        def post(i):
            lo, hi = bounds[i]
            at = (i % nslots) * chunk
            recvs[i] = [comm.Irecv(slot.part(at, at + hi - lo), source=src, tag=tag) for slot, src in zip(slots, ins)]

        for i in range(nslots):
            post(i)
        peers = list(ins) + list(outs)  # the order of the requests in every wait below

        def named(pending):
            return sorted({peers[i] for i in pending})

        if before_combine is not None:
            w = before_combine(named)
        x = buf.array
        for i, (lo, hi) in enumerate(bounds):
            owner._wait(recvs.pop(i) + sends[i], op, peer=named)
            at = (i % nslots) * chunk
            parts = []
            for slot in slots:
                slot.after_recv()
                parts.append(slot.buffer.array[at:at + hi - lo])
            kernels.weighted_sum(x[lo:hi], x[lo:hi], self_weight, parts, weights,
                                 z=None if z is None else z[lo:hi], w=w)
            if i + nslots < len(bounds):
                buf.synchronize()  # the combine has read the slot before MPI rewrites it
                post(i + nslots)
