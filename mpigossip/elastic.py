"""Workers of the parameter server: Elastic Averaging SGD and asynchronous (Downpour) SGD."""

import numbers

from . import buffers, kernels
from ._base import Steps
from ._checks import check_integer
from ._registry import OPTION_DEFAULTS
from .periodic import new_with_tau
from .server import ParameterServer


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

    @property
    def closed(self):
        return self._closed or self.server.closed

    def _check_open(self):
        if self._closed:
            raise RuntimeError(f"{self._name} has been freed")
        self.server._check_open()

    def free(self):
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
    _renamed = {"calls": "steps", "exchanges": "steps"}

    def __new__(cls, *args, tau=1, **kwargs):
        return new_with_tau(cls, super(), args, kwargs, tau)

    def __init__(self, x, server, *, beta=OPTION_DEFAULTS["beta"], tau=1, workers=None):
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

    def step(self):
        """The elastic exchange: pull the center, move both toward each other by
        ``alpha * (x - center)``."""
        self._check_open()
        center = self._center.array
        self.server.pull(center)
        self.buffer.acquire()  # the user's pending writes to x come first
        kernels.elastic(self.buffer.array, center, self.alpha)  # center now holds u
        self.server.push(center)  # waits for the kernel (device-to-host copy)
        self.buffer.release()
        self.steps += 1

    def exchange(self):
        """The elastic exchange (:meth:`step`)."""
        self.step()

    def __repr__(self):
        return (f"<ElasticAveraging beta={self.beta} alpha={self.alpha:.6g} workers={self.workers} "
                f"steps={self.steps} {self.server!r}>")


class AsyncSGD(_Worker):
    """Downpour-style asynchronous SGD worker: push an update, pull the center into ``x``.

    ``step(delta)`` does ``center += delta`` (e.g. ``delta = -lr * grad``) and then
    ``x = center``.
    """

    _name = "AsyncSGD"

    def __init__(self, x, server):
        self.buffer = _check_worker(x, server, "AsyncSGD")
        self.server = server
        self.steps = 0

    def step(self, delta):
        """``center += delta``, then ``x = center``."""
        self._check_open()
        self.server.push(delta)
        self.server.pull(self.buffer.obj)
        self.steps += 1

    def __repr__(self):
        return f"<AsyncSGD steps={self.steps} {self.server!r}>"
