"""What every communicator shares: a private duplicate of the user's communicator,
a timeout, ``free()`` and context-manager use, and a safe end of life.

Nonblocking requests must not outlive the memory they read or write, nor reach
``MPI_Finalize`` unfinished. So every live communicator is known to this module, and at
interpreter exit (before mpi4py finalizes MPI, which it does after Python's exit handlers)
each completes what it has in flight: overlap PushSum drains, a started ``Iallreduce``
is waited for. One that is garbage-collected with requests in flight is kept alive (with
its buffers) until then. A program that ends without ``free()`` is therefore safe; every
rank must still have run the same steps, as for ``drain()``.
"""

import atexit
import itertools
import sys
import weakref

from mpi4py import MPI

from . import deadline

_live = weakref.WeakSet()  # communicators not yet freed
_dropped = []              # collected while in flight: kept (with their buffers) until exit
_created = itertools.count()  # construction order, the same on every rank (construction is collective)


def _complete_at_exit():
    # In construction order: a completion may be collective (AsyncPushSum.drain), and the
    # ranks must meet in the same order (a WeakSet's order differs from process to process).
    pending = {id(c): c for c in _dropped + list(_live)}
    for c in sorted(pending.values(), key=lambda c: c._order):
        try:
            if not c.closed:
                c._complete()
        except Exception as exc:  # pragma: no cover - reported, never raised at exit
            sys.stderr.write(f"mpigossip: at exit, completing {type(c).__name__} failed: {exc}\n")
    _dropped.clear()


atexit.register(_complete_at_exit)


def check_chunk_bytes(chunk_bytes, *, auto=False):
    """The problem with a ``chunk_bytes`` argument (None allowed with ``auto``), or None."""
    if auto and chunk_bytes is None:
        return None
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        return f"chunk_bytes must be a positive integer, got {chunk_bytes!r}"
    return None


def shard_bounds(size, servers):
    """``[(lo, hi), ...]``: contiguous, near-equal shards of ``size`` elements over ``servers``
    (the parameter server's shards, the node mean's slices)."""
    base, extra = divmod(size, servers)
    bounds, lo = [], 0
    for s in range(servers):
        hi = lo + base + (1 if s < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


class Communicator:
    """Base of the communicators. Owns ``self.comm``, a duplicate of the user's communicator,
    so mpigossip's messages never match the user's own.

    With ``dup=False`` it uses ``comm`` as it is and never frees it: for several communicators
    of one owner sharing one private duplicate (context ids are finite: a model's hundreds of
    gradient buckets must not take one each). Their collectives must then start in the same
    order on every rank."""

    _name = "Communicator"

    def __init__(self, comm, timeout, *, dup=True):
        if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
            raise TypeError(f"{self._name}: comm must be an mpi4py intracommunicator, got {comm!r}")
        # Validate the timeout before the collective calls, so a bad value fails locally at once;
        # every rank passing the same arguments then raises the same error.
        self.timeout = deadline.check_timeout(timeout)
        # Meet under the deadline first, so a rank that never constructs is caught instead of
        # hanging the blocking Dup. (Not Idup: with Open MPI 5 under --enable-recovery, aborting
        # on an Idup'ed communicator sometimes leaves the launcher hanging after every rank exited.)
        deadline.barrier(comm, timeout=self.timeout, op=f"{self._name} (construction)")
        self._owns_comm = bool(dup)
        self.comm = comm.Dup() if dup else comm
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self._order = next(_created)
        _live.add(self)

    @property
    def in_flight(self):
        """Whether requests of this communicator are pending (then it must not vanish)."""
        return False

    def _complete(self):
        """Complete every request in flight (at exit: before MPI is finalized)."""

    def __del__(self):
        # Resurrect an object collected with requests in flight: MPI may still read or write
        # its buffers. It is completed at exit.
        try:
            if not self.closed and self.in_flight:
                _dropped.append(self)
        except AttributeError:  # construction failed before the communicator existed
            pass

    def _validate(self, error):
        """Collective: raise the same ``ValueError`` on every rank if any rank has an ``error``.
        Frees the duplicated communicator first, so a failed constructor leaks nothing."""
        try:
            deadline.raise_collectively(self.comm, error, timeout=self.timeout, op=self._name)
        except ValueError:
            self._free_comm()
            raise

    def _one_node(self):
        """Collective: whether every rank shares one node (``COMM_TYPE_SHARED``); the same
        answer on every rank."""
        shared = self.comm.Split_type(MPI.COMM_TYPE_SHARED)
        try:
            return bool(deadline.allreduce(self.comm, int(shared.Get_size() == self.size), timeout=self.timeout,
                                           op=self._name, reduce=MPI.MIN))
        finally:
            shared.Free()

    def _wait(self, requests, op, peer=None):
        deadline.wait(requests, comm=self.comm, timeout=self.timeout, op=f"{self._name}.{op}", peer=peer)

    @property
    def closed(self):
        return self.comm == MPI.COMM_NULL

    def _check_open(self):
        if self.closed:
            raise RuntimeError(f"{self._name} has been freed")

    def _free_comm(self):
        if not self.closed:
            if self._owns_comm:
                self.comm.Free()
            self.comm = MPI.COMM_NULL

    def free(self):
        """Release the MPI resources (collective over the communicator)."""
        self._free_comm()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()
