"""The synchronous mixing step (PushSum, D-PSGD) on persistent requests, for
``on_failure="continue"``, and the recovery those communicators share.

:class:`PersistentExchange` is the same round as :mod:`mpigossip.decentralized.pipeline` (``x`` sent
zero-copy, each in-peer's ``x`` received and combined in one fused pass), with two
differences the failure path needs (:mod:`mpigossip.resilience.failures`): every message is a
persistent request, made once per peer and receive slot and started each step (with Open
MPI's ob1, a non-persistent request to a dead peer may end the job), and ``x`` is combined
only once every message of the step has arrived, so a step that meets a failure leaves
``(x, w)`` as they were: ``z = x / w`` stays a weighted average of what the ranks held. The
buffer goes in pieces under the eager limit (:func:`mpigossip.resilience.failures.pieces`), combined only
once all have arrived (a piece combined before the failure would leave parts of ``x`` mixed
with other weights than the rest).

Messages keep one tag per kind: a step completes all of its messages before the next starts,
and MPI matches messages between two ranks in the order they were started (the pieces of one
message are started in order: :func:`mpigossip.resilience.failures.start`).
"""

import warnings

import numpy as np
from mpi4py import MPI

from ..core import buffers, kernels
from . import failures

_X_TAG, _W_TAG = 1, 2


class PersistentExchange:
    """The persistent requests of one communicator's mixing step over its current communicator.

    ``owner`` is the communicator: its ``comm``, ``buffer``, ``timeout``, ``_name``, ``_stage``,
    ``_cuda_aware``, ``_acquire``, ``_release`` and ``_combine(self_weight, parts, shares)``;
    with ``weighted`` (PushSum) also its ``weight``, sent and mixed alongside ``x``.
    """

    def __init__(self, owner, *, weighted=True):
        self.owner, self.weighted = owner, weighted
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
            self._recvs[key] = (failures.recv_init(comm, self._slots[j].spec, src, _X_TAG),
                                comm.Recv_init(w, source=src, tag=_W_TAG), w)
        return self._recvs[key]

    def _send(self, dst):
        if dst not in self._sends:
            comm = self.owner.comm
            self._sends[dst] = (failures.send_init(comm, self._x.spec, dst, _X_TAG),
                                comm.Send_init(self._wsend, dest=dst, tag=_W_TAG))
        return self._sends[dst]

    def run(self, self_weight, outs, ins, shares, op, step=None):
        """One round: ``(x, w) = self_weight * (x, w) + sum_j shares[j] * (x_j, w_j)`` (``x``
        alone unless ``weighted``); raises :class:`~mpigossip.resilience.failures.PeerFailure` (``(x, w)``
        unchanged) if a peer failed. ``weighted``: ``(x, w)`` as sent (before the combine) are
        kept in :attr:`previous` with ``step``, so that a recovery can hand back a share that a
        live out-peer never added (:meth:`mpigossip.PushSum._settle`)."""
        owner = self.owner
        op = f"{owner._name}.{op}"
        with failures.raised_as_failure(op):  # a revoked communicator fails these at once
            recvs = [self._recv(src, j) for j, src in enumerate(ins)]
            sends = [self._send(dst) for dst in outs]
        owner.buffer.synchronize()   # x written, no device work still reads the slots
        for slot in self._slots[:len(ins)]:
            _ = slot.memory          # a staged slot's copy to the device has finished (Transport.memory waits)
        self._x.before_send()
        if self.weighted:
            self._wsend[0] = owner.weight
        messages = [self._requests(x, w) for x, w, _ in recvs] + [self._requests(x, w) for x, w in sends]
        requests = [r for m in messages for r in m]
        peers = [peer for peer, m in zip([*ins, *outs], messages) for _ in m]
        with failures.raised_as_failure(op):
            failures.start(requests)
        failures.wait(requests, comm=owner.comm, timeout=owner.timeout, op=op,
                      peer=lambda pending: sorted({peers[i] for i in pending}))
        parts = []
        for slot in self._slots[:len(ins)]:
            slot.after_recv()
            parts.append(slot.buffer.array)
        owner._acquire()
        if self.weighted:
            self._keep(step, owner.weight)
            owner.weight = self_weight * owner.weight + sum(s * float(w[0]) for s, (_, _, w) in zip(shares, recvs))
        owner._combine(self_weight, parts, shares)
        owner._release()

    def _requests(self, x, w):
        """One message's requests: ``x``'s pieces, then ``w`` when weighted."""
        return [*x, w] if self.weighted else list(x)

    def _all(self):
        return ([r for x, w, _ in self._recvs.values() for r in (*x, w)]
                + [r for x, w in self._sends.values() for r in (*x, w)])

    #: ``(step, x as sent, w as sent)`` of the last combined step (weighted), or None.
    previous = None

    def _keep(self, step, weight):
        """Copy ``x`` as this step sent it (the caller holds the buffer)."""
        if self.previous is None:
            self.previous = (step, buffers.scratch(self.owner.buffer), weight)
        _, copy, _ = self.previous
        kernels.weighted_sum(copy.array, self.owner.buffer.array, 1.0)
        self.previous = (step, copy, weight)

    def abandon(self):
        """The communicator failed: keep its requests alive (never freed) and start afresh on
        the next one."""
        failures.keep(*self._all())
        self._recvs, self._sends = {}, {}

    def free(self):
        """Free the requests (no failure was met on this communicator)."""
        for r in self._all():
            r.Free()
        self._recvs, self._sends = {}, {}


class Survives:
    """Mix-in of a communicator whose synchronous ``step()`` survives failed peers
    (``on_failure="continue"``): the step runs on a :class:`PersistentExchange`; a failure met
    in it shrinks the communicator to the survivors (:func:`mpigossip.resilience.failures.shrink`),
    rebinds the topology over them and records the failure.

    The class mixed into provides ``comm``, ``rank``, ``size``, ``steps``, ``timeout``,
    ``members``, ``failures`` and ``_name``, and overrides :meth:`_rebind` (its topology
    over the survivors) and :meth:`_lost_mass` where it has something to say.
    """

    _exchange = None  # a PersistentExchange when on_failure="continue"
    _skip = 0         # calls left that only count (after a failure: a survivor that was behind)
    _together = False  # one of several stepped in turn (recover_together): a failure goes to the caller
    _met = False       # (with _together) the failure was met in this one's step
    _on_recovered = None  # called after each recovery (a wrapper that must follow it at once)

    def _tolerate(self, on_failure, make_exchange):
        """Keep ``on_failure`` (checked by the caller); with ``"continue"``, the exchange
        ``make_exchange()`` and, on rank 0 of a launch without ULFM, one warning."""
        self.on_failure = on_failure
        if on_failure != "continue":
            return
        self._exchange = make_exchange()
        if not failures.enabled() and self.rank == 0:
            warnings.warn(f"{self._name}(on_failure='continue') without ULFM: a failed rank still ends the job "
                          "(launch with mpiexec --with-ft ulfm)", RuntimeWarning, stacklevel=3)

    def _tolerant_step(self, run):
        """``run(k)`` for step k (raises PeerFailure, leaving the buffer as it was), unless this
        call only counts; a failure is recovered from here and the step counts."""
        k = self.steps
        if self._skip:
            self._skip -= 1
            self.steps += 1
            return
        try:
            run(k)
        except failures.PeerFailure:
            if self._together:
                self._met = True
                raise
            self._recover(k)
            return
        self.steps += 1

    def _recover(self, entry):
        """A peer failed in the step entered at ``entry``: shrink to the survivors, rebind the
        topology over them, record the failure. Every survivor then stands at the same step: one
        that met the failure behind another makes its next calls count only, so that every later
        call is matched (a loop of N calls ends together on every survivor)."""
        rec = self._shrink_to_survivors(entry)
        self._skip = rec.step - entry
        self.steps = entry + 1

    def _shrink_to_survivors(self, entry):
        """Shrink to the survivors, rebind the topology over them, record the failure met at
        step ``entry``; returns the :class:`~mpigossip.resilience.failures.Recovery`."""
        op = f"{self._name} (failure at step {entry})"
        self._exchange.abandon()
        rec = failures.shrink(self.comm, entry, timeout=self.timeout, op=op, share=self._recovery_share(entry))
        before = Before(self.rank, self.size, getattr(self, "topology", None), rec.survivors)
        self.comm, self._owns_comm = rec.comm, True
        self.rank, self.size = rec.comm.Get_rank(), rec.comm.Get_size()
        self._settle(rec, before)
        self._rebind()
        record = {"step": rec.step, "ranks": [self.members[r] for r in rec.lost], "size": self.size,
                  **self._lost_mass(rec, before), "seconds": rec.seconds}
        self.failures.append(record)
        gone = set(rec.lost)
        self.members = [m for r, m in enumerate(self.members) if r not in gone]
        if self._on_recovered is not None:
            self._on_recovered()
        return rec

    def _acquire(self):
        """Before the combine writes the buffer (PushSum also orders its weight and ``z``)."""
        self.buffer.acquire()

    def _release(self):
        self.buffer.release()

    def _combine(self, self_weight, parts, weights):
        """``x = self_weight * x + sum_j weights[j] * parts[j]``: an unweighted mixing step
        (D-PSGD, gossip push); PushSum overrides it to mix its weight and ``z`` too."""
        kernels.weighted_sum(self.buffer.array, self.buffer.array, self_weight, parts, weights)

    def _rebind(self):
        """After a shrink: the graph over the survivors (the communicator's ``_bind_topology``)."""
        self.topology = self._bind_topology()

    def _recovery_share(self, entry):
        """What this survivor tells the others in the recovery (:attr:`Recovery.shared
        <mpigossip.resilience.failures.Recovery>`; override): a small picklable value, or None."""
        return None

    def _lost_mass(self, rec, before):
        """What the failure cost, as entries of the record (override; from ``rec.shared``, the
        same on every survivor: no collective)."""
        return {}

    def _settle(self, rec, before):
        """Right after the shrink: make the survivors' sums exact where the failure left them
        split (override; local, from ``rec.shared``)."""


class Before:
    """The communicator that failed, as a recovery sees it: this rank's ``rank`` in it, its
    ``size`` and ``topology``, and the ranks of it that survived (``old``, in order:
    ``old[r]`` is the survivor that is rank r now)."""

    def __init__(self, rank, size, topology, old):
        self.rank, self.size, self.topology, self.old = rank, size, topology, old


def recover_together(comms):
    """Several :class:`Survives` communicators stepped in turn every iteration (a torch model's
    parameter groups; each built with ``_together = True``, so that a failure propagates as
    :class:`~mpigossip.resilience.failures.PeerFailure`) recover from a failure met in one of them (or,
    after :func:`mpigossip.resilience.failures.agree_failed`, met elsewhere in this iteration).

    Every one is revoked first (a survivor still waiting in a later group's exchange then
    fails out of it instead of waiting for peers that are shrinking an earlier group), then
    each recovers in the same order on every survivor, all from the step the failure was met
    in: the iteration counts as taken for every group (those stepped before it in this
    iteration took it, the one that met the failure abandoned it, those after skip it), so
    the groups stand at one step again and each loop of N iterations ends together."""
    met = [c.steps for c in comms if c._met]
    k = met[0] if met else comms[0].steps - 1  # (not met here: every group took this iteration's step)
    revoke(comms)
    for c in comms:
        c._recover(k)
        c._met = False


def revoke(comms):
    """Revoke the communicators (those another survivor revoked already are skipped)."""
    for c in comms:
        try:
            c.comm.Revoke()
        except MPI.Exception:
            pass
