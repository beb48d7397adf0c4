"""Workers of the parameter server: Elastic Averaging SGD and asynchronous (Downpour) SGD."""

import numbers

from . import buffers, kernels
from ._registry import OPTION_DEFAULTS
from .server import ParameterServer


def _check_worker(x, server, name):
    if not isinstance(server, ParameterServer):
        raise TypeError(f"{name}: server must be a ParameterServer, got {server!r}")
    buf = buffers.as_buffer(x, name="x")
    if buf.size != server.size_elements or buf.dtype != server.dtype:
        raise ValueError(f"{name}: x has {buf.size} x {buf.dtype}, the server holds "
                         f"{server.size_elements} x {server.dtype}")
    return buf


class _Worker:
    """Workers own no MPI object (the server does); ``free()`` drops their scratch memory."""

    def free(self):
        self._center = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()


class ElasticAveraging(_Worker):
    """EASGD worker: every ``tau`` steps, ``u = alpha * (x - center)``; ``center += u``; ``x -= u``.

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
        tau: communication period in steps (>= 1).
        workers: how many workers exchange with the center (default: every rank of the
            server's communicator, i.e. co-located servers; pass ``size - servers`` when
            the server ranks are dedicated).
    """

    def __init__(self, x, server, *, beta=OPTION_DEFAULTS["beta"], tau=OPTION_DEFAULTS["tau"], workers=None):
        if isinstance(beta, bool) or not isinstance(beta, numbers.Real) or not 0 < beta <= 1:
            raise ValueError(f"ElasticAveraging: beta must be in (0, 1], got {beta!r}")
        if isinstance(tau, bool) or not isinstance(tau, int) or tau < 1:
            raise ValueError(f"ElasticAveraging: tau must be an integer >= 1, got {tau!r}")
        self.buffer = _check_worker(x, server, "ElasticAveraging")
        if workers is None:
            workers = server.size
        if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= server.size:
            raise ValueError(f"ElasticAveraging: workers must be an integer in [1, {server.size}], got {workers!r}")
        self.server, self.beta, self.tau, self.workers = server, float(beta), tau, workers
        self.alpha = self.beta / workers
        self._center = buffers.scratch(self.buffer)  # pulled center, then u, in place
        self.calls = 0
        self.exchanges = 0

    def step(self):
        """Count one local step; every ``tau``-th call do the elastic exchange. Returns
        whether it did."""
        self.calls += 1
        if self.calls % self.tau:
            return False
        self.exchange()
        return True

    def exchange(self):
        """Pull the center, move both toward each other by ``alpha * (x - center)``."""
        center = self._center.array
        self.server.pull(center)
        self.buffer.acquire()  # the user's pending writes to x come first
        kernels.elastic(self.buffer.array, center, self.alpha)  # center now holds u
        self.server.push(center)  # waits for the kernel (device-to-host copy)
        self.buffer.release()
        self.exchanges += 1

    def __repr__(self):
        return (f"<ElasticAveraging beta={self.beta} alpha={self.alpha:.6g} workers={self.workers} "
                f"tau={self.tau} steps={self.calls} exchanges={self.exchanges} {self.server!r}>")


class AsyncSGD(_Worker):
    """Downpour-style asynchronous SGD worker: push an update, pull the center into ``x``.

    ``step(delta)`` does ``center += delta`` (e.g. ``delta = -lr * grad``) and then
    ``x = center``.
    """

    def __init__(self, x, server):
        self.buffer = _check_worker(x, server, "AsyncSGD")
        self.server = server
        self.steps = 0

    def step(self, delta):
        self.server.push(delta)
        self.server.pull(self.buffer.obj)
        self.steps += 1

    def __repr__(self):
        return f"<AsyncSGD steps={self.steps} {self.server!r}>"
