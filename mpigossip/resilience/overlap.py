"""PushSum's overlap mode (OSGP: ``start()``/``finish()``) on persistent requests, for
``on_failure="continue"``.

The same messages as the overlap mode of :class:`mpigossip.PushSum` (this step's share of
``(x, w)`` split off into a send slot and sent while the caller computes; what has arrived
added at ``finish()``, waiting only for messages ``max_delay`` steps old), with what the
failure path needs (:mod:`mpigossip.resilience.failures`): every message is a persistent request, made
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

from ..core import buffers, deadline
from . import failures

_X_TAG, _W_TAG = 3, 4


class PersistentOverlap:
    """The overlap-mode messages of one :class:`~mpigossip.PushSum` over its current
    communicator (``owner``: its ``comm``, ``buffer``, ``weight``, ``timeout``, ``max_delay``,
    ``_name``, ``_stage``, ``_cuda_aware``, ``_combine``, ``_acquire``, ``_release``,
    ``_split_off``, ``_receive_factor``)."""

    def __init__(self, owner, first_step):
        """Collective (the alarm's duplicate communicator); ``first_step``: the step of the
        first ``start()`` over this communicator (the same on every rank)."""
        self.owner = owner
        self._recv_slots, self._recv_free = [], []   # receive Transports and their weight buffers
        self._send_slots, self._send_free = [], []
        self._recv_reqs, self._send_reqs = {}, {}    # (peer, slot) -> [x's pieces..., w request]
        self.pending = []   # [step, src, slot, factor, failures.Message, ordinal], oldest first
        self.sends = []     # [slot, failures.Message, dsts], oldest first
        self.first_step = first_step
        self.sent = {}      # dst -> messages sent to it over this communicator
        self.posted = {}    # src -> receives posted for it over this communicator
        self.last_posted = {}   # src -> the step of the last of them
        self.alarm = failures.Alarm(owner.comm, owner._name)

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
            self._recv_reqs[key] = [*failures.recv_init(comm, x.spec, src, _X_TAG),
                                    comm.Recv_init(w, source=src, tag=_W_TAG)]
        return self._recv_reqs[key]

    def _send(self, dst, slot):
        key = (dst, slot)
        if key not in self._send_reqs:
            x, w = self._send_slots[slot]
            comm = self.owner.comm
            self._send_reqs[key] = [*failures.send_init(comm, x.spec, dst, _X_TAG),
                                    comm.Send_init(w, dest=dst, tag=_W_TAG)]
        return self._send_reqs[key]

    # ------------------------------------------------------------------ the step
    def start(self, k, self_weight, outs, ins, uniform, op):
        """Post this step's receives, then split off its share into a send slot and send it
        (at most ``max_delay + 1`` sends in flight: wait for the oldest). Raises
        :class:`~mpigossip.resilience.failures.PeerFailure`."""
        o = self.owner
        self.alarm.watch(op)     # a failure known here is met before any share goes to the dead rank
        o.buffer.synchronize()   # no combine queued on the device still reads a slot MPI rewrites
        with failures.raised_as_failure(op):
            for src in ins:
                self._post(k, src)
        if not outs:
            return
        self.progress_sends(op)
        while len(self.sends) > o.max_delay + 1:
            _, reqs, dsts = self.sends[0]
            failures.wait(reqs, comm=o.comm, timeout=o.timeout, op=f"{op} (send of step {k})",
                          peer=lambda pending, dsts=dsts: dsts, alarm=self.alarm)
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
        for dst in outs:
            self.sent[dst] = self.sent.get(dst, 0) + 1
        with failures.raised_as_failure(op):
            message.start()

    def _post(self, k, src):
        """Post the receive of what ``src`` sent at step k."""
        slot = self._slot(self._recv_slots, self._recv_free)
        message = failures.Message(self._recv(src, slot))
        message.start()
        ordinal = self.posted.get(src, 0)   # src's messages here, over this communicator, in order
        self.pending.append([k, src, slot, self.owner._receive_factor(src, k), message, ordinal])
        self.posted[src] = ordinal + 1
        self.last_posted[src] = k

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
        before. Raises :class:`~mpigossip.resilience.failures.PeerFailure` (what arrived before it is
        added)."""
        o = self.owner
        self.alarm.watch(op)
        self.progress_sends(op)
        arrived, still = [], []
        try:
            for msg in self.pending:
                step, src, _, _, reqs, _ = msg
                if step <= force_before:
                    failures.wait(reqs, comm=o.comm, timeout=o.timeout, op=f"{op} (message of step {step})",
                                  peer=lambda pending, src=src: [src], alarm=self.alarm)
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
                          peer=lambda pending, dsts=dsts: dsts, alarm=self.alarm)
        self.progress_sends(op)

    def _add(self, msgs):
        if not msgs:
            return
        o = self.owner
        parts = []
        for _, _, slot, factor, _, _ in msgs:
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
        arrived = [msg for msg in self.pending if msg[4].succeeded()]
        done = {id(m) for m in arrived}
        self.pending = [m for m in self.pending if id(m) not in done]
        self._add(arrived)

    def quiesce(self, step, op):
        """After a failure, before the communicator is revoked (every survivor calls it): sound
        the alarm, agree with the other survivors on who they are and how many messages each
        sent every other over this communicator, then receive and add what survivors sent this
        rank and complete what it sent them. Only what was in flight to or from the dead ranks
        is lost. A further failure meanwhile loses what the newly dead had in flight too."""
        share = {"first": self.first_step, "sent": dict(self.sent)}
        self.alarm.quiesce(step, share, lambda shared, gone: self._receive_from_survivors(shared, gone, op),
                           timeout=self.owner.timeout, op=op)

    def _receive_from_survivors(self, shared, gone, op):
        """Post the receives of what each survivor sent this rank over this communicator and no
        receive awaits yet (it is ahead), then receive and add them all; complete this rank's
        sends to survivors."""
        o = self.owner
        me = o.rank
        # from the dead: lost; from a survivor, a receive for a share it never sent (it met the
        # failure first): dropped (its request stays posted on the communicator that failed)
        self.pending = [m for m in self.pending if m[1] not in gone and m[5] < shared[m[1]]["sent"].get(me, 0)]
        for src, info in shared.items():
            if src == me:
                continue
            # src's j-th message here went at the j-th step from first_step at which this rank was
            # its out-peer; the receives posted so far are the first `posted` of them
            count, last = self.posted.get(src, 0), self.last_posted.get(src)
            step = info["first"] if last is None else last + 1
            while count < info["sent"].get(me, 0):
                if me in o.topology.mixing_weights(src, step)[1]:
                    with failures.raised_as_failure(op):
                        self._post(step, src)
                    count += 1
                step += 1
        sends = []
        for _, message, dsts in self.sends:   # the requests to survivors (per out-peer: x's pieces, w)
            each = len(message.requests) // len(dsts)
            sends += [r for i, dst in enumerate(dsts) if dst not in gone
                      for r in message.requests[each * i:each * (i + 1)]]
        sends = failures.Message(sends)

        def progress():
            arrived = [m for m in self.pending if m[4].test(op)]
            if arrived:
                done = {id(m) for m in arrived}
                self.pending = [m for m in self.pending if id(m) not in done]
                self._add(arrived)
            return sends.test(op) and not self.pending

        deadline.wait_until(progress, comm=o.comm, timeout=o.timeout, op=f"{op} (the survivors' messages)",
                            peer=lambda: sorted({m[1] for m in self.pending}))
        self.sends = []

    def abandon(self):
        """The communicator failed: what is in flight is lost; keep its requests (and the
        memory they point at) alive, never freed."""
        failures.keep(*[r for reqs in self._recv_reqs.values() for r in reqs],
                      *[r for reqs in self._send_reqs.values() for r in reqs],
                      self._recv_slots, self._send_slots)
        self.alarm.keep()

    def free(self):
        """Free the requests (no failure was met on this communicator; nothing in flight)."""
        for r in [r for reqs in self._recv_reqs.values() for r in reqs] + \
                 [r for reqs in self._send_reqs.values() for r in reqs]:
            r.Free()
        self._recv_reqs, self._send_reqs = {}, {}
        self.alarm.free()
