"""Asynchronous Gradient Push (Assran & Rabbat, "Asynchronous gradient push", IEEE TAC 2021):
PushSum in which no rank ever waits for another.

``AsyncPushSum(x, comm=...)`` (or its spelling ``PushSum(x, comm=..., max_delay=None)``). Each
rank advances its own step counter and takes its out-peers from the topology at that step;
ranks may be any number of steps apart. A sibling of :class:`~mpigossip.PushSum` over
:class:`~mpigossip.decentralized.pushsum_base.PushSumBase`, not a subclass: PushSum's ranks step in
lockstep, these never wait.

* ``start()`` splits off each out-peer's share of ``(x, w)`` (the column of the topology's
  mixing matrix at this rank's step) and adds it into that peer's *accumulating* buffer. A
  peer whose previous message has left gets the accumulated shares sent at once; one whose
  previous message is still in flight keeps accumulating (PushSum is linear, so adding
  shares loses no mass). Memory: at most one in-flight and one accumulating buffer per
  out-peer, whatever the delays.
* ``finish()`` adds every ``(x, w)`` share that has arrived, from anyone, and never blocks.
  A share is two messages from its sender, its weight then ``x``, received into one of
  ``receives`` full-size slots. The senders' steps are not this rank's, so who sends next is
  not known: the first share from a rank is found by probing its weight; from then on that
  rank owns a slot (while slots last, one is always kept for the others), whose receives of
  the weight and of ``x`` are posted again as soon as a share has been added: the next share
  lands in its buffer, not in MPI's queue of unexpected messages (a copy, and MPI memory of
  a model's size per message). A drain frees the slots (the next epoch has other tags).
* ``drain()`` (collective) sends what is accumulating, agrees with every rank on how many
  messages each pair exchanged, and receives the rest: afterwards Σx and Σw over ranks hold
  all the mass, exactly, even when the ranks ran different numbers of steps. Training may go
  on at once, with no collective in between: the messages sent between two drains carry
  that *epoch*'s tags (two alternate), so a rank that has left its drain and sends the next
  shares neither counts in nor waits on a peer still draining; those messages wait in MPI
  until the peer polls the new epoch's tags.

A rank's weight halves with each share it splits off and grows only with what it receives: a
rank that steps many times while nothing arrives (its in-peers' messages still on the wire, or
its peers waiting in a collective) would drive ``w`` towards zero geometrically, below
float64's range within about a thousand steps and far sooner for ``x = w z`` in float32. A rank
whose weight is below ``min_weight`` times its initial weight therefore keeps this step's
shares (sends nothing new; what accumulates still goes out as links free up) until what it
receives lifts it again: ``w`` never falls below ``min_weight`` times the smallest share a rank
keeps, Σx and Σw stay exact, and the column of the mixing matrix is the identity for that
step (still column stochastic). :attr:`held` counts those steps. Setting :attr:`holding` keeps
a rank's shares the same way whatever its weight (a donor healing a newcomer beside training
leaves its link to the newcomer's state: ``mpigossip.train.handover``).

What it does not guarantee: a rank that stops calling ``start()``/``finish()`` stops mixing,
and messages to or from it wait (its in-flight sends and the shares sent to it stay in MPI
until it calls again, or ``drain()``); the consensus error then depends on how far apart
the ranks run. Progress comes from ``Test`` calls in ``start()`` and ``finish()``; there is
no background thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from mpi4py import MPI

from ..core import deadline, kernels
from ..core.checks import integer_error
from ..resilience import failures
from ..resilience.agp_tolerant import AsyncRequests, AsyncSurvives
from .agp_leave import NOTICE, AsyncLeave
from .pushsum_base import PushSumBase

if TYPE_CHECKING:
    from ..core.hints import Buffer
    from ..topology import Topology


def _fraction_error(value, name):
    """The problem with a fraction argument in ``[0, 1)``, or None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        return f"{name} must be a number in [0, 1), got {value!r}"
    return None


def _tags(epoch):
    """(x tag, w tag) of the messages sent between drain ``epoch - 1`` and drain ``epoch``:
    two epochs alternate (a rank can be at most one drain ahead of a peer that receives)."""
    return (1, 2) if epoch % 2 == 0 else (3, 4)


class _Out:
    """One out-peer: the message in flight to it and the shares accumulating for it."""

    __slots__ = ("dst", "sending", "message", "wsend", "accumulating", "waccum", "filled", "sent", "sent_at_drain")

    def __init__(self, dst: Any, new_transport: Any) -> None:
        self.dst = dst
        self.sending, self.accumulating = new_transport(), new_transport()
        self.message = None  # the failures.Message in flight (its weight, then x), until it has left
        self.wsend = np.zeros(1, dtype=np.float64)
        self.waccum = 0.0
        self.filled = False  # whether ``accumulating`` holds shares not yet sent
        self.sent = 0        # messages sent to dst (compared by drain)
        self.sent_at_drain = 0  # of them, those sent before the last drain (the earlier epoch's tags)


class _Slot:
    """One receive buffer: free (``src`` None), or with the receives of one share from ``src``
    posted (``message``: its weight into ``wbuf``, then ``x``; a
    :class:`~mpigossip.resilience.failures.Message`). An ``owned`` slot is posted again for ``src`` as
    soon as its share has been added."""

    __slots__ = ("transport", "wbuf", "message", "src", "owned", "ahead")

    def __init__(self, transport: Any) -> None:
        self.transport, self.wbuf = transport, np.zeros(1, dtype=np.float64)
        self.message, self.src, self.owned = None, None, False
        self.ahead = False  # posted before its share was probed (counted in ``preposted``)


def _default_receives(topology, rank):
    """One slot per in-peer of ``rank`` over the topology's period (its first 64 steps), and
    one for the others; at most 5 (a model's size each); 2 for an aperiodic topology."""
    period = topology.period
    if not period or topology.size < 2:
        return 2
    peers = set()
    for k in range(min(period, 64)):
        peers.update(topology.in_peers(rank, k))
    return min(len(peers), 4) + 1


class AsyncPushSum(AsyncLeave, AsyncSurvives, PushSumBase):
    """PushSum that never waits.

    Args:
        x: the numerator (numpy/cupy/torch, contiguous, same length and dtype on every
            rank); updated in place.
        comm: communicator (keyword-only).
        topology: a :mod:`mpigossip.topology` graph; default ``ExponentialGraph(peers=1)``.
        weight: initial PushSum weight (1.0).
        timeout: seconds any wait (``drain()``) may take before the job is aborted.
        cuda_aware, stage: see :class:`mpigossip.core.buffers.Transport`.
        receives: receive slots, each a buffer of x's size (default: one per in-peer of the
            topology over its period and one more, at most 5; 2 for an aperiodic topology). All
            but one are owned by the first ranks heard from and posted ahead for their next
            share; ``receives=1`` posts each receive only once its weight has been probed.
        min_weight: a rank whose weight is below ``min_weight`` times its initial ``weight``
            keeps its shares until it receives (default ``2**-10``; in ``[0, 1)``; 0 turns the
            floor off): the weight stays bounded away from underflow, and so does ``x = w z``.
        z, wire: accepted as ``None`` only (for the ``PushSum(max_delay=None)`` spelling):
            call :meth:`debiased` for ``x / w``; shares travel in the buffer's own dtype.
        on_failure: ``"abort"`` or ``"continue"``: the survivors of a failed rank go on
            (launched with ULFM; :mod:`mpigossip.resilience.agp_tolerant`): the shares in flight at the
            failure are lost with the dead rank's mass, counted in :attr:`failures`'
            ``weight_lost``; each survivor keeps its own step count. Not with ``join()``.

    ``step()`` is ``start()`` then ``finish()``.
    """

    _name = "AsyncPushSum"
    _tags = staticmethod(_tags)

    def __init__(self, x: Buffer, *, comm: MPI.Intracomm, topology: Topology | None = None, weight: float = 1.0,
                 timeout: float | None = None, cuda_aware: bool | None = None, stage: bool | None = None,
                 receives: int | None = None, min_weight: float = 2.0 ** -10, z: Buffer | None = None,
                 wire: str | None = None, on_failure: str = "abort") -> None:
        if z is not None:
            raise ValueError("AsyncPushSum (PushSum(max_delay=None)) takes no z: call debiased()")
        if wire is not None:
            raise ValueError("AsyncPushSum (PushSum(max_delay=None)) sends the buffer's own dtype: "
                             "wire formats need PushSum with max_delay >= 0")
        super().__init__(x, comm=comm, topology=topology, weight=weight, timeout=timeout, cuda_aware=cuda_aware,
                         stage=stage, slots=1,
                         check=lambda: ((receives is not None and integer_error(receives, "receives", 1))
                                        or _fraction_error(min_weight, "min_weight")
                                        or failures.check_on_failure(on_failure)),
                         same={"receives": receives, "on_failure": on_failure})
        self._tolerate(on_failure, lambda: AsyncRequests(self))
        if self._exchange is not None:  # the alarm, and Σw now, against which a failure's loss is reported
            self._exchange.arm()
            self._total_weight = deadline.allreduce(self.comm, self.weight, timeout=self.timeout,
                                                    op=f"{self._name} (total weight)")
        self._outs = {}                                   # dst -> _Out, made on first use
        if receives is None:
            receives = _default_receives(self.topology, self.rank)
        self._slots = [_Slot(self._new_transport()) for _ in range(receives)]
        self.received = np.zeros(self.size, dtype=np.int64)  # messages received, per source
        self.preposted = 0  # of them, those received by a receive posted before they were probed
        self.epoch = 0  # drains completed: the tags of the messages sent now (_tags)
        self._gone = set()     # ranks whose leave() notice arrived (until the drain that drops them)
        self._leaving = False
        self._floor = float(min_weight) * self.weight  # below it, a rank keeps its shares (held)
        self.held = 0  # steps whose shares this rank kept, its weight being below the floor
        self.holding = False  # while true, this rank keeps its shares (sends nothing new) whatever its weight

    # ------------------------------------------------------------------ receives
    def _poll(self):
        """Add every arrived share into ``(x, w)`` and post the receives of the next ones.
        Never blocks.

        Owned slots are posted again for their rank at once. A share from a rank with no
        receive posted is found by probing its weight from any source; a free slot is then
        posted for it (and owned by it while more than one slot is left). Per source and
        tag, MPI matches messages in the order the receives were posted, so the k-th share
        of a sender is paired with its k-th weight."""
        if self._members is not None:
            self._notices()
        if self._exchange is not None:
            self._exchange.watch(f"{self._name} (step {self.steps})")
        done = [s for s in self._slots if s.message is not None and self._test(s.message)]
        if done:
            self._add(done)
        tags = _tags(self.epoch)
        status = MPI.Status()
        with failures.raised_as_failure(f"{self._name} (receive)"):
            for index, slot in enumerate(self._slots):
                if slot.owned and slot.message is None:
                    self._post(index, slot, slot.src, tags, ahead=True)
            while True:
                free = next((i for i, s in enumerate(self._slots) if s.src is None), None)
                if free is None or not self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=tags[1], status=status):
                    break
                src, slot = status.Get_source(), self._slots[free]
                owners = {s.src for s in self._slots if s.owned}
                slot.owned = len(owners) < len(self._slots) - 1 and src not in owners
                self._post(free, slot, src, tags, ahead=False)

    def _post(self, index, slot, src, tags, *, ahead):
        """Post the receives of ``src``'s next share into ``slot``: its weight, then ``x``."""
        xtag, wtag = tags
        memory = slot.transport.memory  # waits for a combine still reading it on the device (Transport.reading)
        if self._exchange is None:
            message = failures.Message([self.comm.Irecv(slot.wbuf, source=src, tag=wtag),
                                        self.comm.Irecv([memory, slot.transport.buffer.datatype], source=src,
                                                        tag=xtag)])
        else:
            message = failures.Message(self._exchange.recv(index, slot, src, tags))
            message.start()
        slot.src, slot.message, slot.ahead = src, message, ahead

    def _add(self, slots):
        recvs = []
        for slot in slots:
            slot.transport.after_recv()
            recvs.append(slot.transport.buffer.array)
            self.weight += float(slot.wbuf[0])
            self.received[slot.src] += 1
            self.preposted += slot.ahead
        self.buffer.acquire()
        kernels.weighted_sum(self.buffer.array, self.buffer.array, 1.0, recvs, [1.0] * len(recvs))
        self.buffer.release()
        for slot in slots:
            slot.transport.reading()  # the combine just queued reads it: MPI may rewrite it only after
            slot.message = None
            if not slot.owned:
                slot.src = None

    def _unpost(self, op, timeout):
        """Free every slot: cancel the receives posted ahead. Called once every message counted
        has been received, so none of them can match (a drain; the next epoch has other tags)."""
        for slot in self._slots:
            if slot.message is not None:
                cancelled = slot.message.cancel(op, comm=self.comm, timeout=timeout)
                if len(cancelled) != len(slot.message.requests):
                    raise RuntimeError(f"{op}: a receive posted for rank {slot.src} took a message no sender counted")
            slot.src, slot.message, slot.owned = None, None, False

    # ------------------------------------------------------------------ sends
    def _out(self, dst):
        out = self._outs.get(dst)
        if out is None:
            out = self._outs[dst] = _Out(dst, self._new_transport)
        return out

    def _put_aside(self, dst, share):
        """Add ``share`` of ``(x, w)`` to what accumulates for ``dst`` (x itself unchanged; the
        caller holds the buffer)."""
        out = self._out(dst)
        acc, x = out.accumulating.buffer.array, self.buffer.array
        if out.filled:   # acc += share * x
            kernels.weighted_sum(acc, acc, 1.0, [x], [share], keep_recvs=True)
        else:            # acc = share * x
            kernels.weighted_sum(acc, x, share)
        out.waccum += share * self.weight
        out.filled = True

    def _send_if_free(self, out):
        """Send ``out``'s accumulated shares if its previous message has left."""
        if not out.filled or (out.message is not None and not self._test(out.message)):
            return
        out.sending, out.accumulating = out.accumulating, out.sending
        out.wsend[0], out.waccum, out.filled = out.waccum, 0.0, False
        out.sending.before_send()
        xtag, wtag = _tags(self.epoch)
        if self._exchange is None:
            out.message = failures.Message([self.comm.Isend(out.wsend, dest=out.dst, tag=wtag),  # the weight first
                                            self.comm.Isend(out.sending.spec, dest=out.dst, tag=xtag)])
        else:
            out.message = failures.Message(self._exchange.sends(out, (xtag, wtag)))
            with failures.raised_as_failure(f"{self._name} (send)"):
                out.message.start()
        out.sent += 1

    def start(self) -> None:
        """Split off this step's shares of ``(x, w)`` into the out-peers' buffers and send
        those whose previous message has left. Never blocks."""
        self._check_open()
        if self._started:
            raise RuntimeError(f"{self._name}.start(): call finish() before the next start()")
        if self._exchange is not None:   # a failure known here is met before any share goes to the dead rank
            self._surviving(lambda: self._exchange.watch(f"{self._name} (step {self.steps})"))
        k = self.steps
        self.topology.check_step(k)
        own, out_weights = self.topology.mixing_weights(self.rank, k)
        for dst in self._gone.intersection(out_weights):  # a rank leaving takes no more shares
            own += out_weights.pop(dst)
        if out_weights and self.holding:   # keep everything (still column stochastic: the identity)
            own, out_weights = 1.0, {}
        elif out_weights and self.weight < self._floor:  # keep everything until a share arrives
            own, out_weights = 1.0, {}
            self.held += 1
        if out_weights:
            self.buffer.acquire()
            for dst, share in sorted(out_weights.items()):
                self._put_aside(dst, share)
            kernels.scale(self.buffer.array, own)
            self.weight *= own
            self.buffer.release()
        self._started = True
        self._surviving(lambda: ([self._send_if_free(self._outs[dst]) for dst in sorted(out_weights)],
                                 self._poll()))

    def finish(self) -> None:
        """Add whatever shares have arrived, from anyone; send what the out-peers' links
        freed. Never blocks. Ends the step."""
        self._check_open()
        if not self._started:
            raise RuntimeError(f"{self._name}.finish(): start() was not called")
        self._surviving(lambda: ([self._send_if_free(out) for out in list(self._outs.values())], self._poll()))
        self._started = False
        self.steps += 1

    def _take_back(self):
        """After a failure: the shares accumulating for the out-peers never left this rank: add
        them back into ``(x, w)``."""
        filled = [out for out in self._outs.values() if out.filled]
        if not filled:
            return
        self.buffer.acquire()
        kernels.weighted_sum(self.buffer.array, self.buffer.array, 1.0,
                             [out.accumulating.buffer.array for out in filled], [1.0] * len(filled))
        self.buffer.release()
        for out in filled:
            self.weight += out.waccum
            out.waccum, out.filled = 0.0, False

    def _reset_messages(self):
        """After a failure (:class:`~mpigossip.resilience.agp_tolerant.AsyncSurvives`): nothing in flight
        or accumulating, fresh receive slots, the counts and tags of a new communicator."""
        self._outs = {}
        self._slots = [_Slot(self._new_transport()) for _ in self._slots]
        self.received = np.zeros(self.size, dtype=np.int64)
        self.epoch = 0

    def step(self) -> None:
        """``start()`` then ``finish()``: one step that never waits."""
        self.start()
        self.finish()

    # ------------------------------------------------------------------ drain
    @property
    def in_flight(self) -> bool:
        return bool(self._started or any(o.filled or o.message is not None for o in self._outs.values())
                    or any(s.message is not None for s in self._slots))

    def drain(self) -> None:
        """Collective: send every accumulated share, agree on how many messages each pair
        exchanged, and receive the rest. Afterwards Σx and Σw over ranks are exact, even when
        the ranks ran different numbers of steps; training may go on. After :meth:`join`, the
        ranks that have called :meth:`leave` drop out here."""
        self._check_open()
        if self._started:
            raise RuntimeError(f"{self._name}.drain(): call finish() first")
        if self._surviving(lambda: self._drain(self.timeout)):
            self._drain(self.timeout)   # over the survivors: what was in flight is lost, the rest is exact

    def _drain(self, timeout):
        if self.size == 1:
            if self._leaving:
                self._regroup([0])
            return
        # Every wait below keeps receiving: a peer may still be sending to this rank.
        outs = list(self._outs.values())

        def all_sent():
            for out in outs:
                self._send_if_free(out)
            return not any(out.filled or (out.message is not None and not self._test(out.message)) for out in outs)

        self._progress_until(all_sent, "drain (sends)",
                             lambda: [o.dst for o in outs if o.filled or o.message is not None], timeout)
        for out in outs:
            out.message = None
        sent = np.zeros(self.size, dtype=np.int64)
        for out in outs:
            sent[out.dst] = out.sent
        expected = np.zeros(self.size, dtype=np.int64)
        with failures.raised_as_failure(f"{self._name}.drain (counts)"):
            counts = self.comm.Ialltoall(sent, expected)
        self._progress_until(lambda: self._test(failures.Message([counts])), "drain (counts)",
                             lambda: "all ranks (Ialltoall)", timeout)
        self._progress_until(lambda: not np.any(self.received < expected), "drain (receives)",
                             lambda: [int(r) for r in np.flatnonzero(self.received < expected)], timeout)
        if np.any(self.received > expected):  # cannot happen: the next epoch's messages have other tags
            raise RuntimeError(f"{self._name}.drain(): received {self.received} but the senders count {expected}")
        self._unpost(f"{self._name}.drain (receives posted ahead)", timeout)
        self.epoch += 1
        for out in outs:
            out.sent_at_drain = out.sent
        if self._members is not None:
            self._members.leaving = self._leaving
            self._members.post()
            leaving = self._members.agreed(timeout)
            if leaving:
                for src in sorted(set(leaving) - self._gone - {self.rank}):  # no notice left unread
                    self.comm.Recv(np.zeros(1, np.uint8), source=src, tag=NOTICE)
                self._regroup(leaving)

    def _progress_until(self, done, op, who, timeout):
        """Receive (``_poll``) until ``done()``, under the deadline (naming ``who()``)."""
        deadline.wait_until(lambda: self._poll() or done(), comm=self.comm, timeout=timeout,
                            op=f"{self._name}.{op}", peer=who)

    # ------------------------------------------------------------------ end of life
    def _complete(self):
        if self._started:
            self.finish()
        self.drain()

    def free(self) -> None:
        """Collective: drain, then release the communicator."""
        if self.closed:
            return
        self._complete()
        if self._exchange is not None and not self.failures:   # (after a failure: kept, never freed)
            self._exchange.free()
        self._free_comm()

    def __repr__(self):
        state = "freed" if self.closed else ("in flight" if self.in_flight else "idle")
        return (f"<AsyncPushSum {self.buffer.kind} {self.buffer.dtype} size={self.buffer.size} "
                f"rank={self.rank}/{self.size} {self.topology!r} steps={self.steps} weight={self.weight:.6g} "
                f"sent={sum(o.sent for o in self._outs.values())} received={int(self.received.sum())} "
                f"preposted={self.preposted} held={self.held} "
                f"{state}>")
