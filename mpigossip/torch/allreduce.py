"""AllReduce SGD: exact averaging of the parameters after each step."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..core.registry import PARAMS_WIRE_REFUSED
from ..exact.allreduce import AllreduceAverager
from .base import _Wrapper

if TYPE_CHECKING:
    import torch
    from mpi4py import MPI


class AllReduce(_Wrapper):
    """AllReduce SGD by parameter averaging (``"allreduce-params"``): after each local
    update, every rank takes the exact mean of the parameters.

    All ranks start from the same parameters and apply the same averaged update, so
    averaging the updates (Jin et al.) equals averaging the parameters, which needs no
    snapshot of the previous parameters. Floating-point buffers (BatchNorm statistics) are
    averaged too, so that every rank holds the same model.

    With ``hierarchical=True`` the parameters are averaged in each node's shared memory,
    then across nodes by one ``Allreduce`` per local rank over its slice.

    No ``wire=`` format here (:data:`mpigossip.core.registry.PARAMS_WIRE_REFUSED`): a compressed
    mean of the parameters would snap the model to the format's grid at every average.
    :class:`GradientAllReduce` (``"allreduce"``) compresses the gradients instead.

    ``on_failure="continue"`` (flat): the survivors of a failed rank go on
    (:class:`mpigossip.AllreduceAverager`, one per parameter group and one per floating-point
    buffer group, recovering together); the average that met the failure may leave the
    survivors' models one average apart, the next ones make them equal again.
    """

    name = "allreduce-params"

    def __init__(self, model: torch.nn.Module, *, comm: MPI.Intracomm, hierarchical: bool = False,
                 node_size: int | None = None, wire: str | None = None, on_failure: str = "abort",
                 timeout: float | None = None) -> None:
        if wire is not None and self.name == "allreduce-params":
            raise ValueError(f"allreduce-params takes no wire format: {PARAMS_WIRE_REFUSED}")
        self.hierarchical, self.node_size, self.wire = bool(hierarchical), node_size, wire
        self._check_on_failure(on_failure, hierarchical and "needs the flat AllReduce, not hierarchical")
        self.buffer_comms = []
        super().__init__(model, comm=comm, timeout=timeout)
        extra: dict[str, Any] = {} if self.on_failure == "abort" else {"on_failure": self.on_failure}
        self.buffer_comms = [AllreduceAverager(array, comm=self.comm, timeout=self.timeout, **extra)
                             for array in self.flat_buffers.arrays]
        if self.on_failure == "continue":
            self._group_failures()

    def _tolerant_groups(self):
        return self.comms + self.buffer_comms

    def _make(self, array):
        if self.hierarchical:
            return self._hierarchical(array, AllreduceAverager, wire=self.wire)
        extra = {} if self.on_failure == "abort" else {"on_failure": self.on_failure}
        return AllreduceAverager(array, comm=self.comm, timeout=self.timeout, wire=self.wire, **extra)

    def _step(self):
        for c in self.comms:
            c.step() if self.hierarchical else c.average()
        for c in self.buffer_comms:
            c.average()

    def free(self) -> None:
        super().free()
        for c in self.buffer_comms:
            c.free()
        self.buffer_comms = []
