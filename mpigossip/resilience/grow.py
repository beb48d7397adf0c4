"""Growing back after a failure: the survivors start a replacement for each dead rank, and the
job goes on at its size (#45; this module grows the communicator, :mod:`.heal` the state).

After a failure has shrunk a communicator to its survivors (an averager's ``on_failure=
"continue"``, or :func:`mpigossip.resilience.failures.shrink`), the survivors call
:func:`spawn` (collective over them): ``MPI_Comm_spawn`` starts as many processes as died,
running the same program (``argv``, by default this process's own command line), on the slots
the launcher has free, and returns once they are in ``MPI_Init``. A newcomer finds itself with
:func:`newcomer` and calls :func:`arrive`: it learns the rank it takes (a dead rank's) and the
grown size, so that it can prepare (load its data shard,
build its model) while the survivors go on with their work: the survivors' :class:`Spawned`
says when every newcomer is ready (:meth:`Spawned.ready`, an ``MPI_Ibarrier`` over the
intercommunicator that a newcomer enters in :func:`join`). :meth:`Spawned.merge` (on the
survivors) and :func:`join` (on the newcomers) then give one communicator
(``MPI_Intercomm_merge``, ``MPI_Comm_split``) in which every survivor keeps its rank from
before the failure and each newcomer takes a dead rank's. :func:`replace` is the spawn and the
merge in one call, for a caller with nothing to do meanwhile. The newcomers' state then comes
from live peers: :mod:`mpigossip.resilience.heal`.

The training job's use of it: ``train --on-failure replace`` (:mod:`mpigossip.train.regrow`).

A spawn that cannot start (the launcher refuses, the program is not found) leaves the
survivors at the smaller size with one warning; a spawn or a merge that does not return within
the deadline ends the process with a message naming it (:func:`mpigossip.resilience.failures`'s
timer for a blocking call). Open MPI 5: measured by ``benchmarks/ulfm_respawn.py`` (one node
and the emulated nodes); a connect/accept between two launches hangs there, so spawning is
the way in.
"""

from __future__ import annotations

import sys
import time
import warnings
from typing import Any, cast

from mpi4py import MPI

from ..core import deadline
from . import failures


class Grown:
    """What :func:`replace` returns.

    Attributes:
        comm: the communicator at the size before the failure (errors return on it).
        newcomers: the ranks in ``comm`` the newcomers took (the dead ranks', sorted).
        seconds: how long the spawn, the merge and the split took.
    """

    def __init__(self, comm: MPI.Intracomm, newcomers: list[int], seconds: float) -> None:
        self.comm, self.newcomers, self.seconds = comm, newcomers, seconds

    def __repr__(self):
        return f"<Grown size={self.comm.Get_size()} newcomers={self.newcomers} {self.seconds:.3f} s>"


def newcomer() -> bool:
    """Whether this process was started by :func:`spawn` (it has a parent communicator)."""
    return MPI.Comm.Get_parent() != MPI.COMM_NULL


#: The tags of the messages that tell a newcomer its place, and that the growth is off (on the
#: intercommunicator).
_TAG_PLACE, _TAG_ABANDON = 0x6A01, 0x6A02


class Spawned:
    """The survivors' side of newcomers started and not yet merged (:func:`spawn`).

    Attributes:
        inter: the intercommunicator to the newcomers.
        lost: the ranks the newcomers take, sorted.
        seconds: how long the spawn took.
    """

    def __init__(self, comm: MPI.Intracomm, inter: MPI.Intercomm, lost: list[int], survivors: list[int],
                 seconds: float, told: list[MPI.Request]) -> None:
        self.comm, self.inter, self.lost, self.seconds = comm, inter, lost, seconds
        self._survivors, self._told = survivors, told
        self._ready = inter.Ibarrier()   # a newcomer enters it in join(), once it is ready
        self.merged = False

    def ready(self, op: str = "grow.ready") -> bool:
        """Whether every newcomer is ready to merge (this rank's view; local, never blocks).
        Raises :class:`~mpigossip.resilience.failures.PeerFailure` if a newcomer died."""
        return failures.test([self._ready], op)

    def merge(self, *, timeout: float, op: str = "grow.merge") -> Grown:
        """Collective over the survivors (and :func:`join` on the newcomers): wait until the
        newcomers are ready, then merge with them. Returns the grown communicator."""
        start = time.monotonic()
        failures.wait([self._ready, *self._told], comm=self.comm, timeout=timeout,
                      op=f"{op}: the newcomers' start", peer="the newcomers")
        # the go: a newcomer enters MPI_Intercomm_merge (which it cannot leave early) only now
        failures.wait([self.inter.Ibarrier()], comm=self.comm, timeout=timeout, op=f"{op}: the newcomers",
                      peer="the newcomers")
        self.merged = True
        grown = _merge(self.inter, high=False, key=lambda merged: self._survivors[self.comm.Get_rank()],
                       timeout=timeout, op=op)
        return Grown(grown, self.lost, self.seconds + time.monotonic() - start)

    def abandon(self, timeout: float = 2.0) -> None:
        """Before :meth:`merge` (a failure among the survivors, or newcomers too late): tell every
        newcomer that the growth is off, so that its :func:`join` raises :class:`Abandoned` at
        once instead of at its deadline (after a survivor's death a newcomer also ends on its
        own: the note may go unmatched then). Any survivor may; bounded by ``timeout``; never
        raises."""
        if self.merged:
            return
        note = bytearray(1)
        try:
            requests = [self.inter.Isend([note, MPI.BYTE], dest=i, tag=_TAG_ABANDON) for i in range(len(self.lost))]
            end = time.monotonic() + timeout
            while not deadline.testall(requests) and time.monotonic() < end:
                time.sleep(1e-3)
        except MPI.Exception:
            return
        failures.keep(note, *requests)

    def __repr__(self):
        return f"<Spawned newcomers for {self.lost} {self.seconds:.3f} s>"


def spawn(comm: MPI.Intracomm, lost: list[int], *, argv: list[str] | None = None, timeout: float,
          info: dict[str, str] | None = None, op: str = "grow.spawn") -> Spawned | None:
    """Collective over the survivors: start one process per lost rank running ``argv``
    (default: this process's command line), and tell each (:func:`arrive`) the rank it takes.
    Returns a :class:`Spawned` as soon as the
    newcomers are in ``MPI_Init``, or None (one warning) if the spawn was refused.

    Args:
        comm: the survivors' communicator (``averager.comm`` after a failure, ``Recovery.comm``),
            its ranks in the order they had before the failure.
        lost: the ranks that failed, numbered as before the failure (an averager's
            ``failures[-1]["ranks"]``, ``Recovery.lost``): the newcomers take these.
        info: ``MPI_Comm_spawn``'s info keys (Open MPI: ``host``, ``map_by``, ``bind_to``,
            ...), e.g. ``{"host": "node3", "map_by": ":OVERSUBSCRIBE", "bind_to": "none"}``
            where the launcher still counts the dead ranks' slots as taken (``mpirun`` inside
            a Slurm allocation).
    """
    lost = sorted(int(r) for r in lost)
    if not lost:
        return None
    before = comm.Get_size() + len(lost)
    if len(set(lost)) != len(lost) or lost[0] < 0 or lost[-1] >= before:
        raise ValueError(f"{op}: lost must be distinct ranks below {before}, got {lost}")
    survivors = sorted(set(range(before)) - set(lost))
    argv = list(argv) if argv is not None else [sys.executable, *sys.orig_argv[1:]]
    start = time.monotonic()
    hosts = dict(zip(survivors, deadline.allgather(comm, MPI.Get_processor_name(), timeout=timeout, op=op)))
    try:
        with failures.blocking_deadline(timeout, f"{op}: MPI_Comm_spawn did not return within {timeout:g} s"):
            spawn_info = MPI.Info.Create()
            for key, value in (info or {}).items():
                spawn_info.Set(key, value)
            try:
                inter = comm.Spawn(argv[0], argv[1:], maxprocs=len(lost), info=spawn_info, root=0)
            finally:
                spawn_info.Free()
    except MPI.Exception as exc:
        if comm.Get_rank() == 0:
            warnings.warn(f"{op}: no replacement for rank(s) {lost} ({exc.Get_error_string().strip()}); "
                          f"going on with {comm.Get_size()} ranks", RuntimeWarning, stacklevel=2)
        return None
    inter.Set_errhandler(MPI.ERRORS_RETURN)
    told = []
    if comm.Get_rank() == 0:   # each newcomer's place (eager: the requests complete without the newcomer)
        told = [inter.isend((lost, i, before, hosts), dest=i, tag=_TAG_PLACE) for i in range(len(lost))]
    return Spawned(comm, inter, lost, survivors, time.monotonic() - start, told)


def replace(comm: MPI.Intracomm, lost: list[int], *, argv: list[str] | None = None, timeout: float,
            info: dict[str, str] | None = None, op: str = "grow.replace") -> Grown | None:
    """Collective over the survivors: :func:`spawn`, then :meth:`Spawned.merge` at once.
    Returns the grown communicator, or None (one warning) if the spawn was refused."""
    spawned = spawn(comm, lost, argv=argv, timeout=timeout, info=info, op=op)
    return spawned.merge(timeout=timeout, op=op) if spawned is not None else None


class Abandoned(RuntimeError):
    """In a newcomer (:func:`join`): the survivors gave the growth up (:meth:`Spawned.abandon`)."""


class Arrival:
    """What a newcomer learns from the survivors on arriving (:func:`arrive`).

    Attributes:
        rank: the rank it takes in the grown communicator (a dead rank's).
        size: the grown communicator's size.
        lost: the ranks all the newcomers take.
        local_rank: its index among the grown communicator's ranks on its node (by processor
            name), as :func:`mpigossip.core.nodes.local_rank` will give it: the GPU to pick.
    """

    def __init__(self, parent: MPI.Intercomm, lost: list[int], rank: int, size: int, local_rank: int) -> None:
        self.parent, self.lost, self.rank, self.size, self.local_rank = parent, lost, rank, size, local_rank

    def Get_rank(self) -> int:   # (an Arrival stands in for the communicator until join())
        return self.rank

    def Get_size(self) -> int:
        return self.size

    def __repr__(self):
        return f"<Arrival rank={self.rank} size={self.size} lost={self.lost}>"


def arrive(*, timeout: float, op: str = "grow.arrive") -> Arrival:
    """In a newcomer, first: the place the survivors give it. No collective: the survivors
    go on meanwhile, until :func:`join`."""
    parent = MPI.Comm.Get_parent()
    if parent == MPI.COMM_NULL:
        raise RuntimeError(f"{op}: this process was not started by mpigossip.resilience.grow.spawn()")
    parent.Set_errhandler(MPI.ERRORS_RETURN)
    failures.note_recovered()   # (MPI_Finalize would wait for the survivors' disconnect: end with failures.exit)
    with failures.blocking_deadline(timeout, f"{op}: no word from the survivors within {timeout:g} s"):
        lost, index, size, hosts = parent.recv(source=0, tag=_TAG_PLACE)
    rank, here = int(lost[index]), MPI.Get_processor_name()
    for new, host in zip(lost, deadline.allgather(MPI.COMM_WORLD, here, timeout=timeout, op=op)):
        hosts[new] = host   # (the newcomers' own: they were spawned together)
    local = sorted(r for r, host in hosts.items() if host == here).index(rank)
    return Arrival(parent, list(lost), rank, int(size), local)


def join(arrival: Arrival | None = None, *, timeout: float, op: str = "join") -> tuple[MPI.Intracomm, list[int]]:
    """In a newcomer, once it is ready: tell the survivors so (:meth:`Spawned.ready`), merge
    with them and take its rank. Returns the grown communicator and the ranks the newcomers took."""
    arrival = arrival or arrive(timeout=timeout, op=op)
    parent = arrival.parent

    def done(request):
        def test():
            try:
                if parent.Iprobe(source=MPI.ANY_SOURCE, tag=_TAG_ABANDON):   # (Spawned.abandon: too late)
                    raise Abandoned(f"{op}: the survivors gave this replacement up (a rank failed while it "
                                    f"started, or it was too late); they replace the dead later")
                return failures.test([request], op)
            except (failures.PeerFailure, MPI.Exception) as exc:
                # a rank died before the go: the survivors give the newcomers up whichever step
                # meets the death (regrow.give_up; ReplaceFailed before the merge), so this one
                # ends now, not on their Spawned.abandon note. Measured with Open MPI 5.0.11, a
                # survivor killed here: the probes on ``parent`` raised MPI_ERR_PROC_FAILED and
                # the notes the live survivors had sent went unmatched for 10 s (1 run in 5),
                # and the barrier's schedule ended with MPI_ERR_UNKNOWN (1 in 10), not a failure
                # class: any error of these barriers ends the newcomer (the survivors, were
                # they well, would go on without it after --timeout, one warning).
                raise Abandoned(f"{op}: the survivors gave this replacement up (a rank failed while it started: "
                                f"{exc}); they replace the dead later") from None
        return test
    for what in ("ready", "the go"):   # (Spawned.ready, then Spawned.merge)
        deadline.wait_until(done(parent.Ibarrier()), comm=MPI.COMM_WORLD, timeout=timeout,
                            op=f"{op}: the survivors ({what})", peer="the survivors")
    grown = _merge(parent, high=True, key=lambda merged: arrival.rank, timeout=timeout, op=op)
    return grown, list(arrival.lost)   # (sorted: spawn() sorts them)


def _merge(inter: MPI.Intercomm, *, high: bool, key: Any, timeout: float, op: str) -> MPI.Intracomm:
    """Merge (survivors first) and split so that every rank takes ``key(merged)``."""
    with failures.blocking_deadline(timeout, f"{op}: merging with the replacements did not end within {timeout:g} s"):
        merged = inter.Merge(high=high)
        merged.Set_errhandler(MPI.ERRORS_RETURN)
        grown = cast(MPI.Intracomm, merged.Split(0, key=key(merged)))
    grown.Set_errhandler(MPI.ERRORS_RETURN)
    failures.keep(merged, inter)
    failures.note_recovered(grown)   # (the live ranks' communicator now: failures.exit drains it)
    return grown
