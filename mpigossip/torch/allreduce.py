"""AllReduce SGD: exact averaging of the parameters after each step."""

from ..allreduce import AllreduceAverager
from .base import _Wrapper


class AllReduce(_Wrapper):
    """AllReduce SGD by parameter averaging (``"allreduce-params"``): after each local
    update, every rank takes the exact mean of the parameters.

    All ranks start from the same parameters and apply the same averaged update, so
    averaging the updates (Jin et al.) equals averaging the parameters, which needs no
    snapshot of the previous parameters. Floating-point buffers (BatchNorm statistics) are
    averaged too, so that every rank holds the same model.

    With ``hierarchical=True`` the parameters are averaged in each node's shared memory,
    then across nodes by one ``Allreduce`` per local rank over its slice.

    ``wire="bf16"|"fp16"|"int8"`` sends the parameters compressed (:mod:`mpigossip.wire`;
    between nodes when hierarchical); the BatchNorm statistics stay exact.
    """

    name = "allreduce-params"

    def __init__(self, model, *, comm, hierarchical=False, node_size=None, wire=None, timeout=None):
        self.hierarchical, self.node_size, self.wire = bool(hierarchical), node_size, wire
        super().__init__(model, comm=comm, timeout=timeout)
        self.buffer_comms = [AllreduceAverager(array, comm=self.comm, timeout=self.timeout)
                             for array in self.flat_buffers.arrays]

    def _make(self, array):
        if self.hierarchical:
            return self._hierarchical(array, AllreduceAverager, wire=self.wire)
        return AllreduceAverager(array, comm=self.comm, timeout=self.timeout, wire=self.wire)

    def _step(self):
        for c in self.comms:
            c.step() if self.hierarchical else c.average()
        for c in self.buffer_comms:
            c.average()

    def free(self):
        super().free()
        for c in self.buffer_comms:
            c.free()
        self.buffer_comms = []
