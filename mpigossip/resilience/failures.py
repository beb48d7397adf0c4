"""Peers that fail: the survivors of a killed rank go on (Open MPI's ULFM), one layer under
the communicators.

A communicator built with ``on_failure="continue"`` moves its messages on persistent
requests (with Open MPI's ob1, a request to a dead peer that completes in error and is then
freed ends the job, whatever the error handlers: see docs/RESULTS.md "Live fault
tolerance"), waits for them with :func:`wait`, which turns a process failure or a revoked
communicator into :class:`PeerFailure`, and recovers with :func:`shrink`: the communicator is
revoked (every survivor's pending operation on it fails at once), shrunk to the survivors,
and the survivors agree on the step to go on from. What the communicator then does (the
topology rebuilt over the survivors, the mass lost reported) is its own contract; ranks that
leave on purpose go through :mod:`mpigossip.resilience.membership` instead, without loss.

Needs a launch with ULFM on (``mpiexec --with-ft ulfm``, or ``python -m mpigossip launch
--fault-tolerant``); without it the runtime ends the job at the first failure, as it always
did. A process that has seen a failure must end without ``MPI_Finalize`` (the survivors hang
in it over TCP): :func:`exit` does that.

``MPI_Comm_shrink`` is the one blocking call here (Open MPI's ``MPI_Comm_ishrink`` fails on a
revoked communicator): a timer thread, alive only during the call and making no MPI call,
ends the process with a message and every thread's stack if it has not returned by the
deadline, so that a recovery cannot hang forever. Open MPI's ``han`` collectives are not
fault tolerant (an upstream deadlock of the agreement across nodes): a fault-tolerant launch
turns them off (:data:`mpigossip.launch.launcher.FAULT_TOLERANT_DEFAULTS`; by hand: ``mpiexec --with-ft
ulfm --mca coll ^han``).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np
from mpi4py import MPI

from ..core import deadline

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Mapping, Sequence

#: Error classes that mean "a peer failed" (or another survivor revoked the communicator).
FAILED = frozenset(getattr(MPI, n) for n in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
                   if hasattr(MPI, n))
#: The values of ``on_failure=``.
CHOICES = ("abort", "continue")

_kept: list[Any] = []  # revoked communicators and their persistent requests: never freed (see the module)
_seen = [False]
_live: list[Any] = [None]  # the latest communicator of the live ranks (a shrink's or a grow's): exit() drains it


class PeerFailure(RuntimeError):
    """A peer of a communicator failed, or another survivor revoked it (ULFM)."""

    def __init__(self, op: str, error_class: int) -> None:
        self.op, self.error_class = op, error_class
        name = {getattr(MPI, n, None): n for n in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")}
        super().__init__(f"{op}: {name.get(error_class, error_class)}")


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process was launched with ULFM on (Open MPI's ``--with-ft ulfm`` sets
    ``OMPI_MCA_mpi_ft_enable``); without it a failed rank ends the job."""
    return bool(deadline.fault_tolerant(environ))


def check_on_failure(value: object, wire: str | None = None) -> str | None:
    """The problem with an ``on_failure=`` argument (and the ``wire=`` beside it: the tolerant
    paths move the buffer's own dtype), or None."""
    if value not in CHOICES:
        return f"on_failure must be one of {', '.join(map(repr, CHOICES))}, got {value!r}"
    if value == "continue" and wire is not None:
        return f"on_failure='continue' moves the buffer's own dtype, not wire={wire!r}"
    return None


def seen() -> bool:
    """Whether this process has recovered from a failure (then it must end with :func:`exit`)."""
    return _seen[0]


def note_recovered(comm: MPI.Comm | None = None) -> None:
    """Mark this process as part of a job that recovered from a failure (a newcomer spawned into
    it): :func:`seen` is true from now on, and it must end with :func:`exit` as the survivors do.
    ``comm``, where given, is the live ranks' communicator now (the one :func:`exit` drains)."""
    _seen[0] = True
    if comm is not None:
        _live[0] = comm


#: Open MPI's TCP eager limit when nothing sets it (``btl_tcp_eager_limit``).
TCP_EAGER_DEFAULT = 64 << 10
#: Sets the most bytes a fault-tolerant path sends in one message (see :func:`chunk_bytes`).
CHUNK_ENV = "MPIGOSSIP_CHUNK_BYTES"
_HEADERS = 4 << 10  # room left under the eager limit for the messages' headers


def chunk_bytes(environ: Mapping[str, str] | None = None) -> int:
    """The most bytes a fault-tolerant path sends in one message: ``$MPIGOSSIP_CHUNK_BYTES``,
    else Open MPI's TCP eager limit (``OMPI_MCA_btl_tcp_eager_limit``; 64 KiB unless set; the
    fault-tolerant launch sets 4 MiB) less 4 KiB of headers. Every piece then goes eagerly: a
    message over the limit goes by rendezvous, and a rendezvous with a survivor that had revoked
    the communicator and entered the shrink hung recoveries across nodes (docs/RESULTS.md)."""
    env = os.environ if environ is None else environ
    if env.get(CHUNK_ENV, "").strip():
        value = int(env[CHUNK_ENV])
        if value < 8:
            raise ValueError(f"${CHUNK_ENV} must be at least 8 bytes, got {value}")
        return value
    limit = int(env.get("OMPI_MCA_btl_tcp_eager_limit", "").strip() or TCP_EAGER_DEFAULT)
    return max(limit - _HEADERS, 4096)


def pieces(spec: list[Any], limit: int | None = None) -> list[list[Any]]:
    """An MPI spec ``[memory, datatype]`` (``memory`` a 1-D array) as consecutive specs of at
    most ``limit`` bytes (default :func:`chunk_bytes`)."""
    memory, datatype = spec
    per = max(1, (limit or chunk_bytes()) // datatype.Get_size())
    n = len(memory)
    if n <= per:
        return [spec]
    return [[memory[lo:lo + per], datatype] for lo in range(0, n, per)]


def send_init(comm: MPI.Intracomm, spec: list[Any], dest: int, tag: int) -> list[MPI.Prequest]:
    """Persistent sends of ``spec`` in :func:`pieces`, all with ``tag``: start them with
    :func:`start` (in order), and the receiver's :func:`recv_init` in the same order."""
    return [comm.Send_init(piece, dest=dest, tag=tag) for piece in pieces(spec)]


def recv_init(comm: MPI.Intracomm, spec: list[Any], source: int, tag: int) -> list[MPI.Prequest]:
    """Persistent receives of ``spec`` in :func:`pieces` (see :func:`send_init`)."""
    return [comm.Recv_init(piece, source=source, tag=tag) for piece in pieces(spec)]


def start(requests: Sequence[MPI.Prequest]) -> None:
    """Start persistent requests one by one, in order. The pieces of a message share a tag, and
    MPI matches the messages of one tag between two ranks in the order they are started
    (``MPI_Startall`` starts them in an unspecified order)."""
    for request in requests:
        request.Start()


class Message:
    """The requests of one message (its ``x`` and ``w``; or the sends of one share to several
    peers), each one's outcome recorded when it completes.

    A request that completed in error is inactive afterwards (persistent) or null: a later
    ``MPI_Test`` of it reports it complete, with an empty status. Testing a message's requests
    again after one of them failed would therefore take the failed one for arrived, and the
    salvage after a failure would add an ``x`` without its ``w``, or a buffer MPI never wrote.
    Here each request is tested once to completion and its outcome kept: :meth:`succeeded` is
    true only if every request completed without error since :meth:`start` (or since the
    message was made, for requests already started).
    """

    __slots__ = ("requests", "_done", "error_class")

    def __init__(self, requests: Sequence[MPI.Request] = ()) -> None:
        self.requests: list[Any] = list(requests)
        self._done = [False] * len(self.requests)
        self.error_class: int | None = None  # the error class of the first request that failed

    def extend(self, requests: Sequence[MPI.Request]) -> None:
        """More requests of the message (started, not yet tested)."""
        self.requests.extend(requests)
        self._done.extend([False] * len(requests))

    def start(self) -> None:
        """Start the (persistent) requests and forget the outcomes of their last use."""
        self._done = [False] * len(self.requests)
        self.error_class = None
        start(self.requests)

    @property
    def failed(self) -> bool:
        """Whether a request of this message completed in error (a peer failed, or the
        communicator was revoked)."""
        return self.error_class is not None

    def test(self, op: str) -> bool:
        """Test the requests not yet complete: whether all have completed; raises
        :class:`PeerFailure` if one completed in error (now or before: the outcome is kept)."""
        if self.error_class is not None:
            raise PeerFailure(op, self.error_class)
        for i, request in enumerate(self.requests):
            if self._done[i]:
                continue
            try:
                self._done[i] = request.Test()
            except MPI.Exception as exc:
                self._done[i] = True
                cls = exc.Get_error_class()
                if cls in FAILED:
                    self.error_class = cls
                    raise PeerFailure(op, cls) from None
                raise
        return all(self._done)

    def succeeded(self) -> bool:
        """After a failure: whether every request completed without error (tested once more
        now; False if one is still pending or completed in error)."""
        try:
            return self.test("salvage")
        except PeerFailure:
            return False

    def pending(self) -> list[int]:
        """The indices of the requests not yet complete."""
        return [i for i, done in enumerate(self._done) if not done]

    def cancel(self, op: str, *, comm: MPI.Comm, timeout: float) -> list[int]:
        """Cancel the receives not yet complete and wait until each is cancelled or has
        completed (matched before the cancel took: its data arrived). Returns the indices of
        those cancelled: they are pending again, and the message must be dropped or those
        requests :meth:`restart` ed (a cancelled request tests as complete, like a failed one).
        A failure raises :class:`PeerFailure`."""
        pending = self.pending()
        with raised_as_failure(op):
            for i in pending:
                self.requests[i].Cancel()
        cancelled = []
        status = MPI.Status()

        def settled():
            for i in pending:
                if self._done[i]:
                    continue
                try:
                    self._done[i] = self.requests[i].Test(status)
                except MPI.Exception as exc:
                    self._done[i] = True
                    if exc.Get_error_class() in FAILED:
                        self.error_class = exc.Get_error_class()
                        raise PeerFailure(op, self.error_class) from None
                    raise
                if self._done[i] and status.Is_cancelled():
                    cancelled.append(i)
            return all(self._done[i] for i in pending)

        deadline.wait_until(settled, comm=comm, timeout=timeout, op=f"{op} (cancel)")
        for i in cancelled:
            self._done[i] = False
        return sorted(cancelled)

    def restart(self, indices: Sequence[int]) -> None:
        """Start the (persistent) requests at ``indices`` again, in order (after :meth:`cancel`)."""
        start([self.requests[i] for i in indices])


class Alarm:
    """How every survivor learns of a failure at once, without revoking the communicator the
    messages travel on: a duplicate of it (``comm``; collective) with a receive from any source
    posted, which ULFM fails on every rank once it knows of a failed rank, or once a survivor
    revokes the duplicate (:meth:`sound`). A communicator tests it (:meth:`watch`) at every step
    and in every wait; its recovery then sounds it, shrinks it (the survivors' agreement, and
    what they tell each other) and receives what survivors had sent each other on the
    communicator that failed, still open between live ranks, before revoking that one."""

    def __init__(self, comm: MPI.Intracomm, op: str) -> None:
        with raised_as_failure(f"{op} (alarm)"):
            self.comm = comm.Dup()
            self.comm.Set_errhandler(MPI.ERRORS_RETURN)
            self._buf = np.zeros(1, dtype=np.uint8)
            self._ping = Message([self.comm.Irecv(self._buf, source=MPI.ANY_SOURCE, tag=0)])

    def watch(self, op: str) -> None:
        """Raise :class:`PeerFailure` if a rank has failed or a survivor sounded the alarm."""
        # twice: a test makes MPI progress, which may mark the receive as failed only then
        self._ping.test(op)
        self._ping.test(op)

    def sound(self) -> None:
        """Revoke the duplicate: every survivor's next :meth:`watch` raises."""
        try:
            self.comm.Revoke()
        except MPI.Exception:   # another survivor revoked it already
            pass

    def quiesce(self, step: int, share: Any, receive: Callable[[dict[int, Any], set[int]], None], *, timeout: float,
                op: str) -> None:
        """After a failure, before the communicator the messages travel on is revoked (every
        survivor calls it): sound the alarm, shrink it (the survivors agree who they are and
        tell each other ``share``), then ``receive(shared, gone)`` (``shared``: each survivor's
        share by its rank; ``gone``: the ranks lost) receives what survivors sent this rank and
        completes what it sent them; a further failure meanwhile loses what the newly dead had
        in flight too. Returns once every survivor has received (an agreement)."""
        self.sound()
        rec = shrink(self.comm, step, timeout=timeout, op=f"{op} (alarm)", share=share)
        keep(rec.comm)
        try:
            receive(dict(zip(rec.survivors, rec.shared)), set(rec.lost))
        except PeerFailure:
            pass
        agree(rec.comm, True, timeout=timeout, op=f"{op} (received)")

    def keep(self) -> None:
        """After a failure: kept to the end of the process, never freed (see the module)."""
        keep(self.comm, self._buf, *self._ping.requests)

    def free(self) -> None:
        """No failure was met: cancel the receive and free the duplicate."""
        for r in self._ping.requests:
            r.Cancel()
            r.Wait()
        self.comm.Free()


def wait(requests: Message | Sequence[MPI.Request], *, comm: MPI.Intracomm, timeout: float, op: str, peer: Any = None,
         alarm: Alarm | None = None) -> None:
    """:func:`mpigossip.core.deadline.wait` of ``requests`` (a :class:`Message`, or a list of
    requests: persistent ones, whose completion in error must not free them) that raises
    :class:`PeerFailure` when a peer has failed or the communicator was revoked (or ``alarm``,
    an :class:`Alarm`, went off); other MPI errors propagate, a timeout ends the job as always.
    ``peer(pending)`` is called with the indices of the requests still pending."""
    message = requests if isinstance(requests, Message) else Message(requests)

    def done():
        if alarm is not None:
            alarm.watch(op)
        return message.test(op)
    deadline.wait_until(done, comm=comm, timeout=timeout, op=op,
                        peer=(lambda: peer(message.pending())) if callable(peer) else peer)


def test(requests: Sequence[MPI.Request], op: str) -> bool:
    """``MPI_Testall`` of ``requests`` that complete or fail as one (a collective's request):
    whether all have completed; raises :class:`PeerFailure` when a peer has failed or the
    communicator was revoked. Requests whose outcomes matter one by one (a message's parts,
    tested again after a failure) go in a :class:`Message`."""
    with raised_as_failure(op):
        return deadline.testall(requests)


@contextlib.contextmanager
def raised_as_failure(op: str) -> Iterator[None]:
    """MPI calls inside (making or starting requests) that fail because a peer failed or the
    communicator was revoked raise :class:`PeerFailure` instead of ``MPI.Exception``."""
    try:
        yield
    except MPI.Exception as exc:
        if exc.Get_error_class() in FAILED:
            raise PeerFailure(op, exc.Get_error_class()) from None
        raise


def keep(*objects: Any) -> None:
    """Keep MPI objects of a failed communicator (its persistent requests) alive to the end
    of the process: freeing them may end the job (see the module)."""
    _kept.extend(objects)


class Recovery:
    """What :func:`shrink` returns.

    Attributes:
        comm: the survivors' communicator (errors return on it).
        lost: the ranks of the old communicator that failed, sorted.
        survivors: the ranks of the old communicator that survived, in order (``survivors[r]``
            is rank r of ``comm``).
        step: the agreed step (the largest ``step`` any survivor passed).
        shared: what each survivor passed as ``share``, by its rank in ``comm`` (or None).
        seconds: how long the revoke, the shrink and the agreement took.
    """

    def __init__(self, comm: MPI.Comm, lost: list[int], step: int, seconds: float, shared: list[Any] | None = None,
                 survivors: list[int] | None = None) -> None:
        self.comm, self.lost, self.step, self.seconds = comm, lost, step, seconds
        self.shared = shared if shared is not None else []
        self.survivors = survivors if survivors is not None else []

    def __repr__(self):
        return f"<Recovery lost={self.lost} size={self.comm.Get_size()} step={self.step} {self.seconds:.3f} s>"


#: Test hook: ``MPIGOSSIP_CRASH_IN_RECOVERY=R`` makes world rank R die (SIGKILL) in its first
#: recovery, right after the survivors' exchange and before their agreement on it;
#: ``R:exchange``, after the shrink and before the exchange (the others' exchange meets it).
CRASH_IN_RECOVERY = "MPIGOSSIP_CRASH_IN_RECOVERY"


def shrink(comm: MPI.Comm, step: int, *, timeout: float, op: str, share: Any = None) -> Recovery:
    """Collective over the survivors of ``comm``: revoke it, shrink it to the survivors, and
    exchange what the recovery needs: the step (the largest ``step`` passed: a survivor whose
    exchanges with live peers completed may be ahead of one that met the failure) and each
    survivor's ``share`` (a small picklable value: :attr:`Recovery.shared`). ``comm`` itself is
    kept, never freed.

    Ordinary collectives report a failure to some ranks and not to others, so the exchange is
    followed by ``MPI_Comm_agree`` on whether it succeeded everywhere, which answers the same on
    every survivor: if a rank failed meanwhile, every survivor shrinks again and repeats the
    exchange; none goes on with an answer the others lack."""
    start = time.monotonic()
    _seen[0] = True
    original = list(range(comm.Get_size()))  # comm's ranks -> the first communicator's
    lost = []
    while True:
        try:
            comm.Revoke()
        except MPI.Exception:  # already revoked by another survivor
            pass
        with blocking_deadline(timeout, f"{op}: MPI_Comm_shrink did not return within {timeout:g} s"):
            new = comm.Shrink()
        new.Set_errhandler(MPI.ERRORS_RETURN)
        kept = MPI.Group.Translate_ranks(new.Get_group(), list(range(new.Get_size())), comm.Get_group())
        lost += [original[r] for r in sorted(set(range(comm.Get_size())) - set(kept))]
        original = [original[r] for r in kept]
        keep(comm)
        _crash_hook("exchange")
        gathered = None
        try:
            gathered = deadline.allgather(new, (int(step), share), timeout=timeout,
                                          op=f"{op} (the step to go on from)")
        except MPI.Exception as exc:   # another rank failed meanwhile
            if exc.Get_error_class() not in FAILED:
                raise
        _crash_hook("agreement")
        if agree(new, gathered is not None, timeout=timeout, op=op):
            assert gathered is not None   # this rank agreed with True
            _live[0] = new
            return Recovery(new, sorted(lost), max(g[0] for g in gathered), time.monotonic() - start,
                            [g[1] for g in gathered], survivors=original)
        comm = new   # some survivor's exchange failed: shrink again, every survivor alike


def agree(comm: MPI.Comm, ok: bool, *, timeout: float, op: str) -> bool:
    """``MPI_Comm_agree`` of ``ok`` over the live ranks of ``comm``: True if it was true on
    every one of them and none failed before contributing (the same answer on every survivor)."""
    try:
        with blocking_deadline(timeout, f"{op}: MPI_Comm_agree did not return within {timeout:g} s"):
            return bool(comm.Agree(1 if ok else 0))
    except MPI.Exception as exc:
        if exc.Get_error_class() not in FAILED:
            raise
        return False


def _crash_hook(where):
    rank, _, point = os.environ.get(CRASH_IN_RECOVERY, "").partition(":")
    if rank and int(rank) == MPI.COMM_WORLD.Get_rank() and (point or "agreement") == where:
        os.kill(os.getpid(), 9)


def agree_failed(comm: MPI.Comm, failed: bool, *, timeout: float, op: str) -> bool:
    """Collective over the live ranks of ``comm``, revoked or not (ULFM's ``MPI_Comm_agree``):
    whether any of them met a failure (``failed``), or a rank failed before contributing. The
    answer is the same on every survivor, so that all recover at the same step even when some
    completed their exchanges. Blocking, under the same deadline as :func:`shrink`."""
    try:
        with blocking_deadline(timeout, f"{op}: MPI_Comm_agree did not return within {timeout:g} s"):
            return not comm.Agree(0 if failed else 1)
    except MPI.Exception as exc:  # a rank failed before contributing: raised alike on every survivor
        if exc.Get_error_class() not in FAILED:
            raise
        return True


@contextlib.contextmanager
def blocking_deadline(seconds: float, message: str) -> Iterator[None]:
    """End this process (exit 1) with ``message`` and every thread's stack unless the block
    has finished within ``seconds``: for a blocking MPI call that has no deadline of its own."""
    rank = MPI.COMM_WORLD.Get_rank()  # (the timer's thread makes no MPI call)

    def expire():
        sys.stderr.write(f"mpigossip: rank {rank}: {message}; ending this process\n")
        faulthandler.dump_traceback(all_threads=True)
        _leave(1)   # (no drain: this thread makes no MPI call)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def exit(code: int = 0, *, comm: MPI.Comm | None = None, timeout: float = 10.0) -> None:
    """End this process without ``MPI_Finalize`` (after a failure the survivors hang in it
    over TCP): drain, flush the output and leave. Call it at the end of a program that set
    ``on_failure="continue"`` where :func:`seen` is true; elsewhere a normal exit is fine.

    Collective over ``comm`` (by default the live ranks' latest communicator: the last
    shrink's or grow's): a rank leaves only once every rank has entered the exit, so none leaves
    while a message of its last collective is still queued for a peer (the TCP transport writes
    eager messages after the call returns; a process that ends first loses them and the peer
    meets a false failure). The wait is an ``MPI_Ibarrier`` bounded by ``timeout`` seconds; a
    failure in it is ignored (this rank is leaving anyway)."""
    comm = comm if comm is not None else _live[0]
    if comm is not None and comm != MPI.COMM_NULL:
        try:
            request = comm.Ibarrier()
            end = time.monotonic() + timeout
            while not request.Test() and time.monotonic() < end:
                time.sleep(0.001)
        except MPI.Exception:
            pass
    _leave(code)


def _leave(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
