"""PushSum's synchronous step on persistent requests, for ``on_failure="continue"``.

The same round as :mod:`mpigossip._pipeline` (``x`` sent zero-copy, each in-peer's ``x``
received and combined in one fused pass), with two differences the failure path needs
(:mod:`mpigossip.failures`): every message is a persistent request, made once per peer and
receive slot and started each step (with Open MPI's ob1, a non-persistent request to a dead
peer may end the job), and ``x`` is combined only once every message of the step has arrived,
so a step that meets a failure leaves ``(x, w)`` as they were: ``z = x / w`` stays a weighted
average of what the ranks held. The buffer goes in one piece (no chunks: a chunk combined
before the failure would leave parts of ``x`` mixed with other weights than the rest).

Messages keep one tag per kind: a step completes all of its messages before the next starts,
and MPI matches messages between two ranks in the order they were sent.
"""

import numpy as np
from mpi4py import MPI

from . import buffers, failures

_X_TAG, _W_TAG = 1, 2


class PersistentExchange:
    """The persistent requests of one PushSum over its current communicator.

    ``owner`` is the PushSum: its ``comm``, ``buffer``, ``weight``, ``timeout``, ``_name``,
    ``_stage``, ``_cuda_aware`` and ``_combine``.
    """

    def __init__(self, owner):
        self.owner = owner
        self._x = buffers.Transport(owner.buffer, stage=owner._stage, cuda_aware=owner._cuda_aware)
        self._slots = []   # receive Transports, one per in-peer index of a step
        self._wsend = np.zeros(1, dtype=np.float64)
        self._recvs = {}   # (src, slot) -> (x request, w request, w buffer)
        self._sends = {}   # dst -> (x request, w request)

    def _recv(self, src, j):
        key = (src, j)
        if key not in self._recvs:
            while len(self._slots) <= j:
                self._slots.append(buffers.Transport(buffers.scratch(self.owner.buffer), stage=self.owner._stage,
                                                     cuda_aware=self.owner._cuda_aware))
            comm, w = self.owner.comm, np.zeros(1, dtype=np.float64)
            self._recvs[key] = (comm.Recv_init(self._slots[j].spec, source=src, tag=_X_TAG),
                                comm.Recv_init(w, source=src, tag=_W_TAG), w)
        return self._recvs[key]

    def _send(self, dst):
        if dst not in self._sends:
            comm = self.owner.comm
            self._sends[dst] = (comm.Send_init(self._x.spec, dest=dst, tag=_X_TAG),
                                comm.Send_init(self._wsend, dest=dst, tag=_W_TAG))
        return self._sends[dst]

    def run(self, self_weight, outs, ins, shares, op):
        """One round: ``(x, w) = self_weight * (x, w) + sum_j shares[j] * (x_j, w_j)``; raises
        :class:`~mpigossip.failures.PeerFailure` (``(x, w)`` unchanged) if a peer failed."""
        owner = self.owner
        recvs = [self._recv(src, j) for j, src in enumerate(ins)]
        sends = [self._send(dst) for dst in outs]
        owner.buffer.synchronize()   # x written, no device work still reads the slots
        self._x.before_send()
        self._wsend[0] = owner.weight
        requests = [r for x, w, _ in recvs for r in (x, w)] + [r for pair in sends for r in pair]
        peers = [src for src in ins for _ in (0, 1)] + [dst for dst in outs for _ in (0, 1)]
        MPI.Prequest.Startall(requests)
        failures.wait(requests, comm=owner.comm, timeout=owner.timeout, op=f"{owner._name}.{op}",
                      peer=lambda pending: sorted({peers[i] for i in pending}))
        parts = []
        for slot in self._slots[:len(ins)]:
            slot.after_recv()
            parts.append(slot.buffer.array)
        owner.weight = self_weight * owner.weight + sum(s * float(w[0]) for s, (_, _, w) in zip(shares, recvs))
        owner._acquire()
        owner._combine(self_weight, parts, shares)
        owner._release()

    def abandon(self):
        """The communicator failed: keep its requests alive (never freed) and start afresh on
        the next one."""
        failures.keep(*[r for x, w, _ in self._recvs.values() for r in (x, w)],
                      *[r for pair in self._sends.values() for r in pair])
        self._recvs, self._sends = {}, {}

    def free(self):
        """Free the requests (no failure was met on this communicator)."""
        for r in [r for x, w, _ in self._recvs.values() for r in (x, w)] + [r for p in self._sends.values() for r in p]:
            r.Free()
        self._recvs, self._sends = {}, {}
