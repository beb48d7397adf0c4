"""Asynchronous Gradient Push's messages on persistent requests, for ``on_failure="continue"``.

:class:`~mpigossip.decentralized.agp.AsyncPushSum` sends each out-peer's accumulated share (its weight
first, then ``x``) from one of two buffers it swaps, and receives a share into one of
``receives`` slots (posted ahead for the rank that owns it, or for the source a probe of its
weight named). With ``on_failure="continue"`` every one of those messages is a persistent
request (with Open MPI's ob1 a non-persistent request to a dead peer may end the job): made
once per out-peer, buffer and epoch's tags, or per slot, source and epoch's tags, and
started each time.

A failure is met in a step: an error completing a message to or from the dead rank, or the
*alarm*, a receive from any source posted on a duplicate of the communicator and tested at
every step, which fails on every survivor once ULFM knows of a failed rank or another
survivor has revoked the duplicate. The recovery (:meth:`AsyncSurvives._recover_async`):

1. the shares that had arrived whole are added, those accumulating for an out-peer (never
   sent) taken back;
2. the alarm's communicator is revoked (every survivor enters its recovery now) and shrunk:
   the survivors agree on who they are and tell each other how many messages each sent every
   other (in all, and before its last drain: the drains' tags);
3. on the communicator that failed, not revoked yet (ULFM lets live ranks go on talking
   there), each survivor receives and adds every message another survivor had sent it, and
   completes its own sends to survivors;
4. that communicator is revoked and shrunk (:meth:`~mpigossip.resilience.tolerant.Survives.
   _shrink_to_survivors`); training goes on over the survivors, each from its own step.

Only the dead rank's own mass and what was in flight to or from it is lost (counted in the
weight lost). Receives posted ahead for a survivor (a slot it owns) are cancelled first: one
that nothing had matched is dropped, one a share had begun to fill is completed.
"""

from mpi4py import MPI

from ..core import deadline
from . import failures


class AsyncRequests:
    """The persistent requests of one :class:`~mpigossip.decentralized.agp.AsyncPushSum` over its current
    communicator (``owner``: its ``comm``)."""

    def __init__(self, owner):
        self.owner = owner
        self._sends = {}   # (dst, id of the buffer, epoch parity) -> [w request, x's pieces...]
        self._recvs = {}   # (slot, its buffer, src, epoch's tags) -> [w request, x's pieces...]
        self._memory = []  # what the requests point at: kept with them after a failure
        self.alarm = None  # a failures.Alarm over the owner's communicator

    def arm(self):
        """Collective: the alarm over the owner's current communicator."""
        self.alarm = failures.Alarm(self.owner.comm, self.owner._name)

    def watch(self, op):
        """Raise :class:`~mpigossip.resilience.failures.PeerFailure` once a rank has failed or a survivor
        has sounded the alarm (:class:`~mpigossip.resilience.failures.Alarm`)."""
        if self.alarm is not None:
            self.alarm.watch(op)

    def sends(self, out, tags):
        """The requests sending ``out``'s buffer ``out.sending`` (its weight in ``out.wsend``)."""
        key = (out.dst, id(out.sending), tags)
        if key not in self._sends:
            xtag, wtag = tags
            comm = self.owner.comm
            self._sends[key] = [comm.Send_init(out.wsend, dest=out.dst, tag=wtag),
                                *failures.send_init(comm, out.sending.spec, out.dst, xtag)]
            self._memory.append(out)
        return self._sends[key]

    def recv(self, index, slot, src, tags):
        """The requests receiving a share from ``src`` into receive slot ``index``: its weight
        into ``slot.wbuf``, then ``x``'s pieces."""
        key = (index, id(slot.transport), src, tags)   # (a slot's buffer may be replaced: _receive_from_survivors)
        if key not in self._recvs:
            xtag, wtag = tags
            comm = self.owner.comm
            self._recvs[key] = [comm.Recv_init(slot.wbuf, source=src, tag=wtag),
                                *failures.recv_init(comm, slot.transport.spec, src, xtag)]
            self._memory.append(slot)
        return self._recvs[key]

    def _all(self):
        return [r for reqs in [*self._sends.values(), *self._recvs.values()] for r in reqs]

    def abandon(self):
        """The communicator failed: keep its requests and their memory alive; start afresh
        (:meth:`arm` again once the owner has its new communicator)."""
        failures.keep(*self._all(), self._memory)
        if self.alarm is not None:
            self.alarm.keep()
        self.__init__(self.owner)

    def free(self):
        """Free the requests (no failure was met on this communicator; nothing in flight)."""
        for r in self._all():
            r.Free()
        if self.alarm is not None:
            self.alarm.free()
        self.__init__(self.owner)


class AsyncSurvives:
    """Mix-in of :class:`~mpigossip.decentralized.agp.AsyncPushSum`: its steps and drain under
    ``on_failure="continue"`` (``_exchange`` an :class:`AsyncRequests`, else None)."""

    def _test(self, message):
        """Whether ``message`` (a :class:`~mpigossip.resilience.failures.Message`) has completed
        (``on_failure="continue"``: a failed peer or a revoked communicator raises
        :class:`~mpigossip.resilience.failures.PeerFailure`, and the message's outcome is kept)."""
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
        """A peer failed (or another survivor sounded the alarm): add the shares that had
        arrived whole and take back those still accumulating; agree with the other survivors on
        who they are and what each sent the others; receive what survivors sent this rank and
        complete what it sent them; then shrink to the survivors and go on from this rank's own
        step (see the module)."""
        arrived = [slot for slot in self._slots if slot.message is not None and slot.message.succeeded()]
        if arrived:
            self._add(arrived)
        self._take_back()
        op = f"{self._name} (failure at step {self.steps})"
        counts = {"epoch": self.epoch, "sent": {o.dst: (o.sent, o.sent_at_drain) for o in self._outs.values()}}
        self._exchange.alarm.quiesce(self.steps, counts, lambda shared, gone: self._receive_from_survivors(
            shared, gone, op), timeout=self.timeout, op=op)
        self._shrink_to_survivors(self.steps)   # then revoke
        self._reset_messages()
        self._exchange.arm()

    def _receive_from_survivors(self, shared, gone, op):
        """Receive and add every message the survivors sent this rank (``shared``: what each
        survivor told, by rank), and complete this rank's sends to them, on the communicator
        that failed (not revoked)."""
        me = self.rank
        todo = {}  # src -> [messages left with this epoch's tags, with the next epoch's]
        for src, info in shared.items():
            if src == me:
                continue
            total, at_drain = info["sent"].get(me, (0, 0))
            got = int(self.received[src])
            if info["epoch"] == self.epoch + 1:   # it has left the drain this rank is still in
                todo[src] = [max(0, at_drain - got), total - max(at_drain, got)]
            else:
                todo[src] = [max(0, total - got), 0]
        for index, slot in enumerate(self._slots):
            slot.owned = False     # from now on a slot is posted only for a share known to come
            if slot.message is None:
                slot.src = None
            elif slot.src not in todo:   # from the dead rank, and not arrived whole: lost (a fresh buffer)
                self._slots[index] = type(slot)(self._new_transport())
            else:   # posted for a survivor: cancelled if nothing of a share came; else one of those to come
                cancelled = slot.message.cancel(op, comm=self.comm, timeout=self.timeout)
                if len(cancelled) == len(slot.message.requests):
                    slot.src, slot.message = None, None
                else:
                    slot.message.restart(cancelled)
                    todo[slot.src][0] -= 1
        outs = [o for o in self._outs.values() if o.message is not None and o.dst not in gone]
        for o in self._outs.values():
            if o.dst in gone:
                o.message = None
        status = MPI.Status()

        def progress():
            for o in outs:
                if o.message is not None and o.message.test(op):
                    o.message = None
            done = [s for s in self._slots if s.message is not None and s.message.test(op)]
            if done:
                self._add(done)
            for index, slot in enumerate(self._slots):
                if slot.src is not None:
                    continue
                src, nxt = next(((s, left[0] == 0) for s, left in todo.items() if left[0] or left[1]), (None, 0))
                if src is None:
                    break
                tags = self._tags(self.epoch + nxt)
                if not self.comm.Iprobe(source=src, tag=tags[1], status=status):
                    break
                self._post(index, slot, src, tags, ahead=False)
                todo[src][nxt] -= 1
            return (not any(o.message is not None for o in outs) and not any(s.src is not None for s in self._slots)
                    and not any(left[0] or left[1] for left in todo.values()))

        with failures.raised_as_failure(op):
            deadline.wait_until(progress, comm=self.comm, timeout=self.timeout, op=f"{op} (the survivors' messages)",
                                peer=lambda: sorted({s for s, left in todo.items() if left[0] or left[1]}
                                                    | {s.src for s in self._slots if s.src is not None}
                                                    | {o.dst for o in outs if o.message is not None}))
