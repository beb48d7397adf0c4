"""The synchronous mixing step shared by PushSum and D-PSGD: send ``x`` to the out-peers,
receive the in-peers' ``x``, and combine ``x = a * x + sum_j b_j * x_j`` in one fused pass.

``x`` goes out in chunks (zero-copy); chunk ``i`` of every in-peer is received into slot
``i % slots``, combined into ``x`` once the sends of our own chunk ``i`` have completed
(the out-peers have read it), and the slot is reposted for chunk ``i + slots``. Each chunk
is combined while later ones are still on the wire; receive memory is ``slots *
chunk_bytes`` per in-peer, not a copy of the model. A staged buffer (device memory without
CUDA-aware MPI) goes in one piece.

With a compressed wire format (:mod:`mpigossip.core.wire`) each chunk is encoded into a send
buffer of wire bytes just before its sends are posted, and the same pass keeps the rounding
error: ``x -= (1 - self_weight) * decoded`` (what the out-peers take of it), so the mass
that leaves a rank is exactly what arrives (PushSum's Σx, D-PSGD's mean). The combine
decodes what arrived in the same pass: ``x += sum_j b_j * decoded_j``.

How each message's request is made and waited is the pipeline's *request strategy*
(:class:`mpigossip.core.requests.Immediate` by default: ``Isend``/``Irecv`` under the owner's
deadline). With ``on_failure="continue"`` the communicator passes
:class:`mpigossip.resilience.persistent.PersistentRequests`: the same messages on persistent
requests, each under the eager limit, and the step *atomic*: every chunk has a receive slot of
its own and ``x`` is combined only once every message of the step has arrived, so that a step
that meets a failure (:class:`~mpigossip.resilience.failures.PeerFailure`) leaves ``x`` as it was.
"""

from .. import topology as topo_mod
from ..core import buffers, kernels
from ..core import wire as wire_mod
from ..core.checks import check_integer
from ..core.requests import Immediate


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
        transport: the :class:`~mpigossip.core.buffers.Transport` of ``owner.buffer``.
        chunk_bytes, slots: as the communicators document them.
        wire: a wire format (:data:`mpigossip.core.wire.FORMATS`) or None (the buffer itself).
        requests: the request strategy (None: :class:`~mpigossip.core.requests.Immediate`); one with
            a ``limit`` makes the step atomic (see the module).
    """

    def __init__(self, owner, transport, *, chunk_bytes, slots, stage=None, cuda_aware=None, wire=None,
                 requests=None):
        self.owner, self.x = owner, transport
        self.requests = Immediate(owner) if requests is None else requests
        self.atomic = self.requests.limit is not None
        buf = owner.buffer
        n = buf.size
        self.wire = None if wire is None else wire_mod.Wire(wire, buf.dtype, seed=owner.rank)
        if self.atomic:  # every chunk under the limit, each with a slot of its own: x combined once all arrived
            self.chunk = min(n, max(1, self.requests.limit // buf.dtype.itemsize))
            self.slots = -(-n // self.chunk)
            self._stage, self._cuda_aware = stage, cuda_aware
            self._pipe = []
            self._send = None
            return
        self.chunk = n if transport.staged else min(n, max(1, chunk_bytes // buf.dtype.itemsize))
        if self.wire is not None and self.chunk < n:
            self.chunk = min(n, self.wire.chunk(self.chunk))
        self.slots = 1 if transport.staged else min(slots, -(-n // self.chunk))
        self._stage, self._cuda_aware = stage, cuda_aware
        self._pipe = []
        self._send = None  # wire bytes of the whole buffer (compressed formats only)

    def _slot(self, index):
        while len(self._pipe) <= index:
            if self.wire is None:
                memory = buffers.scratch(self.owner.buffer, self.chunk * self.slots)
            else:
                memory = buffers.raw(self.owner.buffer, self.wire.nbytes(self.chunk) * self.slots)
            self._pipe.append(buffers.Transport(memory, stage=self._stage, cuda_aware=self._cuda_aware))
        return self._pipe[index]

    def _post_sends(self, bounds, outs, tag, share, step):
        """Post every chunk's sends: ``x`` itself, or each chunk's wire bytes encoded just before."""
        comm, buf, requests = self.owner.comm, self.owner.buffer, self.requests
        if self.wire is None:
            self.x.before_send()
            return [[requests.isend(comm, self.x.part(lo, hi), dst, tag) for dst in outs] for lo, hi in bounds]
        if not outs:
            return [[] for _ in bounds]
        code = self.wire
        if self._send is None:
            self._send = buffers.Transport(buffers.message(buf, code), stage=self._stage, cuda_aware=self._cuda_aware)
        x, send = buf.array, self._send
        sends = []
        for lo, hi in bounds:
            at = code.offset(lo)
            code.encode(x[lo:hi], send.buffer.array[at:at + code.nbytes(hi - lo)], share=share, salt=step,
                        offset=lo)
            if send.staged:  # one piece: copied to the host once every chunk is encoded
                sends.append([])
                continue
            buf.synchronize()  # the encode has written the bytes MPI reads
            sends.append([requests.isend(comm, send.part(at, at + code.nbytes(hi - lo)), dst, tag) for dst in outs])
        if send.staged:
            send.before_send()
            sends[0] = [requests.isend(comm, send.spec, dst, tag) for dst in outs]
        return sends

    def run(self, outs, ins, tag, op, *, self_weight, weights, before_combine=None, z=None, w=1.0, step=0):
        """One mixing step (the communicator's ``step``: the wire format's random bits depend on
        it). ``weights[j]`` scales what ``ins[j]`` sends; ``before_combine()``
        runs after the first receives are posted and before the first combine (PushSum waits
        for its weight messages there) and returns ``w`` for the fused de-bias into ``z``.
        Atomic (see the module): ``before_combine`` runs once every message has arrived, and a
        failure before the combine raises with ``x`` as it was."""
        owner, buf = self.owner, self.owner.buffer
        comm, code, requests = owner.comm, self.wire, self.requests
        n, chunk, nslots = buf.size, self.chunk, self.slots
        bounds = [(lo, min(n, lo + chunk)) for lo in range(0, n, chunk)]
        slots = [self._slot(j) for j in range(len(ins))]
        size = chunk if code is None else code.nbytes(chunk)  # one slot, in the slots' elements
        recvs = {}
        buf.synchronize()  # x written (the user's work and ours), no device work reads the slots

        def extent(i):
            lo, hi = bounds[i]
            return hi - lo if code is None else code.nbytes(hi - lo)

        def post(i):
            at = (i % nslots) * size
            recvs[i] = [requests.irecv(comm, slot.part(at, at + extent(i)), src, tag)
                        for slot, src in zip(slots, ins)]

        for i in range(nslots):  # receives first, so early senders find them posted
            post(i)
        # Same (source, tag) for every chunk: MPI matches them in order (non-overtaking).
        sends = self._post_sends(bounds, outs, tag, 1.0 - self_weight, step)
        peers = list(ins) + list(outs)  # the order of the requests in every wait below

        def named(pending):
            return sorted({peers[i % len(peers)] for i in pending})

        x = buf.array
        if self.atomic:  # every message of the step, then the one combine
            requests.wait([r for i in range(len(bounds)) for r in recvs[i] + sends[i]], op, named)
            if before_combine is not None:
                w = before_combine(named)
            parts = []
            for slot in slots:
                slot.after_recv()
                parts.append(slot.buffer.array[:n])
            kernels.weighted_sum(x, x, self_weight, parts, weights, z=z, w=w)
            return
        if before_combine is not None:
            w = before_combine(named)
        for i, (lo, hi) in enumerate(bounds):
            requests.wait(recvs.pop(i) + sends[i], op, named)
            at = (i % nslots) * size
            parts = []
            for slot in slots:
                slot.after_recv()
                parts.append(slot.buffer.array[at:at + extent(i)])
            zi = None if z is None else z[lo:hi]
            if code is None:
                kernels.weighted_sum(x[lo:hi], x[lo:hi], self_weight, parts, weights, z=zi, w=w)
            else:  # the encode kept x - (1 - self_weight) * sent: add what arrived
                code.decode_sum(x[lo:hi], x[lo:hi], 1.0, parts, weights, z=zi, w=w)
            if i + nslots < len(bounds):
                buf.synchronize()  # the combine has read the slot before MPI rewrites it
                post(i + nslots)
