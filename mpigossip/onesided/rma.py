"""One-sided transfers cut into pieces that every transport moves at the link's pace.

Open MPI 5's one-sided component over its TCP transport (osc/rdma with TCP as an
"alternate" BTL, the path across nodes without an RDMA fabric) moves a ``Get`` larger than
the transport's fragment (``btl_tcp_max_send_size``, 128 KiB by default) at about half the
link's rate; the same bytes requested as pieces below that size move at the link's rate
(docs/RESULTS.md, "One-sided transfers in pieces"). Every ``Rget``/``Rput``/``Raccumulate``
of a model in mpigossip therefore goes through the helpers here, which post one request per
piece of at most :func:`chunk_bytes` bytes. Accumulates stay atomic per element, as MPI
defines them, so cutting them changes nothing but the number of requests.

``$MPIGOSSIP_RMA_CHUNK_BYTES`` sets the piece size (``0``: one request per transfer, for a
fabric whose one-sided operations prefer large messages); the default is half of Open MPI's
``btl_tcp_max_send_size`` when it is set in the environment, else 64 KiB.

Every one-sided communicator opens its window with :func:`allocate`, which also says once
(rank 0, a ``RuntimeWarning``) when the window spans nodes while Open MPI's TCP progress
thread is off (:mod:`mpigossip.onesided.progress`).
"""

import functools
import os
import sys
import warnings

from mpi4py import MPI

from ..core import nodes
from . import progress

#: Environment variable holding the piece size in bytes (0: do not cut).
CHUNK_ENV = "MPIGOSSIP_RMA_CHUNK_BYTES"
_DEFAULT_CHUNK = 64 * 1024


@functools.cache
def chunk_bytes():
    """The largest piece of one one-sided request, in bytes (0: transfers are not cut)."""
    value = os.environ.get(CHUNK_ENV, "").strip()
    if value:
        try:
            size = int(value)
        except ValueError:
            raise ValueError(f"{CHUNK_ENV}={value!r} is not a whole number of bytes") from None
        if size < 0:
            raise ValueError(f"{CHUNK_ENV}={value!r} must be >= 0")
        return size
    fragment = os.environ.get("OMPI_MCA_btl_tcp_max_send_size", "").strip()
    if fragment.isdigit() and int(fragment) >= 2:
        return int(fragment) // 2
    return _DEFAULT_CHUNK


_warned = False


def progress_warning(comm, what):
    """Collective: the warning text for a one-sided ``what`` on ``comm`` when its windows span
    nodes with Open MPI's TCP progress thread left unset, else None."""
    if "Open MPI" not in MPI.Get_library_version() or progress.is_set():
        return None
    if not nodes.spans_nodes(comm):
        return None
    return (f"{what}: one-sided windows across nodes with Open MPI's TCP progress thread off: over TCP a rank that "
            f"computes stalls every exchange aimed at it. {progress.VARIABLE}=1 turns the thread on (python -m "
            f"mpigossip launch --progress-thread on; train and compare do it when each rank has a core), =0 "
            f"silences this")


def _outside_package():
    """The ``stacklevel`` of the first caller outside mpigossip (the user's line)."""
    package = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package + os.sep):
        frame, level = frame.f_back, level + 1
    return level


def allocate(comm, nbytes, itemsize, *, what):
    """Collective: ``MPI.Win.Allocate(nbytes, itemsize, comm=comm)`` for the one-sided
    communicator named ``what``, warning once per process (on rank 0) when it runs across
    nodes without progress (:func:`progress_warning`)."""
    global _warned
    text = progress_warning(comm, what)   # collective on every call: ranks may differ in _warned
    if text and comm.Get_rank() == 0 and not _warned:
        _warned = True
        warnings.warn(text, RuntimeWarning, stacklevel=_outside_package())
    return MPI.Win.Allocate(nbytes, itemsize, comm=comm)


def pieces(count, itemsize):
    """``(lo, hi)`` element ranges covering ``range(count)``, each at most one piece long."""
    limit = chunk_bytes()
    step = count if limit == 0 else max(1, limit // itemsize)
    return [(lo, min(lo + step, count)) for lo in range(0, count, step)] if count else []


def rget(win, out, datatype, target):
    """``Rget`` of ``len(out)`` elements from the start of ``target``'s window, in pieces.

    Returns the list of requests (complete them all before reading ``out``)."""
    return [win.Rget([out[lo:hi], datatype], target, target=(lo, hi - lo, datatype))
            for lo, hi in pieces(len(out), out.dtype.itemsize)]


def rput(win, data, datatype, target):
    """``Rput`` of ``data`` to the start of ``target``'s window, in pieces."""
    return [win.Rput([data[lo:hi], datatype], target, target=(lo, hi - lo, datatype))
            for lo, hi in pieces(len(data), data.dtype.itemsize)]


def raccumulate(win, data, datatype, target, op=MPI.SUM):
    """``Raccumulate`` of ``data`` into the start of ``target``'s window, in pieces (each
    element still updated atomically)."""
    return [win.Raccumulate([data[lo:hi], datatype], target, target=(lo, hi - lo, datatype), op=op)
            for lo, hi in pieces(len(data), data.dtype.itemsize)]


def rget_accumulate(win, origin, out, datatype, target, op=MPI.NO_OP):
    """``Rget_accumulate`` (``NO_OP``: an atomic read) of ``len(out)`` elements, in pieces.
    ``origin`` is at least as long as the largest piece (Open MPI takes the count from it)."""
    return [win.Rget_accumulate([origin[:hi - lo], datatype], [out[lo:hi], datatype], target,
                                target=(lo, hi - lo, datatype), op=op)
            for lo, hi in pieces(len(out), out.dtype.itemsize)]
