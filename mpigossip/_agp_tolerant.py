"""Asynchronous Gradient Push's messages on persistent requests, for ``on_failure="continue"``.

:class:`~mpigossip.agp.AsyncPushSum` sends each out-peer's accumulated share (its weight
first, then ``x``) from one of two buffers it swaps, and receives a share from the source a
probe of its weight named, into one of ``receives`` slots. With ``on_failure="continue"``
every one of those messages is a persistent request (with Open MPI's ob1 a non-persistent
request to a dead peer may end the job): made once per out-peer, buffer and epoch's tags, or
per slot, source and epoch's tags, and started each time. A failure met in a step (an error
completing one of them, or a probe or start on a communicator another survivor revoked)
goes to :meth:`AsyncSurvives._recover_async`: the shares that had arrived whole are added,
those accumulating for an out-peer (never sent) taken back, the rest in flight is lost
(counted in the weight lost), the requests are kept alive, never freed, and the ranks go on
over the survivors. No rank waits for another in a step, so none is made to skip steps: each
keeps its own count.

The weight (8 bytes) is received with a blocking ``MPI_Recv`` once probed (it has arrived);
the share after it on a persistent request.
"""

from . import failures


class AsyncRequests:
    """The persistent requests of one :class:`~mpigossip.agp.AsyncPushSum` over its current
    communicator (``owner``: its ``comm``)."""

    def __init__(self, owner):
        self.owner = owner
        self._sends = {}   # (dst, id of the buffer, epoch parity) -> [w request, x request]
        self._recvs = {}   # (slot, src, epoch parity) -> x request
        self._memory = []  # what the requests point at: kept with them after a failure

    def sends(self, out, tags):
        """The requests sending ``out``'s buffer ``out.sending`` (its weight in ``out.wsend``)."""
        key = (out.dst, id(out.sending), tags)
        if key not in self._sends:
            xtag, wtag = tags
            comm = self.owner.comm
            self._sends[key] = [comm.Send_init(out.wsend, dest=out.dst, tag=wtag),
                                comm.Send_init(out.sending.spec, dest=out.dst, tag=xtag)]
            self._memory.append(out)
        return self._sends[key]

    def recv(self, index, slot, src, xtag):
        """The request receiving a share from ``src`` into receive slot ``index``."""
        key = (index, src, xtag)
        if key not in self._recvs:
            self._recvs[key] = self.owner.comm.Recv_init(slot.transport.spec, source=src, tag=xtag)
            self._memory.append(slot)
        return self._recvs[key]

    def _all(self):
        return [r for pair in self._sends.values() for r in pair] + list(self._recvs.values())

    def abandon(self):
        """The communicator failed: keep its requests and their memory alive; start afresh."""
        failures.keep(*self._all(), self._memory)
        self.__init__(self.owner)

    def free(self):
        """Free the requests (no failure was met on this communicator; nothing in flight)."""
        for r in self._all():
            r.Free()
        self.__init__(self.owner)


class AsyncSurvives:
    """Mix-in of :class:`~mpigossip.agp.AsyncPushSum`: its steps and drain under
    ``on_failure="continue"`` (``_exchange`` an :class:`AsyncRequests`, else None)."""

    def _test(self, message):
        """Whether ``message`` (a :class:`~mpigossip.failures.Message`) has completed
        (``on_failure="continue"``: a failed peer or a revoked communicator raises
        :class:`~mpigossip.failures.PeerFailure`, and the message's outcome is kept)."""
        return message.test(f"{self._name} (step {self.steps})")

    def _surviving(self, run):
        """``run()``; with ``on_failure="continue"`` a failure met in it is recovered from
        (:meth:`_recover_async`). Returns whether one was."""
        if self._exchange is None:
            run()
            return False
        try:
            run()
        except failures.PeerFailure:
            self._recover_async()
            return True
        return False

    def _recover_async(self):
        """A peer failed (or another survivor revoked the communicator): add the shares that
        had arrived whole and take back those still accumulating, drop the rest in flight,
        shrink to the survivors and go on from this rank's own step."""
        arrived = [slot for slot in self._slots if slot.src is not None and slot.message.arrived()]
        if arrived:
            self._add(arrived)
        self._take_back()
        self._shrink_to_survivors(self.steps)
        self._reset_messages()
