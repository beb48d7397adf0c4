"""PushSum's overlap mode (OSGP: ``start()`` ... ``finish()``): its one schedule of messages.

``start()`` at step k posts the receives of what each in-peer sends at k, splits this step's
share of ``(x, w)`` off into a send slot and sends it to every out-peer while the caller
computes; ``finish()`` adds whatever has arrived and waits only for messages sent ``max_delay``
or more steps ago. Slots are pooled: at most ``max_delay + 1`` sends in flight (``start()``
waits for the oldest), receive slots grown as needed. No background thread: progress comes
from the tests at step boundaries. A message's ``x`` and ``w`` are added together or not at all.

The requests come from the owner's request strategy (:mod:`mpigossip.core.requests`):
``Isend``/``Irecv`` with a tag per step by default; with ``on_failure="continue"``
:class:`~mpigossip.resilience.persistent.AlarmedRequests`: persistent requests per peer and slot
with one tag per kind (MPI matches two ranks' messages of one tag in the order they were sent,
and both sides go through the steps in order), ``x`` in pieces under the eager limit, and an
alarm every step tests, so that every survivor meets a failure within a step. What a recovery
salvages from the schedule (what arrived whole, what survivors sent each other) is
:mod:`mpigossip.resilience.overlap`'s.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..core import kernels
from ..core.base import step_tag
from ..resilience import failures

_FIXED = (3, 4)   # x's and w's tags on persistent requests (the synchronous step's are 0 and 1)


def tag(step: int, weight: bool = False) -> int:
    """A step's share (kind 0) and weight (kind 1): the package's one tag scheme."""
    return step_tag(step, 1 if weight else 0, 2)


def uniform(own: float, peers: dict) -> bool:
    """Whether a column gives its out-peers the same share it keeps (then the sender scales
    once, and every out-peer adds the message as it is)."""
    return all(v == own for v in peers.values())


class Received:
    """One expected message: ``(x, w)`` from ``src`` sent at ``step`` into receive slot ``slot``,
    scaled by ``factor`` when added (1 if the sender scaled it); ``ordinal``: how many messages
    from ``src`` this schedule expected before it."""

    __slots__ = ("step", "src", "slot", "factor", "message", "ordinal")

    def __init__(self, step: int, src: int, slot: int, factor: float, message: Any, ordinal: int) -> None:
        self.step, self.src, self.slot, self.factor, self.message, self.ordinal = \
            step, src, slot, factor, message, ordinal


class Sent:
    """One share in flight from send slot ``slot``: its requests per out-peer (``to``) and as one
    message (``message``, once every out-peer's have started)."""

    __slots__ = ("slot", "to", "message")

    def __init__(self, slot: int) -> None:
        self.slot = slot
        self.to: dict[int, list] = {}
        self.message: Any = None


class Overlap:
    """The overlap-mode messages of one :class:`~mpigossip.PushSum` (``owner``: its ``comm``,
    ``rank``, ``buffer``, ``weight``, ``topology``, ``max_delay``, ``_code``, ``_new_transport``,
    ``_acquire``, ``_release``, ``_combine``) on the request strategy ``requests``, from step
    ``first_step`` on.

    Attributes read by a recovery: ``pending`` (:class:`Received`, oldest first), ``sends``
    (:class:`Sent`, oldest first), ``sent`` (messages sent to each out-peer), ``posted`` and
    ``last_posted`` (receives posted for each in-peer, and the step of the last).
    """

    def __init__(self, owner: Any, requests: Any, first_step: int) -> None:
        self.owner, self.requests, self.first_step = owner, requests, first_step
        self._recv_slots: list[Any] = []   # (Transport, w buffer)
        self._recv_free: list[int] = []
        self._send_slots: list[Any] = []
        self._send_free: list[int] = []
        self.pending: list[Received] = []
        self.sends: list[Sent] = []
        self.sent: dict[int, int] = {}
        self.posted: dict[int, int] = {}
        self.last_posted: dict[int, int] = {}

    @property
    def in_flight(self) -> bool:
        return bool(self.pending or self.sends)

    # ------------------------------------------------------------------ slots and messages
    def _slot(self, slots: list, free: list) -> int:
        if free:
            return free.pop()
        slots.append((self.owner._new_transport(), np.zeros(1, dtype=np.float64)))
        return len(slots) - 1

    def _tags(self, step: int) -> tuple[int, int]:
        return _FIXED if self.requests.persistent else (tag(step), tag(step, True))

    def _pieces(self, transport: Any) -> list:
        limit = self.requests.limit
        return [transport.spec] if limit is None else failures.pieces(transport.spec, limit)

    def post(self, step: int, src: int) -> None:
        """Post the receive of what ``src`` sends at ``step``."""
        o, requests = self.owner, self.requests
        slot = self._slot(self._recv_slots, self._recv_free)
        x, w = self._recv_slots[slot]
        xtag, wtag = self._tags(step)
        reqs = [requests.irecv(o.comm, piece, src, xtag) for piece in self._pieces(x)]
        reqs.append(requests.irecv(o.comm, w, src, wtag))
        ordinal = self.posted.get(src, 0)
        self.pending.append(Received(step, src, slot, self._receive_factor(src, step), requests.message(reqs), ordinal))
        self.posted[src] = ordinal + 1
        self.last_posted[src] = step

    def _receive_factor(self, src: int, step: int) -> float:
        """How this rank scales what ``src`` sent at ``step``."""
        own, peers = self.owner.topology.mixing_weights(src, step)
        return 1.0 if self.owner._code is None and uniform(own, peers) else peers[self.owner.rank]

    def _split_off(self, send: Any, own: float, peers: dict, step: int) -> float:
        """Split this step's share of ``(x, w)`` into ``send`` (the caller holds the buffer);
        the weight the message carries. Uniform column: ``x = own x`` and ``send = own x``, every
        out-peer adds it as is; else ``send = x`` (encoded, with ``wire``) and each out-peer
        scales by its own share."""
        o = self.owner
        if o._code is not None:   # send = encoded x, x -= (1 - own) decoded: the rounding stays here
            o._code.encode(o.buffer.array, send, share=1.0 - own, salt=step)
            sent, o.weight = o.weight, o.weight * own
            return sent
        if uniform(own, peers):
            kernels.split_share(o.buffer.array, send, own)
            o.weight *= own
            return o.weight
        kernels.split_share(o.buffer.array, send, 1.0)
        kernels.scale(o.buffer.array, own)
        sent, o.weight = o.weight, o.weight * own
        return sent

    # ------------------------------------------------------------------ the step
    def start(self, step: int, op: str) -> None:
        """Post ``step``'s receives, then split off its share and send it (raises PeerFailure
        under a strategy that meets failures, with what had left ``(x, w)`` recorded)."""
        o, requests = self.owner, self.requests
        requests.watch(op)   # a failure known here is met before any share goes to the dead rank
        own, peers = o.topology.mixing_weights(o.rank, step)
        outs = sorted(peers)
        o.buffer.synchronize()   # no combine queued on the device still reads a slot MPI rewrites
        for src in o.topology.in_peers(o.rank, step):   # receives first, so early senders find them
            self.post(step, src)
        if not outs:
            return
        self._progress_sends(op)
        while len(self.sends) > o.max_delay + 1:   # bound memory: wait for the oldest send
            oldest = self.sends[0]
            requests.wait(oldest.message, f"{op} (send of step {step})", sorted(oldest.to))
            self._progress_sends(op)
        slot = self._slot(self._send_slots, self._send_free)
        send, wbuf = self._send_slots[slot]
        o.buffer.acquire()
        wbuf[0] = self._split_off(send.buffer.array, own, peers, step)
        o._release()
        send.before_send()   # the split (queued on our stream) has written the slot MPI reads
        sent = Sent(slot)
        self.sends.append(sent)   # the share has left (x, w): lost if it never arrives
        xtag, wtag = self._tags(step)
        for dst in outs:
            reqs = [requests.isend(o.comm, piece, dst, xtag) for piece in self._pieces(send)]
            reqs.append(requests.isend(o.comm, wbuf, dst, wtag))
            sent.to[dst] = reqs
            self.sent[dst] = self.sent.get(dst, 0) + 1
        sent.message = requests.message([r for dst in outs for r in sent.to[dst]])

    def _progress_sends(self, op: str) -> None:
        still = []
        for sent in self.sends:
            if self.requests.test(sent.message, op):
                self._send_free.append(sent.slot)
            else:
                still.append(sent)
        self.sends = still

    def finish(self, op: str, force_before: float) -> None:
        """Add every message that has arrived; wait for those sent at step ``force_before`` or
        before. A failure met meanwhile raises PeerFailure once what arrived before it is added."""
        requests = self.requests
        requests.watch(op)
        self._progress_sends(op)
        arrived = []
        try:
            for msg in self.pending:
                if msg.step <= force_before:
                    requests.wait(msg.message, f"{op} (message of step {msg.step})", [msg.src])
                if requests.test(msg.message, op):
                    arrived.append(msg)
        finally:
            self.add(arrived)

    def drain(self, op: str) -> None:
        """Wait for every message in flight to and from this rank and add what arrives."""
        self.finish(op, force_before=float("inf"))
        for sent in list(self.sends):
            self.requests.wait(sent.message, f"{op} (sends)", sorted(sent.to))
        self._progress_sends(op)

    def add(self, msgs: list[Received]) -> None:
        """Add arrived messages to ``(x, w)`` in one fused pass and free their slots."""
        if not msgs:
            return
        o = self.owner
        done = {id(m) for m in msgs}
        self.pending = [m for m in self.pending if id(m) not in done]
        parts = []
        for msg in msgs:
            x, w = self._recv_slots[msg.slot]
            x.after_recv()
            parts.append(x.buffer.array)
            o.weight += msg.factor * float(w[0])
        o._acquire()
        o._combine(1.0, parts, [msg.factor for msg in msgs])
        o._release()
        self._recv_free.extend(msg.slot for msg in msgs)

    def memory(self) -> list:
        """The slots the requests point at (kept alive with them after a failure)."""
        return [self._recv_slots, self._send_slots]
