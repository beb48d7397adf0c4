"""PushSum's overlap mode (OSGP: ``start()``/``finish()``) on persistent requests, for
``on_failure="continue"``.

The same messages as the overlap mode of :class:`mpigossip.PushSum` (this step's share of
``(x, w)`` split off into a send slot and sent while the caller computes; what has arrived
added at ``finish()``, waiting only for messages ``max_delay`` steps old), with what the
failure path needs (:mod:`mpigossip.failures`): every message is a persistent request, made
once per peer and slot and started each time (a non-persistent request to a dead peer may end
the job with Open MPI's ob1), and a message's ``x`` and ``w`` are added together or not at
all, so that ``z = x / w`` stays a weighted average of what the ranks held.

What is in flight when a peer fails is lost: the shares this rank split off and sent (its
``(x, w)`` no longer hold them) and those sent to it and not yet added. Both are in the
weight the recovery reports lost (:meth:`mpigossip.PushSum._lost_mass`). Messages keep one
tag per kind: MPI matches the messages between two ranks in the order they were sent, and
both sides go through the steps in order.
"""

import numpy as np

from . import buffers, failures

_X_TAG, _W_TAG = 3, 4


class PersistentOverlap:
    """The overlap-mode messages of one :class:`~mpigossip.PushSum` over its current
    communicator (``owner``: its ``comm``, ``buffer``, ``weight``, ``timeout``, ``max_delay``,
    ``_name``, ``_stage``, ``_cuda_aware``, ``_combine``, ``_acquire``, ``_release``,
    ``_split_off``, ``_receive_factor``)."""

    def __init__(self, owner):
        self.owner = owner
        self._recv_slots, self._recv_free = [], []   # receive Transports and their weight buffers
        self._send_slots, self._send_free = [], []
        self._recv_reqs, self._send_reqs = {}, {}    # (peer, slot) -> [x request, w request]
        self.pending = []   # [step, src, slot, factor, failures.Message], oldest first
        self.sends = []     # [slot, failures.Message, dsts], oldest first

    # ------------------------------------------------------------------ slots and requests
    def _transport(self):
        o = self.owner
        return buffers.Transport(buffers.scratch(o.buffer), stage=o._stage, cuda_aware=o._cuda_aware)

    def _slot(self, slots, free):
        if free:
            return free.pop()
        slots.append((self._transport(), np.zeros(1, dtype=np.float64)))
        return len(slots) - 1

    def _recv(self, src, slot):
        key = (src, slot)
        if key not in self._recv_reqs:
            x, w = self._recv_slots[slot]
            comm = self.owner.comm
            self._recv_reqs[key] = [comm.Recv_init(x.spec, source=src, tag=_X_TAG),
                                    comm.Recv_init(w, source=src, tag=_W_TAG)]
        return self._recv_reqs[key]

    def _send(self, dst, slot):
        key = (dst, slot)
        if key not in self._send_reqs:
            x, w = self._send_slots[slot]
            comm = self.owner.comm
            self._send_reqs[key] = [comm.Send_init(x.spec, dest=dst, tag=_X_TAG),
                                    comm.Send_init(w, dest=dst, tag=_W_TAG)]
        return self._send_reqs[key]

    # ------------------------------------------------------------------ the step
    def start(self, k, self_weight, outs, ins, uniform, op):
        """Post this step's receives, then split off its share into a send slot and send it
        (at most ``max_delay + 1`` sends in flight: wait for the oldest). Raises
        :class:`~mpigossip.failures.PeerFailure`."""
        o = self.owner
        o.buffer.synchronize()   # no combine queued on the device still reads a slot MPI rewrites
        posted = []
        with failures.raised_as_failure(op):
            for src in ins:
                slot = self._slot(self._recv_slots, self._recv_free)
                message = failures.Message(self._recv(src, slot))
                message.start()
                posted.append([k, src, slot, o._receive_factor(src, k), message])
        self.pending += posted
        if not outs:
            return
        self.progress_sends(op)
        while len(self.sends) > o.max_delay + 1:
            _, reqs, dsts = self.sends[0]
            failures.wait(reqs, comm=o.comm, timeout=o.timeout, op=f"{op} (send of step {k})",
                          peer=lambda pending, dsts=dsts: dsts)
            self.progress_sends(op)
        slot = self._slot(self._send_slots, self._send_free)
        send, wbuf = self._send_slots[slot]
        o.buffer.acquire()
        wbuf[0] = o._split_off(send.buffer.array, self_weight, uniform)
        o._release()
        o.buffer.synchronize()   # the split has written the slot MPI reads
        send.before_send()
        message = failures.Message([r for dst in outs for r in self._send(dst, slot)])
        self.sends.append([slot, message, list(outs)])   # the share has left (x, w): lost if it never arrives
        with failures.raised_as_failure(op):
            message.start()

    def progress_sends(self, op):
        still = []
        for entry in self.sends:
            if entry[1].test(op):
                self._send_free.append(entry[0])
            else:
                still.append(entry)
        self.sends = still

    def finish(self, op, force_before):
        """Add every message that has arrived; wait for those sent at step ``force_before`` or
        before. Raises :class:`~mpigossip.failures.PeerFailure` (what arrived before it is
        added)."""
        o = self.owner
        self.progress_sends(op)
        arrived, still = [], []
        try:
            for msg in self.pending:
                step, src, _, _, reqs = msg
                if step <= force_before:
                    failures.wait(reqs, comm=o.comm, timeout=o.timeout, op=f"{op} (message of step {step})",
                                  peer=lambda pending, src=src: [src])
                (arrived if reqs.test(op) else still).append(msg)
        finally:
            done = {id(m) for m in arrived}
            self.pending = [m for m in self.pending if id(m) not in done]
            self._add(arrived)

    def drain(self, op):
        """Wait for every message in flight to and from this rank and add what arrives."""
        self.finish(op, force_before=float("inf"))
        o = self.owner
        for _, reqs, dsts in list(self.sends):
            failures.wait(reqs, comm=o.comm, timeout=o.timeout, op=f"{op} (sends)",
                          peer=lambda pending, dsts=dsts: dsts)
        self.progress_sends(op)

    def _add(self, msgs):
        if not msgs:
            return
        o = self.owner
        parts = []
        for _, _, slot, factor, _ in msgs:
            x, w = self._recv_slots[slot]
            x.after_recv()
            parts.append(x.buffer.array)
            o.weight += factor * float(w[0])
        o._acquire()
        o._combine(1.0, parts, [m[3] for m in msgs])
        o._release()
        self._recv_free.extend(m[2] for m in msgs)

    @property
    def in_flight(self):
        return bool(self.pending or self.sends)

    # ------------------------------------------------------------------ after a failure
    def salvage(self):
        """Add the messages that had arrived whole before the failure (the rest is lost)."""
        arrived = [msg for msg in self.pending if msg[4].arrived()]
        done = {id(m) for m in arrived}
        self.pending = [m for m in self.pending if id(m) not in done]
        self._add(arrived)

    def abandon(self):
        """The communicator failed: what is in flight is lost; keep its requests (and the
        memory they point at) alive, never freed, and start afresh on the next one."""
        failures.keep(*[r for reqs in self._recv_reqs.values() for r in reqs],
                      *[r for reqs in self._send_reqs.values() for r in reqs],
                      self._recv_slots, self._send_slots)
        self.__init__(self.owner)

    def free(self):
        """Free the requests (no failure was met on this communicator; nothing in flight)."""
        for r in [r for reqs in self._recv_reqs.values() for r in reqs] + \
                 [r for reqs in self._send_reqs.values() for r in reqs]:
            r.Free()
        self._recv_reqs, self._send_reqs = {}, {}
