"""Ranks that leave on purpose: who still takes part, agreed step by step, and the regrouping
that drops those who left (uneven data shards: DDP's ``join``).

A communicator that supports it takes part once every rank has called its ``join()`` (or
entered :class:`Join`): from then on each of its steps posts one small nonblocking
``Iallreduce`` of "this rank asks to leave" (:class:`Membership`), completed at the top of the
next step, so every rank learns the same set of leavers at the same step without waiting on a
collective in the step itself. What a communicator does with them is its own contract:

* PushSum (synchronous and overlap): at the agreed step the messages in flight are drained, each
  leaver hands its whole ``(x, w)`` to one survivor (:func:`hand_off`), and the survivors go on
  over a new communicator of their own (:func:`regroup`), the topology rebuilt over them. Σx and
  Σw over the survivors hold all the mass, exactly; the leaver keeps its de-biased model
  ``z = x / w`` in ``x`` and is done.
* AllReduce: a rank that has left shadows the collectives (it adds zeros) until every rank has
  left, as DDP's join does; the mean is over the ranks still training.

A rank that fails instead (ULFM, ``on_failure="continue"``) goes through
:mod:`mpigossip.resilience.failures`: the communicator is shrunk, not split, and the failed rank's mass
is lost, not handed off; ``members`` serves both.
"""

# mypy: disable-error-code="attr-defined"
# (a mix-in: the attributes it uses are its host class's)
from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from ..core import buffers, deadline, kernels

_HANDOFF_TAG = 32000  # within every MPI's tag bound (>= 32767); a private communicator's only message then


class Membership:
    """One flag per rank and step over ``comm``: who asks to leave.

    ``post()`` at step k sends this rank's flag (:attr:`leaving`); ``agreed()`` at step k + 1
    completes it and returns the ranks that asked, the same list on every rank.
    """

    def __init__(self, comm: MPI.Intracomm, *, timeout: float, op: str) -> None:
        self.comm, self.timeout, self.op = comm, timeout, op
        self._flags = np.zeros(comm.Get_size(), dtype=np.uint8)
        self._request = None
        self.leaving = False

    def post(self):
        """Post this step's flags (nonblocking)."""
        self._flags[:] = 0
        self._flags[self.comm.Get_rank()] = 1 if self.leaving else 0
        self._request = self.comm.Iallreduce(MPI.IN_PLACE, self._flags, MPI.MAX)

    def complete(self):
        """Complete the last :meth:`post`, if any, ignoring what it says (before the
        communicator is freed)."""
        self.agreed()

    def agreed(self, timeout=None):
        """Complete the last :meth:`post` (under the deadline, ``timeout`` if given): the ranks
        that asked to leave in it, sorted; ``[]`` if nothing was posted."""
        if self._request is None:
            return []
        deadline.wait(self._request, comm=self.comm, timeout=timeout or self.timeout, op=f"{self.op} (who leaves)",
                      peer="all ranks (Iallreduce)")
        self._request = None
        return [int(r) for r in np.flatnonzero(self._flags)]


def targets(size, leaving):
    """``{leaver: survivor}``: where each leaver's mass goes (spread over the survivors);
    empty when no rank stays."""
    stay = [r for r in range(size) if r not in set(leaving)]
    return {} if not stay else {r: stay[r % len(stay)] for r in leaving}


def hand_off(owner, leaving, *, op):
    """The agreed step's transfer: each leaver sends its whole ``(x, w)`` (in the buffer's own
    dtype: no wire format's rounding) to its survivor, which adds it. Afterwards a leaver's
    ``x`` holds its de-biased model ``x / w`` (unchanged if ``w`` was 0) and its weight is 0.
    Nothing may be in flight.

    ``owner`` is a PushSum-like communicator: ``comm``, ``rank``, ``buffer``, ``weight``,
    ``timeout``, ``_stage``, ``_cuda_aware``."""
    where = targets(owner.size, leaving)
    comm, buf = owner.comm, owner.buffer
    if owner.rank in where:
        x = buffers.Transport(buf, stage=owner._stage, cuda_aware=owner._cuda_aware)
        w = np.array([owner.weight], dtype=np.float64)
        buf.acquire()
        x.before_send()
        dst = where[owner.rank]
        deadline.wait([comm.Isend(w, dest=dst, tag=_HANDOFF_TAG), comm.Isend(x.spec, dest=dst, tag=_HANDOFF_TAG + 1)],
                      comm=comm, timeout=owner.timeout, op=f"{op} (hand-off)", peer=dst)
        _keep_model(owner)
        return
    if owner.rank in leaving:  # every rank leaves: each keeps its own model
        _keep_model(owner)
        return
    for src in sorted(s for s, d in where.items() if d == owner.rank):
        recv = buffers.Transport(buffers.scratch(buf), stage=owner._stage, cuda_aware=owner._cuda_aware)
        w = np.zeros(1, dtype=np.float64)
        deadline.wait([comm.Irecv(w, source=src, tag=_HANDOFF_TAG),
                       comm.Irecv(recv.spec, source=src, tag=_HANDOFF_TAG + 1)],
                      comm=comm, timeout=owner.timeout, op=f"{op} (hand-off)", peer=src)
        recv.after_recv()
        buf.acquire()
        kernels.weighted_sum(buf.array, buf.array, 1.0, [recv.buffer.array], [1.0])
        buf.release()
        owner.weight += float(w[0])


def _keep_model(owner):
    """A leaver's x becomes its de-biased model (left as it is if it holds no weight)."""
    if owner.weight > 0:
        owner.buffer.acquire()
        kernels.debias(owner.buffer.array, owner.buffer.array, owner.weight)
        owner.buffer.release()
    owner.weight = 0.0


def regroup(comm, leaving, *, timeout, op):
    """Collective over ``comm`` (leavers included): a new communicator of the ranks not in
    ``leaving``, in their old order (``COMM_NULL`` on a leaver). Met under the deadline first,
    so a rank that never arrives ends the job instead of hanging the blocking ``Split``."""
    deadline.barrier(comm, timeout=timeout, op=f"{op} (regroup)")
    rank = comm.Get_rank()
    return comm.Split(MPI.UNDEFINED if rank in set(leaving) else 0, rank)


def check_join(comm, steps, joined, *, timeout, op):
    """Collective: raise the same ``RuntimeError`` on every rank unless every rank joins at
    the same step, for the first time."""
    seen = deadline.allgather(comm, (int(steps), bool(joined)), timeout=timeout, op=op)
    error = None
    if len({s for s, _ in seen}) > 1:
        error = f"every rank must join at the same step, got steps {[s for s, _ in seen]}"
    elif any(j for _, j in seen):
        error = "already joined"
    deadline.raise_gathered([error] * len(seen), op=op, exc=RuntimeError)


class MeanJoin:
    """DDP's join for a communicator of the exact mean (:class:`~mpigossip.AllreduceAverager`):
    after :meth:`join`, each average first counts the ranks still training (one small blocking
    ``Allreduce``); a rank that has left shadows the averages with zeros until every rank has
    left, and the mean is over those still training.

    The class mixed into provides ``comm``, ``size``, ``buffer``, ``steps``, ``timeout``,
    ``_check_idle()``, ``average()``, ``start()`` and ``finish()``, and calls
    :meth:`_shadow_round` at the top of ``average()``/``start()`` and :meth:`_rescale` after
    each mean."""

    _joined = False
    left = False
    _overlap = False
    active: Any = None  # ranks still training, once joined

    def join(self):
        """Collective: from now on a rank may :meth:`leave` (uneven data shards). Every rank
        calls it at the same step (checked: the same error on every rank). See :class:`Join`."""
        self._check_idle()
        check_join(self.comm, self.steps, self._joined, timeout=self.timeout, op=f"{self._name}.join")
        self._joined, self.active = True, self.size

    def leave(self) -> None:
        """This rank has no more data: it shadows the others' averages until every rank has
        left. In each it adds zeros and receives the mean over the ranks still training (so its
        buffer follows theirs); the divisor is their number, not the world size. Averages the
        way the last step did (``average()`` or ``start()``/``finish()``), as the others do."""
        self._check_idle()
        if not self._joined:
            raise RuntimeError(f"{self._name}.leave(): call join() on every rank first (or use mpigossip.Join)")
        self.left = True
        while self.active > 0:
            if self._overlap:
                self.start()
                self.finish()
            else:
                self.average()

    def _shadow_round(self, overlap=False):
        """Joined: count the ranks still training; zero this rank's contribution if it has
        left. True when none trains any more (then nothing moves)."""
        self._overlap = overlap
        if not self._joined:
            return False
        self._check_idle()
        self.active = int(deadline.allreduce(self.comm, 0 if self.left else 1, timeout=self.timeout,
                                             op=f"{self._name} (ranks still training)"))
        if self.active == 0:
            return True
        if self.left:
            self.buffer.acquire()
            self.buffer.array.fill(0)
        return False

    def _rescale(self):
        """Joined: turn the mean over all ranks into the mean over the ranks still training."""
        if self._joined and 0 < self.active < self.size:
            self.buffer.acquire()
            kernels.scale(self.buffer.array, self.size / self.active)
            self.buffer.release()


class Join:
    """``with Join(algo):`` — every rank enters at the same step (collective: ``algo.join()``);
    a rank whose block ends (out of data) calls ``algo.leave()``. Ranks may leave at different
    steps; what leaving means is the communicator's (see the module)."""

    def __init__(self, algo: Any) -> None:
        if not callable(getattr(algo, "join", None)) or not callable(getattr(algo, "leave", None)):
            raise TypeError(f"Join needs a communicator with join() and leave(), got {type(algo).__name__}")
        self.algo = algo

    def __enter__(self):
        self.algo.join()
        return self.algo

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.algo.leave()
        return False
