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

from __future__ import annotations

import atexit
import functools
import itertools
import sys
import warnings
import weakref
from typing import TYPE_CHECKING, Any

from mpi4py import MPI

from . import deadline, nodes
from .checks import integer_error

if TYPE_CHECKING:
    from collections.abc import Mapping

_live: weakref.WeakSet[MPIObject] = weakref.WeakSet()  # communicators not yet freed
_dropped: list[MPIObject] = []  # collected while in flight: kept (with their buffers) until exit
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
    return integer_error(chunk_bytes, "chunk_bytes", 1)


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


@functools.lru_cache(maxsize=None)
def tag_bound():
    """The largest message tag this MPI allows (``MPI_TAG_UB``: at least 32767; read once,
    it is fixed for the process)."""
    return MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)


def step_tag(step, kind=0, kinds=1):
    """The one tag scheme: message ``kind`` (of ``kinds`` per step) of step ``step``. Steps
    cycle modulo ``(TAG_UB + 1) // kinds``, so every tag is within the MPI's bound; a
    communicator must never have that many steps' messages in flight (checked where a class
    lets them pile up: :func:`tag_period`)."""
    return (step % tag_period(kinds)) * kinds + kind


def tag_period(kinds=1):
    """Steps before :func:`step_tag` repeats a tag (at least 16383 with two kinds)."""
    return (tag_bound() + 1) // kinds


def _renamed(old, new, owner):
    def warn():
        warnings.warn(f"{owner}.{old} is deprecated: use {new}", DeprecationWarning, stacklevel=3)

    def get(self: Any) -> Any:
        warn()
        return getattr(self, new)

    def put(self: Any, value: Any) -> None:
        warn()
        setattr(self, new, value)
    return property(get, put, doc=f"Deprecated name of :attr:`{new}`.")


class Stateful:
    """What every object of the package that owns state shares: ``state_dict()`` /
    ``load_state_dict()`` (its counters and its own state, after a ``drain()``), ``free()`` and
    ``with``, and deprecated aliases of old names (``_renamed``: old -> new, a
    ``DeprecationWarning`` on use)."""

    _name = "Stateful"
    _counters: tuple[str, ...] = ()
    _state_keys: tuple[str, ...] = ()  # the keys _state() adds
    _renamed: dict[str, str] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for old, new in cls.__dict__.get("_renamed", {}).items():
            setattr(cls, old, _renamed(old, new, cls.__name__))

    def _check_open(self):
        """Raise if freed (override)."""

    def drain(self) -> None:
        """Complete everything in flight (nothing here)."""
        self._check_open()

    def _state(self):
        """The class's own state besides its counters (override)."""
        return {}

    def _load_state(self, state):
        """Restore what :meth:`_state` returned (override)."""

    def state_dict(self) -> dict[str, Any]:
        """Counters and state after :meth:`drain` (which may be collective: every rank calls)."""
        self._check_open()
        self.drain()
        state = {k: int(getattr(self, k)) for k in self._counters}
        state.update(self._state())
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` (nothing may be in flight)."""
        self._check_open()
        missing = [k for k in self._counters + self._state_keys if k not in state]
        if missing:
            raise ValueError(f"{self._name}.load_state_dict: the state lacks {', '.join(missing)}")
        if self.in_flight:
            raise RuntimeError(f"{self._name}.load_state_dict: messages are in flight; drain() first")
        self._load_state(state)
        for k in self._counters:
            setattr(self, k, int(state[k]))

    @property
    def in_flight(self) -> bool:
        """Whether requests of this object are pending (then it must not vanish)."""
        return False

    def free(self):
        """Release what this object holds."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()


class Steps(Stateful):
    """The interface every averaging object meets (communicators, parameter-server workers and
    the wrappers over them):

    * ``step()``: one step of the algorithm (the one verb; no argument; returns None;
      blocking where the algorithm is);
    * ``start()`` / ``finish()``: the same step split around the caller's computation. Where
      the algorithm has no overlap variant, ``start()`` runs the whole step and ``finish()``
      does nothing, so code written for the pair runs with every class;
    * ``drain()``: complete everything in flight (before a checkpoint, an evaluation or the
      end; collective where the class says so); a no-op where nothing can be in flight;
    * ``steps``: steps taken, the one counter every class keeps (``_counters`` names the
      others a class keeps, e.g. ``exchanges``);
    * ``state_dict()`` / ``load_state_dict()``: the counters and the class's own state
      (e.g. PushSum's weight), after a ``drain()``; the buffer itself is the caller's to save.

    A wrapper that communicates on some steps only (:class:`~mpigossip.Every`,
    :class:`~mpigossip.Outer`) says whether the last step did in ``exchanged``."""

    _name = "Steps"
    _counters: tuple[str, ...] = ("steps",)
    steps = 0

    def step(self):
        """One step of the algorithm."""
        raise NotImplementedError(f"{self._name}.step()")

    def start(self) -> None:
        """Begin a step (here: the whole step; classes with an overlap variant override)."""
        self.step()

    def finish(self) -> None:
        """Complete the step begun by :meth:`start` as far as the algorithm requires."""
        self._check_open()


_NO_WIRE = object()  # _check_buffer of a communicator without a wire= keyword

class MPIObject(Stateful):
    """Owns ``self.comm``, a duplicate of the user's communicator, so mpigossip's messages
    never match the user's own; a timeout; a safe end of life (see the module).

    With ``dup=False`` it uses ``comm`` as it is and never frees it: for several communicators
    of one owner sharing one private duplicate (context ids are finite: a model's hundreds of
    gradient buckets must not take one each). Their collectives must then start in the same
    order on every rank."""

    _name = "MPIObject"

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

    def _check_buffer(self, x, *, name="x", wire=_NO_WIRE, **options):
        """Collective :func:`mpigossip.core.buffers.check_buffer` of this communicator's buffer (the
        same error on every rank); frees the duplicated communicator first if it fails, so a
        failed constructor leaks nothing. A communicator that takes ``wire=`` passes it: it
        must be valid for the buffer's dtype and the same on every rank."""
        from . import buffers
        if wire is not _NO_WIRE:
            from .wire import check_wire
            options["same"] = {**(options.get("same") or {}), "wire": wire}
            try:
                dtype = buffers.as_buffer(x, name=name).dtype
            except (TypeError, ValueError):
                dtype = None  # the buffer's own problem: check_buffer reports it
            try:
                check_wire(wire, dtype)
            except ValueError as exc:
                options["error"] = f"{options['error']}; {exc}" if options.get("error") else str(exc)
        try:
            return buffers.check_buffer(x, comm=self.comm, op=self._name, name=name, timeout=self.timeout, **options)
        except (TypeError, ValueError):
            self._free_comm()
            raise

    def _one_node(self):
        """Collective: whether every rank shares one node (the same answer on every rank)."""
        return not nodes.spans_nodes(self.comm)

    def _wait(self, requests, op, peer=None):
        deadline.wait(requests, comm=self.comm, timeout=self.timeout, op=f"{self._name}.{op}", peer=peer)

    @property
    def closed(self) -> bool:
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


class Communicator(Steps, MPIObject):
    """Base of the averaging communicators: the :class:`Steps` interface over an
    :class:`MPIObject`."""

    _name = "Communicator"

    @classmethod
    def _hierarchical_error(cls, options):
        """Why this class cannot run between nodes in :class:`~mpigossip.Hierarchical` with
        ``options``, or None."""
        return None
