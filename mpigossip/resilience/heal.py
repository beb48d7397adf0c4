"""Healing after growing back: a newcomer gets its state from a live peer (#45, item 2).

After :meth:`mpigossip.resilience.grow.Spawned.merge` (or ``grow.replace``, on the survivors)
and :func:`~mpigossip.resilience.grow.join` (on the newcomers), every rank of the grown
communicator calls one of these, collectively:

- :func:`split` (PushSum, OSGP, AGP): a donor, the survivor with the largest weight, splits its
  ``(x, w)`` in two and sends one half to the newcomer. ``x * 0.5`` and ``x - x * 0.5`` add up
  to ``x`` exactly in floating point, element by element, and so do the weights, so Σx and Σw
  over the ranks are what the survivors held, and ``z = x / w`` is the donor's on both.
- :func:`broadcast` (AllReduce-based and outer methods): the newcomer receives a survivor's
  buffer (the model, an optimizer state flattened), so that every rank holds the same.
- :func:`handover`: a donor's picklable state (a training job's optimizer state, step, clock)
  to its newcomer, its arrays and tensors raw.

:func:`isplit` and :func:`ihandover` are the same with the donor's sends left under way: it gets
a :class:`Sending` (the requests and the copies they read) to :meth:`~Sending.test` while it
trains on (an asynchronous method heals beside training); a newcomer still returns only once it
has received everything.

All three send in pieces of at most :func:`mpigossip.resilience.failures.chunk_bytes` (eagerly:
see there), with the deadline ``timeout``; a peer failing during the heal raises
:class:`~mpigossip.resilience.failures.PeerFailure` on the ranks that meet it. Buffers may be
numpy, cupy or torch (CPU or CUDA), staged through the host where MPI is not CUDA-aware.
The averager is then built again over the grown communicator with the healed ``(x, w)``.
"""

from __future__ import annotations

import copy
import math
import pickle
import sys
from typing import Any

import numpy as np
from mpi4py import MPI

from ..core import buffers, deadline
from . import failures

_TAG_W, _TAG_X = 0x4EA1, 0x4EA2  # a share's weight and its pieces (the receiver posts the pieces first)


def donors(weights: list[Any], newcomers: list[int]) -> dict[int, int]:
    """Which survivor gives each newcomer half its mass: ``{newcomer: donor}``.

    ``weights[r]`` is rank r's weight, or its parameter groups' weights (a list: the smallest
    counts), None for a newcomer. Newcomers are served in rank order, each by the survivor then
    holding the largest weight (the lowest rank among equals), whose weight is halved before the
    next one is chosen: the same answer on every rank."""
    held = {r: float(min(w) if isinstance(w, (list, tuple)) else w) for r, w in enumerate(weights)
            if w is not None and r not in newcomers}
    if not held:
        raise ValueError("no survivor to heal from")
    plan = {}
    for new in sorted(newcomers):
        donor = max(held, key=lambda r: (held[r], -r))
        plan[new] = donor
        held[donor] *= 0.5
    return plan


def rescale(total: float, size: int) -> float:
    """The largest power of two that keeps ``total * scale <= size`` (1 where ``total >= size``).

    Every rank's ``(x, w)`` multiplied by it brings Σw back above half the number of ranks: a
    PushSum-family run's survivors after a failure (which takes the dead rank's weight and what
    was in flight with it: OSGP lost 2.5 of 4 in one kill here) and a grown run at its heal (the
    newcomer's half comes out of a donor). Without it the weights average Σw/n, and SGP, whose
    update moves x by the step, moves z = x/w by the step / w: the learning rate grows by n/Σw
    (OSGP after two replacements: x4, and it diverged to chance, measured). A common factor
    leaves every z and the consensus Σx/Σw unchanged; a power of two leaves them unchanged
    exactly (Σx and Σw exact, scaled). Never down, never past n: AGP, whose rank models are the
    most spread, ended with a worse rank at Σw 5 (rounded to the nearest power) than left at 2.5.
    """
    if not (math.isfinite(total) and 0 < total < size):
        return 1.0
    return 2.0 ** math.floor(math.log2(size / total))


def split(x: Any, weight: Any, *, comm: MPI.Intracomm, newcomers: list[int], timeout: float | None = None,
          stage: bool | None = None, cuda_aware: bool | None = None, op: str = "heal.split") -> Any:
    """Collective over the grown communicator: give each newcomer half of a donor's ``(x, w)``.

    Args:
        x: this rank's PushSum numerator (updated in place: halved on a donor, overwritten on a
            newcomer; the same length and dtype on every rank), or a list of them (parameter
            groups: one donor gives half of every group).
        weight: this rank's PushSum weight, or a list of them (ignored on a newcomer).
        newcomers: the ranks of ``comm`` the newcomers took (``Grown.newcomers``; what
            ``join`` returns on a newcomer): the same list on every rank.
        stage, cuda_aware: as for the communicators (a device buffer staged through the host
            where MPI is not CUDA-aware).

    Returns:
        This rank's weight after the heal (a list for a list).
    """
    timeout = deadline.check_timeout(timeout)
    weights, sending = isplit(x, weight, comm=comm, newcomers=newcomers, timeout=timeout, stage=stage,
                              cuda_aware=cuda_aware, op=op)
    sending.wait(comm=comm, timeout=timeout)
    return weights


def isplit(x: Any, weight: Any, *, comm: MPI.Intracomm, newcomers: list[int], timeout: float | None = None,
           stage: bool | None = None, cuda_aware: bool | None = None,
           op: str = "heal.split") -> tuple[Any, Sending]:
    """:func:`split`, the donor's sends left under way: returns this rank's weight after the heal
    and a :class:`Sending` (empty but on a donor). A donor's ``x`` and weight are halved at once
    (the half it gives travels from a copy: it may go on updating ``x``); a newcomer returns once
    its half has arrived. Until the donor's sends complete, the half is on the wire: Σx and Σw
    over the ranks lack it (as they lack a PushSum message in flight)."""
    timeout = deadline.check_timeout(timeout)
    grouped = isinstance(x, (list, tuple))
    xs, ws = (list(x), [float(w) for w in weight]) if grouped else ([x], [float(weight)])
    rank, news = comm.Get_rank(), sorted(int(r) for r in newcomers)
    new = rank in news
    problem = None
    if len(ws) != len(xs):
        problem = f"{len(xs)} buffers and {len(ws)} weights"
    elif not new and not all(math.isfinite(w) and w > 0 for w in ws):
        problem = f"a survivor's weight must be finite and > 0, got {weight!r}"
    bufs = [buffers.check_buffer(b, comm=comm, op=op, name=f"x[{i}]" if grouped else "x", timeout=timeout,
                                 same={"newcomers": news, "groups": len(xs)}, error=problem)
            for i, b in enumerate(xs)]
    plan = donors(deadline.allgather(comm, None if new else ws, timeout=timeout, op=op), news)
    sending = Sending(op)
    for newcomer, donor in sorted(plan.items()):
        for i, buf in enumerate(bufs):
            if rank == donor:
                array = buf.array
                keep = array * 0.5
                half = array - keep      # keep + half == x exactly (x / 2 is exact, or a subnormal's rounding)
                array[...] = keep
                kept = ws[i] * 0.5
                transport = buffers.Transport(half, stage=stage, cuda_aware=cuda_aware)
                transport.before_send()
                header = np.array([ws[i] - kept])
                sending.add(_isend(header, transport.spec, comm=comm, dest=newcomer, op=op),
                            newcomer, (header, half, transport))
                ws[i] = kept
            elif rank == newcomer:
                transport = buffers.Transport(buf, stage=stage, cuda_aware=cuda_aware)
                w = np.empty(1)
                _recv(w, transport.spec, comm=comm, source=donor, timeout=timeout, op=op)
                transport.after_recv()
                buf.synchronize()
                ws[i] = float(w[0])
    return (ws if grouped else ws[0]), sending


class Sending:
    """A donor's sends under way to its newcomers (:func:`isplit`, :func:`ihandover`): owns
    their requests and the buffers they read (copies: the donor may go on changing its own).

    ``test()`` after each step of the donor's training; ``wait()`` where it must be done. A
    newcomer that failed makes them raise :class:`~mpigossip.resilience.failures.PeerFailure`;
    :meth:`keep` then keeps the requests and buffers alive to the end of the process (freeing
    those of a failed peer may end the job)."""

    def __init__(self, op: str = "heal") -> None:
        self.op = op
        self.message = failures.Message()
        self.newcomers: list[int] = []
        self._held: list = []

    def add(self, requests: list, newcomer: int, held: Any = None) -> None:
        """Requests just started to ``newcomer``, and what they read."""
        self.message.extend(requests)
        if newcomer not in self.newcomers:
            self.newcomers.append(newcomer)
        self._held.append(held)

    def extend(self, other: Sending) -> Sending:
        """``other``'s sends (none tested yet) made part of these, ``other`` left empty; returns
        self."""
        self.message.extend(other.message.requests)
        self._held.extend(other._held)
        self.newcomers += [n for n in other.newcomers if n not in self.newcomers]
        other.message, other._held, other.newcomers = failures.Message(), [], []
        return self

    def __bool__(self) -> bool:
        """Whether there are sends (done or not): a donor's."""
        return bool(self.message.requests)

    def test(self) -> bool:
        """Whether every send has completed (then the buffers are let go); never blocks."""
        done = self.message.test(self.op)
        if done:
            self._held = []
        return done

    def wait(self, *, comm: MPI.Intracomm, timeout: float | None) -> None:
        """Until every send has completed (the deadline ``timeout``)."""
        if self.message.requests:
            failures.wait(self.message, comm=comm, timeout=deadline.check_timeout(timeout), op=self.op,
                          peer=f"{self.newcomers} (newcomers)")
        self._held = []

    def keep(self) -> None:
        """A peer failed: keep the requests and their buffers to the end of the process."""
        failures.keep(self.message.requests, self._held)


class _Array:
    """Where an array stood in a handed-over state: the ``index``-th of the arrays sent raw after
    the state's pickled skeleton, with what rebuilds it (``torch``: a torch tensor of ``dtype``
    and ``shape`` on a device of type ``device``; else a numpy array)."""

    __slots__ = ("index", "dtype", "shape", "torch", "device")

    def __init__(self, index: int, dtype: Any, shape: tuple, torch: bool, device: str | None) -> None:
        self.index, self.dtype, self.shape, self.torch, self.device = index, dtype, shape, torch, device

    def __getstate__(self) -> tuple:
        return (self.index, self.dtype, self.shape, self.torch, self.device)

    def __setstate__(self, state: tuple) -> None:
        self.index, self.dtype, self.shape, self.torch, self.device = state


def _skeleton(obj: Any, arrays: list, copy_all: bool = False) -> Any:
    """``obj`` with every numpy array and torch tensor in its dicts, lists and tuples replaced by
    an :class:`_Array`, their bytes (host memory, contiguous, only the elements each one views;
    with ``copy_all``, copies of them) appended to ``arrays``."""
    torch = sys.modules.get("torch")
    if isinstance(obj, dict):
        new = copy.copy(obj)   # (its type and attributes: a state_dict's _metadata)
        for k, v in obj.items():
            new[k] = _skeleton(v, arrays, copy_all)
        return new
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(_skeleton(v, arrays, copy_all) for v in obj)
    if torch is not None and isinstance(obj, torch.Tensor):
        t = obj.detach()
        device = t.device.type
        t = t.cpu().contiguous().reshape(-1)
        raw = t.view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8)
        arrays.append(raw.copy() if copy_all and device == "cpu" else raw)   # (.cpu() of a device tensor copies)
        return _Array(len(arrays) - 1, str(obj.dtype).removeprefix("torch."), tuple(obj.shape), True, device)
    if isinstance(obj, np.ndarray) and obj.dtype != object:
        raw = np.ascontiguousarray(obj).reshape(-1).view(np.uint8)
        arrays.append(raw.copy() if copy_all else raw)
        return _Array(len(arrays) - 1, obj.dtype, obj.shape, False, None)   # (a structured dtype keeps its fields)
    return obj


def _rebuilt(obj: Any, arrays: list) -> Any:
    """What :func:`_skeleton` took apart, with ``arrays`` (the bytes received) put back."""
    if isinstance(obj, dict):
        new = copy.copy(obj)
        for k, v in obj.items():
            new[k] = _rebuilt(v, arrays)
        return new
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(_rebuilt(v, arrays) for v in obj)
    if isinstance(obj, _Array):
        raw = arrays[obj.index]
        if not obj.torch:
            return raw.view(obj.dtype).reshape(obj.shape)
        torch = _torch()
        dtype = getattr(torch, obj.dtype)
        t = torch.from_numpy(raw).view(dtype).reshape(obj.shape) if raw.size else torch.empty(obj.shape, dtype=dtype)
        return t if obj.device == "cpu" else t.to(obj.device)
    return obj


def handover(obj: Any, *, comm: MPI.Intracomm, plan: dict[int, int], timeout: float | None = None,
             op: str = "heal.handover") -> Any:
    """Collective over the grown communicator: each donor of ``plan`` (``{newcomer: donor}``, as
    :func:`donors` gives) sends ``obj`` (picklable: a state dict with its tensors) to its
    newcomer. Returns what a newcomer received, ``obj`` elsewhere.

    The numpy arrays and torch tensors in ``obj``'s dicts, lists and tuples travel raw, in
    pieces, after a pickled skeleton of the rest: each one's own elements only (pickled, a
    tensor viewing part of a larger storage, as a model's parameters over one flat buffer do,
    carried the whole storage: a 97 MB model's six parameters had pickled to 609 MB), with no
    copy of a host array on the donor. A newcomer gets host tensors, and device tensors on its
    current device of the same type."""
    timeout = deadline.check_timeout(timeout)
    obj, sending = _handover(obj, comm=comm, plan=plan, timeout=timeout, op=op, copy_all=False)
    sending.wait(comm=comm, timeout=timeout)
    return obj


def ihandover(obj: Any, *, comm: MPI.Intracomm, plan: dict[int, int], timeout: float | None = None,
              op: str = "heal.handover") -> tuple[Any, Sending]:
    """:func:`handover`, the donor's sends left under way: returns what :func:`handover` returns
    and a :class:`Sending` (empty but on a donor). A donor sends copies of its arrays and tensors
    (it may go on changing them: an optimizer's state as it trains); a newcomer returns once it
    has received everything."""
    return _handover(obj, comm=comm, plan=plan, timeout=deadline.check_timeout(timeout), op=op, copy_all=True)


def _handover(obj: Any, *, comm: MPI.Intracomm, plan: dict[int, int], timeout: float, op: str,
              copy_all: bool) -> tuple[Any, Sending]:
    rank = comm.Get_rank()
    sending = Sending(op)
    for newcomer, donor in sorted(plan.items()):
        if rank == donor:
            arrays: list = []
            skeleton = pickle.dumps(_skeleton(obj, arrays, copy_all), protocol=pickle.HIGHEST_PROTOCOL)
            data = np.frombuffer(skeleton, dtype=np.uint8)
            size = np.array([data.size], dtype=np.int64)
            sending.add(_isend(size, [data, MPI.BYTE], comm=comm, dest=newcomer, op=op), newcomer, (size, data))
            sending.add(_isend(None, [[a, MPI.BYTE] for a in arrays], comm=comm, dest=newcomer, op=op), newcomer,
                        arrays)
        elif rank == newcomer:
            size = np.empty(1, dtype=np.int64)
            _recv(size, None, comm=comm, source=donor, timeout=timeout, op=op)   # (the size, then the pieces)
            data = np.empty(int(size[0]), dtype=np.uint8)
            _recv(None, [data, MPI.BYTE], comm=comm, source=donor, timeout=timeout, op=op)
            skeleton = pickle.loads(data.tobytes())
            places: list = []
            _collect(skeleton, places)
            arrays = [np.empty(_nbytes(a), dtype=np.uint8) for a in sorted(places, key=lambda a: a.index)]
            _recv(None, [[a, MPI.BYTE] for a in arrays], comm=comm, source=donor, timeout=timeout, op=op)
            obj = _rebuilt(skeleton, arrays)
    return obj, sending


def _torch() -> Any:
    """torch, which a state holding tensors was made with (this layer does not import it)."""
    torch = sys.modules.get("torch")
    if torch is None:
        raise RuntimeError("heal.handover: the state handed over holds torch tensors; import torch first")
    return torch


def _collect(obj: Any, places: list) -> None:
    """Every :class:`_Array` in a skeleton."""
    if isinstance(obj, dict):
        for v in obj.values():
            _collect(v, places)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _collect(v, places)
    elif isinstance(obj, _Array):
        places.append(obj)


def _nbytes(place: _Array) -> int:
    if place.torch:
        torch = _torch()
        itemsize = torch.empty(0, dtype=getattr(torch, place.dtype)).element_size()
    else:
        itemsize = np.dtype(place.dtype).itemsize
    return itemsize * math.prod(place.shape)


def broadcast(x: Any, *, comm: MPI.Intracomm, root: int = 0, timeout: float | None = None,
              stage: bool | None = None, cuda_aware: bool | None = None, op: str = "heal.broadcast") -> None:
    """Collective over the grown communicator: every rank's ``x`` becomes ``root``'s (a
    survivor's), in pieces (same length and dtype on every rank)."""
    timeout = deadline.check_timeout(timeout)
    problem = None if 0 <= root < comm.Get_size() else f"root must be a rank below {comm.Get_size()}, got {root!r}"
    buf = buffers.check_buffer(x, comm=comm, op=op, name="x", timeout=timeout, same={"root": root}, error=problem)
    transport = buffers.Transport(buf, stage=stage, cuda_aware=cuda_aware)
    if comm.Get_rank() == root:
        transport.before_send()
    memory = transport.memory
    with failures.raised_as_failure(op):
        requests = [comm.Ibcast(piece, root=root) for piece in failures.pieces([memory, buf.datatype])]
    failures.wait(requests, comm=comm, timeout=timeout, op=op, peer=f"{root} (the heal's root)")
    if comm.Get_rank() != root:
        transport.after_recv()
        buf.synchronize()


def _specs(spec):
    """One spec, or a list of specs (``[[array, datatype], ...]``), as a list."""
    if not spec:
        return []
    return list(spec) if isinstance(spec[0], (list, tuple)) else [spec]


def _isend(header, spec, *, comm, dest, op):
    """Start sending a one-element ``header`` (a share's weight, a state's size; or None) and
    ``spec`` (or a list of specs) in pieces to ``dest``; returns the requests."""
    with failures.raised_as_failure(op):
        requests = [comm.Isend(header, dest=dest, tag=_TAG_W)] if header is not None else []
        requests += [comm.Isend(piece, dest=dest, tag=_TAG_X) for one in _specs(spec) if len(one[0])
                     for piece in failures.pieces(one)]
    return requests


def _recv(header, spec, *, comm, source, timeout, op):
    """What :func:`_isend` sent: ``spec``'s pieces (posted first: none arrives unexpected) and the
    ``header``, either of them None to receive only the other."""
    with failures.raised_as_failure(op):
        requests = [comm.Irecv(piece, source=source, tag=_TAG_X) for one in _specs(spec) if len(one[0])
                    for piece in failures.pieces(one)] if spec else []
        if header is not None:
            requests.append(comm.Irecv(header, source=source, tag=_TAG_W))
    failures.wait(requests, comm=comm, timeout=timeout, op=op, peer=f"{source} (the donor)")
