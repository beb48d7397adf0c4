"""The parameter-server algorithms: EASGD and asynchronous (Downpour) SGD."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..core.registry import OPTION_DEFAULTS
from ..onesided.elastic import AsyncSGD as _AsyncWorker
from ..onesided.elastic import ElasticAveraging
from ..onesided.server import ParameterServer
from .base import _Periodic, _Wrapper

if TYPE_CHECKING:
    import torch
    from mpi4py import MPI


class _WithServer(_Wrapper):
    """Wrappers whose groups each have a :class:`ParameterServer` (center = initial parameters)."""

    def _server(self, array):
        server = ParameterServer(array.size, array.dtype, comm=self.comm, servers=self.servers, init=array,
                                 timeout=self.timeout)
        self.servers_.append(server)
        return server

    def center_parameters(self) -> list[np.ndarray]:
        """The center variable, one host array per group."""
        return [s.pull(np.empty(s.size_elements, s.dtype)) for s in self.servers_]

    def _stateful(self):
        return super()._stateful() + self.servers_  # the centers are part of the state

    def free(self) -> None:
        super().free()
        for s in self.servers_:
            s.free()
        self.servers_: list[ParameterServer] = []


class EASGD(_WithServer, _Periodic):
    """Elastic Averaging SGD with the center on ``servers`` ranks (co-located with workers).

    ``beta`` is the center's moving rate; each of the P workers moves by ``beta / P`` (see
    :class:`mpigossip.ElasticAveraging`)."""

    name = "easgd"

    def __init__(self, model: torch.nn.Module, *, comm: MPI.Intracomm, beta: float = OPTION_DEFAULTS["beta"],
                 tau: int = OPTION_DEFAULTS["tau"], servers: int = OPTION_DEFAULTS["servers"],
                 timeout: float | None = None) -> None:
        self.beta, self.tau, self.servers = beta, tau, servers
        self.servers_ = []
        super().__init__(model, comm=comm, timeout=timeout)

    def _make(self, array):
        return self._every(ElasticAveraging(array, self._server(array), beta=self.beta))


class ASGD(_WithServer):
    """Asynchronous (Downpour) SGD: push this step's update to the server, pull the center.

    Each worker pushes ``1/P`` of its local update (P = world size), so that one round of
    P pushes moves the center by the mean update, as AllReduce SGD would; pushing whole
    updates multiplies the effective learning rate by P and diverges at AllReduce's rate.
    """

    name = "asgd"

    def __init__(self, model: torch.nn.Module, *, comm: MPI.Intracomm, servers: int = OPTION_DEFAULTS["servers"],
                 timeout: float | None = None) -> None:
        self.servers, self.servers_ = servers, []
        super().__init__(model, comm=comm, timeout=timeout)

    def _make(self, array):
        return _AsyncWorker(array, self._server(array), share=1.0 / self.comm.Get_size())

    def _step(self):
        for worker in self.comms:
            worker.step()  # center += (x - x_pulled) / P; x = center
