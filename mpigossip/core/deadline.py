"""Deadlines for every wait, and collective checks that fail the same way on every rank.

Nothing in mpigossip waits forever: each wait polls its requests until a deadline and,
on expiry, ends the job with ``Abort`` and a message naming the rank, the operation and
the peer it waited for. Polling (``Testall`` with a short back-off) is also what drives
progress of nonblocking and one-sided operations in MPIs without a progress thread.
"""

import os
import pickle
import signal
import sys
import time

import numpy as np
from mpi4py import MPI

#: Environment variable holding the default timeout in seconds.
TIMEOUT_ENV = "MPIGOSSIP_TIMEOUT"
_DEFAULT_TIMEOUT = 300.0
_SPIN = 0.05  # seconds of polling with only a yield between polls, before backing off


def default_timeout():
    """The default deadline of a wait, in seconds (``$MPIGOSSIP_TIMEOUT``, else 300)."""
    value = os.environ.get(TIMEOUT_ENV)
    if value is None or value == "":
        return _DEFAULT_TIMEOUT
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={value!r} is not a number of seconds") from None
    if seconds <= 0:
        raise ValueError(f"{TIMEOUT_ENV}={value!r} must be > 0")
    return seconds


def check_timeout(timeout):
    """Validate a ``timeout=`` argument; ``None`` means :func:`default_timeout`."""
    if timeout is None:
        return default_timeout()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return float(timeout)


def abort(comm, message, errorcode=1):
    """Print ``message`` with this rank's name to stderr and ``Abort`` the job."""
    text = f"mpigossip: rank {comm.Get_rank()}/{comm.Get_size()}: {message}\n"
    sys.stderr.write(text)
    sys.stderr.flush()
    sys.stdout.flush()
    abort_job(comm, errorcode)


#: The names of Open MPI's launcher and daemons (a rank's parent process under ``mpiexec``).
OPEN_MPI_DAEMONS = frozenset({"prterun", "prted", "mpirun", "mpiexec", "orterun", "orted", "prte"})


def fault_tolerant(environ=None):
    """Whether this process was launched with ULFM on (Open MPI's ``--with-ft ulfm`` sets
    ``OMPI_MCA_mpi_ft_enable``); without it a failed rank ends the job."""
    value = (os.environ if environ is None else environ).get("OMPI_MCA_mpi_ft_enable", "")
    return value.strip().lower() in ("1", "true", "yes", "on", "enabled")


def abort_job(comm, errorcode=1):
    """``comm.Abort(errorcode)``, so that the whole job ends, on every launch.

    Under a fault-tolerant launch (ULFM: ``mpiexec --with-ft ulfm``) Open MPI's ``MPI_Abort``
    ends only the calling process: the others are told of a failed peer, go on as its
    survivors (``on_failure="continue"``) or wait, and the launcher waits for them. An abort
    (a timeout, an exception, a NaN) must end the job there too: the local Open MPI daemon,
    this process's parent, is ended first (``SIGTERM``), and a job that loses a daemon is
    ended by Open MPI's launcher, on every node. Elsewhere (no ULFM, or a parent that is not
    one of Open MPI's daemons, as under ``srun``) this is ``comm.Abort`` alone."""
    sys.stdout.flush()
    sys.stderr.flush()
    if fault_tolerant():
        parent = os.getppid()
        try:
            with open(f"/proc/{parent}/comm") as f:
                name = f.read().strip()
        except OSError:
            name = ""
        if name in OPEN_MPI_DAEMONS:
            try:
                os.kill(parent, signal.SIGTERM)
            except OSError:
                pass
    comm.Abort(errorcode)


def wait(requests, *, comm, timeout, op, peer=None):
    """Wait for all ``requests``; abort the job if they are not done by the deadline.

    Args:
        requests: one ``MPI.Request`` or a list of them.
        comm: communicator used to name the rank and to ``Abort``.
        timeout: seconds to wait.
        op: name of the operation, for the message (e.g. ``"PushSum.step"``).
        peer: rank, list of ranks, a description (``"all ranks (Ibarrier)"``), or a
            callable ``peer(pending_indices)`` naming whom the unfinished requests wait for.
    """
    if isinstance(requests, MPI.Request):
        requests = [requests]
    if not requests:
        return
    wait_until(lambda: testall(requests), comm=comm, timeout=timeout, op=op, peer=naming(requests, peer))


def testall(requests):
    """``MPI_Testall`` of ``requests``: whether all have completed. Where one completed in
    error the exception raised is that request's own error (a failed peer's
    ``MPI_ERR_PROC_FAILED``, say), not ``MPI_ERR_IN_STATUS``, which only says "look in the
    statuses": a caller that tells a failed peer from other errors sees one class either way."""
    statuses = [MPI.Status() for _ in requests]
    try:
        return MPI.Request.Testall(requests, statuses)
    except MPI.Exception as exc:
        if exc.Get_error_class() == MPI.ERR_IN_STATUS:
            for status in statuses:
                err = status.Get_error()
                if err not in (MPI.SUCCESS, MPI.ERR_PENDING):
                    raise MPI.Exception(err) from None
        raise


def naming(requests, peer):
    """``peer`` as :func:`wait_until` takes it: a ``peer(pending_indices)`` callable bound to
    the indices of the ``requests`` not yet complete (``MPI_Request_get_status``, which frees
    nothing); anything else as it is."""
    if not callable(peer):
        return peer

    def who():
        pending = []
        for i, r in enumerate(requests):
            try:
                if r != MPI.REQUEST_NULL and not r.Get_status():
                    pending.append(i)
            except MPI.Exception:  # completed in error (a failed peer): it is the one to name
                pending.append(i)
        return peer(pending)
    return who


def wait_until(done, *, comm, timeout, op, peer=None):
    """Call ``done()`` (which drives MPI: ``Test`` calls) until it returns true; abort the job
    if it has not by the deadline. ``peer`` as for :func:`wait`, or a callable ``peer()``."""
    if done():
        return
    start = time.monotonic()
    try:
        _poll(done, comm, timeout, op, peer, start)
    finally:
        waited[0] += time.monotonic() - start


def waited_seconds():
    """Total seconds this process has spent blocked in :func:`wait` (for metrics)."""
    return waited[0]


waited = [0.0]


def _poll(done, comm, timeout, op, peer, start):
    deadline = start + timeout
    spin_until = start + _SPIN
    pause = 0.0
    while not done():
        now = time.monotonic()
        if now > deadline:
            who = peer() if callable(peer) else peer
            if isinstance(who, (list, tuple)):
                who = ", ".join(str(p) for p in who) or "?"
            if isinstance(who, str) and not who[:1].isdigit():
                suffix = f" waiting for {who}"  # e.g. "all ranks (Ibarrier)"
            else:
                suffix = f" waiting for rank {who}" if who is not None else ""
            abort(comm, f"{op}: timed out after {timeout:g} s{suffix}")
        if now < spin_until:
            time.sleep(0)  # yield the core (ranks may outnumber cores), then poll again
        else:  # a long wait: back off to at most 1 ms between polls
            pause = min(1e-3, pause * 2 or 1e-5)
            time.sleep(pause)


def allgather(comm, obj, *, timeout, op):
    """``comm.allgather(obj)`` for small picklable objects, with a deadline."""
    data = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
    counts = np.zeros(comm.Get_size(), dtype=np.int64)
    wait(comm.Iallgather(np.array([data.size], dtype=np.int64), counts),
         comm=comm, timeout=timeout, op=f"{op} (allgather)")
    displs = np.concatenate([[0], np.cumsum(counts)[:-1]])
    out = np.empty(int(counts.sum()), dtype=np.uint8)
    wait(comm.Iallgatherv(data, [out, counts, displs, MPI.BYTE]),
         comm=comm, timeout=timeout, op=f"{op} (allgather)")
    return [pickle.loads(out[d:d + c].tobytes()) for d, c in zip(displs, counts)]


def allreduce(comm, values, *, timeout, op, reduce=MPI.SUM):
    """``Allreduce`` of a number or a numpy array with a deadline (``Iallreduce``).

    Returns a Python number for a number, else the reduced array: ``values`` itself,
    reduced in place, if it is a contiguous numpy array.
    """
    scalar = np.ndim(values) == 0
    array = np.array([values]) if scalar else values
    if not isinstance(array, np.ndarray) or not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    wait(comm.Iallreduce(MPI.IN_PLACE, array, reduce), comm=comm, timeout=timeout, op=op,
         peer="all ranks (Iallreduce)")
    return array[0].item() if scalar else array


def bcast(comm, buf, *, timeout, op, root=0):
    """``Bcast`` of a buffer (an array or ``[array, datatype]``) in place, with a deadline (``Ibcast``)."""
    wait(comm.Ibcast(buf, root=root), comm=comm, timeout=timeout, op=op, peer=f"{root} (Ibcast root)")
    return buf


def barrier(comm, *, timeout, op):
    """``Barrier`` with a deadline (``Ibarrier``)."""
    wait(comm.Ibarrier(), comm=comm, timeout=timeout, op=op, peer="all ranks (Ibarrier)")


def raise_collectively(comm, error, *, timeout, op, exc=ValueError):
    """Collective: raise the same ``exc`` on every rank if any rank passes an error.

    Args:
        error: this rank's problem as a string, or ``None``.

    Every rank raises with one message listing each rank's problem, so a bad
    argument on one rank never leaves the others hanging in a later collective.
    """
    raise_gathered(allgather(comm, error, timeout=timeout, op=op), op=op, exc=exc)


def raise_gathered(errors, *, op, exc=ValueError):
    """Raise ``exc`` listing every rank's problem, if any; ``errors[r]`` is rank r's
    problem (string) or ``None``, as gathered on every rank."""
    bad = [(r, e) for r, e in enumerate(errors) if e]
    if not bad:
        return
    # Group ranks that report the same problem, to keep messages short at scale.
    groups = {}
    for rank, err in bad:
        groups.setdefault(err, []).append(rank)
    parts = [f"rank{'s' if len(r) > 1 else ''} {_ranks(r)}: {e}" for e, r in groups.items()]
    raise exc(f"{op}: " + "; ".join(parts))


def _ranks(ranks):
    if len(ranks) > 6:
        return f"{ranks[0]}-{ranks[-1]} ({len(ranks)} ranks)" if ranks == list(
            range(ranks[0], ranks[-1] + 1)) else ", ".join(map(str, ranks[:6])) + ", ..."
    return ", ".join(map(str, ranks))
