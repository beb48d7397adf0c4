"""Asynchronous Gradient Push's ranks that leave (uneven data shards; see
:mod:`mpigossip.resilience.membership`): the one-byte notice that stops the others giving a leaver shares,
and the leaver's wait for the others' next drain, where it drops out.

A mix-in of :class:`~mpigossip.decentralized.agp.AsyncPushSum`, which provides the per-peer buffers
(``_outs``, ``_put_aside``), ``_drain(timeout)`` (whose agreement on who leaves
calls ``_regroup``) and calls :meth:`AsyncLeave._notices` from its polling.
"""

# mypy: disable-error-code="attr-defined, has-type"
# (a mix-in: the attributes it uses are its host class's)
from __future__ import annotations

import math

import numpy as np
from mpi4py import MPI

from ..core import buffers, kernels
from ..resilience import membership

NOTICE = 5  # "this rank leaves": sent once to every rank by leave() (outside the epochs' tags)


class AsyncLeave:
    """``join()``, ``leave()`` and what the others do with a notice (see the module). The class
    keeps ``_gone`` (the ranks whose notice arrived, until the drain that drops them) and
    ``_leaving`` (this rank's request)."""

    def join(self) -> None:
        """Collective: from now on a rank may :meth:`leave` (each ``drain()`` then also agrees
        who leaves). Unlike PushSum's, the ranks need not be at the same step."""
        self._check_open()
        if self._started:
            raise RuntimeError(f"{self._name}.join(): call finish() first")
        if self._exchange is not None:
            raise RuntimeError(f"{self._name}.join(): not with on_failure='continue'")
        membership.check_join(self.comm, 0, self._members is not None, timeout=self.timeout,
                              op=f"{self._name}.join")
        self._members = membership.Membership(self.comm, timeout=self.timeout, op=self._name)

    def leave(self) -> None:
        """Drop out (after :meth:`join`; e.g. out of data). This rank gives its whole ``(x, w)``
        to the next rank, tells every rank that it leaves (they send it no more shares and take
        back what they had put aside for it), and waits in a :meth:`drain` for the others' next
        one (an evaluation, a checkpoint, the end: no deadline while it waits, since the others
        keep theirs), where what reached it meanwhile goes to a survivor and the others go on
        over a communicator and a topology of their own. Σx and Σw over them stay exact.
        Afterwards ``left`` is True and ``x`` holds the de-biased model this rank had when it
        called ``leave()``."""
        self._check_open()
        if self._members is None:
            raise RuntimeError(f"{self._name}.leave(): call join() on every rank first (or use mpigossip.Join)")
        if self._started:
            raise RuntimeError(f"{self._name}.leave(): call finish() first")
        self._leaving = True
        model = buffers.scratch(self.buffer)
        self.buffer.acquire()
        kernels.debias(model.array, self.buffer.array, self.weight)
        live = [r for r in range(self.size) if r != self.rank and r not in self._gone]
        if live:
            self._put_aside(min(live, key=lambda r: (r - self.rank) % self.size), 1.0)  # the next rank still here
            self.buffer.array.fill(0)
            self.weight = 0.0
        self.buffer.release()
        notice = np.zeros(1, np.uint8)
        # To every other rank, those that are leaving too: the drain that drops them reads it.
        notices = [self.comm.Isend(notice, dest=r, tag=NOTICE) for r in range(self.size) if r != self.rank]
        self._drain(math.inf)
        MPI.Request.Waitall(notices)  # the drain read them all
        self.buffer.acquire()
        kernels.weighted_sum(self.buffer.array, model.array, 1.0)
        self.buffer.release()

    def _notices(self):
        """Take in leave() notices: send the leaver no more shares, and add back the shares
        put aside for it and not yet sent."""
        status = MPI.Status()
        while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=NOTICE, status=status):
            src = status.Get_source()
            self.comm.Recv(np.zeros(1, np.uint8), source=src, tag=NOTICE)
            self._gone.add(src)
            out = self._outs.get(src)
            if out is not None and out.filled:
                self.buffer.acquire()
                acc = out.accumulating.buffer.array
                kernels.weighted_sum(self.buffer.array, self.buffer.array, 1.0, [acc], [1.0], keep_recvs=True)
                self.buffer.release()
                self.weight += out.waccum
                out.waccum, out.filled = 0.0, False

    def _regroup(self, leaving):
        super()._regroup(leaving)
        if not self.left:  # what was kept per peer of the old communicator
            self._outs, self._gone = {}, set()
            self.received = np.zeros(self.size, dtype=np.int64)
