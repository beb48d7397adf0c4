"""One watchdog per process: a deadline for blocking MPI calls at no cost on the fast path.

A blocking collective (``MPI_Allreduce``, a node's ``MPI_Reduce_scatter``) has no deadline of
its own, and guarding it with a nonblocking barrier polled under :mod:`.deadline` first costs
a collective per call. Instead the call runs inside :func:`watching`, which records the
operation and its deadline (a dictionary entry, no MPI call, no wakeup); one daemon thread,
started at the first use and documented here, looks every quarter second (or sooner for a
shorter deadline) for a watch past its deadline and then ends the job as a timed-out wait
does: a line naming the rank and the operation, every thread's stack, and
:func:`.deadline.abort_job` (``MPI_Abort``; under a fault-tolerant launch the local daemon
first). The thread makes an MPI call only then, which the package's ``MPI_THREAD_MULTIPLE``
allows (mpi4py's default); below that level it ends this process (exit 1), which ends the job
under a plain launch.
"""

from __future__ import annotations

import contextlib
import faulthandler
import itertools
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from . import deadline

if TYPE_CHECKING:
    from collections.abc import Iterator

#: The most seconds between two looks of the watchdog.
PERIOD = 0.25

_watches: dict[int, tuple[float, float, str, Any]] = {}   # token -> (deadline, seconds, op, comm)
_tokens = itertools.count()
_thread: list[threading.Thread] = []
_shortest = [PERIOD]


@contextlib.contextmanager
def watching(comm: Any, timeout: float, op: str) -> Iterator[None]:
    """Run the block under the watchdog: if it has not finished within ``timeout`` seconds the
    job ends with ``op`` named (see the module)."""
    token = next(_tokens)
    _watches[token] = (time.monotonic() + timeout, timeout, op, comm)
    if timeout / 4 < _shortest[0]:
        _shortest[0] = timeout / 4
    if not _thread:
        _start()
    try:
        yield
    finally:
        del _watches[token]


def _start():
    thread = threading.Thread(target=_run, name="mpigossip-watchdog", daemon=True)
    _thread.append(thread)
    thread.start()


def _run():
    while True:
        time.sleep(min(PERIOD, _shortest[0]))
        now = time.monotonic()
        for end, seconds, op, comm in list(_watches.values()):
            if now > end:
                _expire(seconds, op, comm)


def _expire(seconds, op, comm):
    from mpi4py import MPI
    sys.stderr.write(f"mpigossip: rank {comm.Get_rank()}/{comm.Get_size()}: {op}: timed out after {seconds:g} s "
                     "waiting for all ranks (a blocking collective; the watchdog)\n")
    faulthandler.dump_traceback(all_threads=True)
    if MPI.Query_thread() == MPI.THREAD_MULTIPLE:
        deadline.abort_job(comm)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)
