"""Preemption: SIGUSR1/SIGTERM ask for a checkpoint; the ranks agree on the step to stop at
without a synchronisation point."""

import signal

import numpy as np
from mpi4py import MPI

from ..core import deadline

#: Steps between two rounds of the (nonblocking) agreement on a stop request.
STOP_CHECK_EVERY = 10


class StopAgreement:
    """Every ``STOP_CHECK_EVERY`` steps each rank posts its stop flag in a nonblocking
    ``Iallreduce(MAX)`` and reads the result of the round posted the time before: a signal on
    any rank stops every rank at the same step, and no step waits for the others."""

    def __init__(self, comm, timeout):
        self.comm, self.timeout = comm, timeout
        self.requested = False
        self._flag, self._agreed, self._request = np.zeros(1, np.int32), np.zeros(1, np.int32), None
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame):
        self.requested = True

    def stop_at(self, step, first_step):
        """Whether every rank stops before ``step`` (collective at the check steps)."""
        if step == first_step or step % STOP_CHECK_EVERY:
            return False
        if self._request is not None:
            self._wait()
            if self._agreed[0]:
                return True
        self._flag[0] = self.requested
        self._request = self.comm.Iallreduce(self._flag, self._agreed, op=MPI.MAX)
        return False

    def _wait(self):
        deadline.wait(self._request, comm=self.comm, timeout=self.timeout, op="train (stop agreement)")
        self._request = None

    def close(self):
        """Complete the round in flight (at the end of the run)."""
        if self._request is not None:
            self._wait()
