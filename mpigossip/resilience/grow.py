"""Growing back after a failure: the survivors start a replacement for each dead rank, and the
job goes on at its size (#45; this module grows the communicator, :mod:`.heal` the state).

After a failure has shrunk a communicator to its survivors (an averager's ``on_failure=
"continue"``, or :func:`mpigossip.resilience.failures.shrink`), the survivors call
:func:`replace` (collective over them): ``MPI_Comm_spawn`` starts as many processes as died,
running the same program (``argv``, by default this process's own command line), on the slots
the launcher has free; ``MPI_Intercomm_merge`` and ``MPI_Comm_split`` then give one
communicator in which every survivor keeps its rank from before the failure and each newcomer
takes a dead rank's. A newcomer finds itself with :func:`newcomer` and calls :func:`join`,
which returns that same communicator and the ranks the newcomers took. The newcomers' state
then comes from live peers: :mod:`mpigossip.resilience.heal`.

The training job's use of it: ``train --on-failure replace`` (:mod:`mpigossip.train.regrow`).

A spawn that cannot start (the launcher refuses, the program is not found) leaves the
survivors at the smaller size with one warning; a spawn that does not return within the
deadline ends the process with a message naming it (:func:`mpigossip.resilience.failures`'s
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
    """Whether this process was started by :func:`replace` (it has a parent communicator)."""
    return MPI.Comm.Get_parent() != MPI.COMM_NULL


def replace(comm: MPI.Intracomm, lost: list[int], *, argv: list[str] | None = None, timeout: float,
            info: dict[str, str] | None = None, op: str = "grow.replace") -> Grown | None:
    """Collective over the survivors: start one process per lost rank running ``argv``
    (default: this process's command line) and return the grown communicator, or None (one
    warning) if the spawn was refused.

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
    grown = _merge(inter, high=False, key=lambda merged: survivors[comm.Get_rank()], lost=lost,
                   timeout=timeout, op=op)
    return Grown(grown, lost, time.monotonic() - start)


def join(*, timeout: float, op: str = "join") -> tuple[MPI.Intracomm, list[int]]:
    """In a newcomer: merge with the survivors and take a dead rank's number. Returns the grown
    communicator and the ranks the newcomers took."""
    parent = MPI.Comm.Get_parent()
    if parent == MPI.COMM_NULL:
        raise RuntimeError(f"{op}: this process was not started by mpigossip.resilience.grow.replace()")
    parent.Set_errhandler(MPI.ERRORS_RETURN)
    failures.note_recovered()   # (MPI_Finalize would wait for the survivors' disconnect: end with failures.exit)
    lost: list[int] = []

    def key(merged):
        return lost[merged.Get_rank() - (merged.Get_size() - len(lost))]

    grown = _merge(parent, high=True, key=key, lost=lost, timeout=timeout, op=op)
    return grown, sorted(lost)


def _merge(inter: MPI.Intercomm, *, high: bool, key: Any, lost: list[int], timeout: float, op: str) -> MPI.Intracomm:
    """Merge (survivors first), tell the newcomers which ranks they replace (``lost``, filled
    in on a newcomer), and split so that every rank takes ``key(merged)``."""
    with failures.blocking_deadline(timeout, f"{op}: merging with the replacements did not end within {timeout:g} s"):
        merged = inter.Merge(high=high)
        merged.Set_errhandler(MPI.ERRORS_RETURN)
        told = merged.bcast(list(lost) if not high else None, root=0)
        lost[:] = told
        grown = cast(MPI.Intracomm, merged.Split(0, key=key(merged)))
    grown.Set_errhandler(MPI.ERRORS_RETURN)
    failures.keep(merged, inter)
    failures.note_recovered(grown)   # (the live ranks' communicator now: failures.exit drains it)
    return grown
