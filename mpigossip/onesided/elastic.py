"""Workers of the parameter server: Elastic Averaging SGD and asynchronous (Downpour) SGD."""

from __future__ import annotations

import numbers
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np

from ..core import buffers, kernels
from ..core.base import Steps
from ..core.checks import check_integer
from ..core.periodic import new_with_tau
from ..core.registry import OPTION_DEFAULTS
from .server import ParameterServer

if TYPE_CHECKING:
    from ..core.hints import Buffer


def _check_worker(x, server, name):
    if not isinstance(server, ParameterServer):
        raise TypeError(f"{name}: server must be a ParameterServer, got {server!r}")
    buf = buffers.as_buffer(x, name="x")
    if buf.size != server.size_elements or buf.dtype != server.dtype:
        raise ValueError(f"{name}: x has {buf.size} x {buf.dtype}, the server holds "
                         f"{server.size_elements} x {server.dtype}")
    return buf


class _Worker(Steps):
    """Workers own no MPI object (the server does); ``free()`` drops their scratch memory.
    Their steps are one-sided: no collective, no message in flight afterwards."""

    _closed = False
    server: ParameterServer
    buffer: Any   # a buffers.Buffer
    _center: Any = None

    @property
    def closed(self) -> bool:
        return self._closed or self.server.closed

    def _check_open(self):
        if self._closed:
            raise RuntimeError(f"{self._name} has been freed")
        self.server._check_open()

    def free(self) -> None:
        self._center = None
        self._closed = True


class ElasticAveraging(_Worker):
    """EASGD worker: each step, ``u = alpha * (x - center)``; ``center += u``; ``x -= u``
    (every ``tau`` steps: ``mpigossip.Every(ElasticAveraging(...), tau)``).

    ``alpha = beta / workers`` is each worker's elastic rate, as in the EASGD paper
    (Zhang et al. 2015: ``alpha = beta / p``): ``beta`` is the moving rate of the center
    when all ``workers`` exchange. With a fixed per-worker rate the asynchronous method is
    unstable as soon as workers overlap: if all ``p`` pull the same center and push, the
    center's distance to the workers' mean is multiplied by ``1 - (p + 1) * alpha`` per
    round, which diverges for ``alpha >= 2 / (p + 1)`` (0.5 at 4 workers); ``beta <= 1``
    keeps it below 1 at every ``p``.

    The exchange moves mass: ``x + center`` is unchanged by it. Purely local setup (no
    collective): workers may join and run at their own pace.

    Args:
        x: this worker's parameters (numpy/cupy/torch), updated in place.
        server: the :class:`ParameterServer` holding the center.
        beta: the center's moving rate in (0, 1] (0.9, as in the EASGD paper).
        tau: deprecated: ``tau=k`` > 1 returns ``mpigossip.Every(ElasticAveraging(...), k)``,
            with a ``DeprecationWarning``.
        workers: how many workers exchange with the center (default: every rank of the
            server's communicator, i.e. co-located servers; pass ``size - servers`` when
            the server ranks are dedicated).
    """

    _name = "ElasticAveraging"
    alpha: float
    _renamed = {"calls": "steps", "exchanges": "steps"}  # deprecated (one counter: steps)

    def __new__(cls, *args, tau=1, **kwargs):
        return new_with_tau(cls, super(), args, kwargs, tau)

    def __init__(self, x: Buffer, server: ParameterServer, *, beta: float = OPTION_DEFAULTS["beta"], tau: int = 1,
                 workers: int | None = None) -> None:
        if isinstance(beta, bool) or not isinstance(beta, numbers.Real) or not 0 < beta <= 1:
            raise ValueError(f"ElasticAveraging: beta must be in (0, 1], got {beta!r}")
        check_integer(tau, "tau", 1, owner="ElasticAveraging")
        self.buffer = _check_worker(x, server, "ElasticAveraging")
        if workers is None:
            workers = server.size
        check_integer(workers, "workers", 1, server.size, owner="ElasticAveraging")
        self.server, self.beta, self.workers = server, float(beta), workers
        self.alpha = self.beta / workers
        self._center = buffers.scratch(self.buffer)  # pulled center, then u, in place
        self.steps = 0

    def step(self) -> None:
        """The elastic exchange: pull the center, move both toward each other by
        ``alpha * (x - center)``."""
        self._check_open()
        center = self._center.array
        if not self.buffer.on_device and self.server.atomicity == "lock":
            self._exchange_per_shard()
            return
        self.server.pull(center)
        self.buffer.acquire()  # the user's pending writes to x come first
        kernels.elastic(self.buffer.array, center, self.alpha)  # center now holds u
        self.server.push(center)  # waits for the kernel (device-to-host copy)
        self.buffer.release()
        self.steps += 1

    def _exchange_per_shard(self):
        """Host buffers, lock mode: the exchange as one read-modify-write per shard of the
        center (``server.update``): one get and one put of the model instead of pull, get, put."""
        x, alpha = self.buffer.array, self.alpha

        def move(lo, hi, shard):
            u = self._center.array[lo:hi]
            np.copyto(u, shard)
            kernels.elastic(x[lo:hi], u, alpha)     # u = alpha (x - center); x -= u
            kernels.weighted_sum(shard, shard, 1.0, [u], [1.0])   # center += u
        self.buffer.acquire()
        self.server.update(move)
        self.buffer.release()
        self.steps += 1

    def __repr__(self):
        return (f"<ElasticAveraging beta={self.beta} alpha={self.alpha:.6g} workers={self.workers} "
                f"steps={self.steps} {self.server!r}>")


class AsyncSGD(_Worker):
    """Downpour-style asynchronous SGD worker: push the local update, pull the center into ``x``.

    The caller updates ``x`` locally (its optimizer step); ``step()`` pushes ``share`` times
    what ``x`` moved since the last pull, ``center += share * (x - x_pulled)``, then pulls
    ``x = center``. With ``share = 1 / P`` (P workers) one round of P pushes moves the center
    by the mean update, as AllReduce SGD would; whole updates (``share=1``) multiply the
    effective learning rate by P. Memory: two scratch copies of ``x``.

    Args:
        x: this worker's parameters (numpy/cupy/torch), updated in place.
        server: the :class:`ParameterServer` holding the center.
        share: the part of the local update pushed, in (0, 1] (default 1).
    """

    _name = "AsyncSGD"
    share: float
    _pulled: Any   # buffers.Buffer scratch
    _delta: Any

    def __init__(self, x: Buffer, server: ParameterServer, *, share: float = 1.0) -> None:
        if isinstance(share, bool) or not isinstance(share, numbers.Real) or not 0 < share <= 1:
            raise ValueError(f"AsyncSGD: share must be in (0, 1], got {share!r}")
        self.buffer = _check_worker(x, server, "AsyncSGD")
        self.server, self.share = server, float(share)
        self._pulled = buffers.scratch(self.buffer)  # x as last pulled (the start: x itself)
        self._delta = buffers.scratch(self.buffer)
        self.buffer.acquire()
        kernels.weighted_sum(self._pulled.array, self.buffer.array, 1.0)
        self.buffer.release()
        self.steps = 0

    def step(self, delta: Buffer | None = None) -> None:
        """``center += share * (x - x_pulled)``, then ``x = center``. (``step(delta)``, deprecated:
        push ``delta`` itself.)"""
        self._check_open()
        x = self.buffer.array
        self.buffer.acquire()  # the user's pending writes to x come first
        if delta is not None:
            warnings.warn("AsyncSGD.step(delta) is deprecated: update x, then call step()", DeprecationWarning,
                          stacklevel=2)
            self.server.push(delta)
        elif not self.buffer.on_device and self.server.atomicity == "lock":
            self.server.update(self._push_pull)   # one get and one put per shard, not get, put, get
            self.buffer.release()
            self.steps += 1
            return
        else:
            kernels.weighted_sum(self._delta.array, x, self.share, [self._pulled.array], [-self.share])
            self.server.push(self._delta.array)  # waits for the kernel (device-to-host copy)
        self.server.pull(self.buffer.obj)
        kernels.weighted_sum(self._pulled.array, x, 1.0)
        self.buffer.release()
        self.steps += 1

    def _push_pull(self, lo, hi, shard):
        """One shard of a host step in lock mode: ``shard += share * (x - x_pulled)``, then
        ``x = x_pulled = shard`` (the center with this push in it)."""
        x, pulled, delta = self.buffer.array[lo:hi], self._pulled.array[lo:hi], self._delta.array[lo:hi]
        kernels.weighted_sum(delta, x, self.share, [pulled], [-self.share])
        kernels.weighted_sum(shard, shard, 1.0, [delta], [1.0])
        np.copyto(x, shard)
        np.copyto(pulled, shard)

    def _load_state(self, state):
        """``x`` is restored first (it is the caller's: a checkpoint holds x as last pulled):
        pushes go on from it."""
        self.buffer.acquire()
        kernels.weighted_sum(self._pulled.array, self.buffer.array, 1.0)
        self.buffer.release()

    def free(self) -> None:
        self._pulled = self._delta = None
        super().free()

    def __repr__(self):
        return f"<AsyncSGD share={self.share:g} steps={self.steps} {self.server!r}>"
