"""How a communicator whose synchronous step survives failed peers (``on_failure="continue"``)
recovers, and how several stepped in turn recover together.

The step itself is the algorithm's one schedule (:mod:`mpigossip.decentralized.pipeline` for
PushSum, D-PSGD and gossip push, :mod:`mpigossip.exact.ring` for the exact mean) on the request
strategy of :mod:`mpigossip.resilience.persistent`: a step that meets a failure raises
:class:`~mpigossip.resilience.failures.PeerFailure` and leaves the buffer as it was.
:class:`Survives` turns that into a recovery: shrink to the survivors, settle what the failure
split, rebind the topology, record the failure, keep every survivor's calls matched.
"""

import warnings

from mpi4py import MPI

from ..core import kernels
from . import failures


class Survives:
    """Mix-in of a communicator whose synchronous ``step()`` survives failed peers
    (``on_failure="continue"``): the step runs on the request strategy ``_exchange`` (a
    :class:`~mpigossip.resilience.persistent.PersistentRequests`, or AGP's
    :class:`~mpigossip.resilience.agp_tolerant.AsyncRequests`); a failure met in it shrinks the communicator to the survivors (:func:`mpigossip.resilience.failures.shrink`),
    rebinds the topology over them and records the failure.

    The class mixed into provides ``comm``, ``rank``, ``size``, ``steps``, ``timeout``,
    ``members``, ``failures`` and ``_name``, and overrides :meth:`_rebind` (its topology
    over the survivors) and :meth:`_lost_mass` where it has something to say.
    """

    _exchange = None  # the request strategy when on_failure="continue" (its abandon() after a failure)
    _skip = 0         # calls left that only count (after a failure: a survivor that was behind)
    _together = False  # one of several stepped in turn (recover_together): a failure goes to the caller
    _met = False       # (with _together) the failure was met in this one's step
    _on_recovered = None  # called after each recovery (a wrapper that must follow it at once)

    def _tolerate(self, on_failure, make_exchange):
        """Keep ``on_failure`` (checked by the caller); with ``"continue"``, the request strategy
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
    """Revoke the communicators' communicators (those another survivor revoked already are skipped)."""
    revoke_all([c.comm for c in comms])


def revoke_all(comms):
    """Revoke MPI communicators (None, null and those revoked already are skipped)."""
    for c in comms:
        if c is None or c == MPI.COMM_NULL:
            continue
        try:
            c.Revoke()
        except MPI.Exception:
            pass
