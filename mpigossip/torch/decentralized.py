"""The SGP paper's baselines: D-PSGD (synchronous, doubly stochastic neighbour averaging)
and AD-PSGD (asynchronous atomic pairwise averaging)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..decentralized.dpsgd import DPSGD as _DPSGD
from ..onesided.adpsgd import ADPSGD as _ADPSGD
from .base import _Wrapper

if TYPE_CHECKING:
    import torch
    from mpi4py import MPI

    from ..topology import Topology


class DPSGD(_Wrapper):
    """D-PSGD (Lian et al. 2017): after each local update, ``x_i = sum_j W_ij x_j`` with the
    topology's doubly stochastic ``W`` (default: the undirected ring). The parameters are
    the model itself (no de-biasing); the mean over ranks moves only by the mean update.

    With ``hierarchical=True`` the exact mean is taken inside each node (shared memory)
    and D-PSGD runs between nodes (``node_size`` as :class:`mpigossip.NodeMean`).

    ``on_failure="continue"`` (flat only): the survivors of a failed rank go on, as for
    :class:`~mpigossip.torch.SGP`.
    """

    name = "dpsgd"

    def __init__(self, model: torch.nn.Module, *, comm: MPI.Intracomm, topology: Topology | None = None,
                 hierarchical: bool = False, node_size: int | None = None, wire: str | None = None,
                 on_failure: str = "abort", timeout: float | None = None) -> None:
        self.topology, self.hierarchical, self.node_size, self.wire = topology, bool(hierarchical), node_size, wire
        self._check_on_failure(on_failure, hierarchical and "needs the flat D-PSGD, not hierarchical")
        super().__init__(model, comm=comm, timeout=timeout)

    def _make(self, array):
        if self.hierarchical:
            return self._hierarchical(array, _DPSGD, topology=self.topology, wire=self.wire)
        extra = {} if self.on_failure == "abort" else {"on_failure": self.on_failure}
        return _DPSGD(array, comm=self.comm, topology=self.topology, timeout=self.timeout, wire=self.wire, **extra)

    def _step(self):
        for c in self.comms:
            c.step()



class ADPSGD(_Wrapper):
    """AD-PSGD (Lian et al. 2018): after each local update, an active rank (even) averages
    its model with a random passive rank's (odd), atomically, in RMA windows; a passive
    rank folds its update into its window and continues from there. No rank waits for
    another except while one exchange holds a lock."""

    name = "adpsgd"

    def __init__(self, model: torch.nn.Module, *, comm: MPI.Intracomm, seed: int = 0,
                 timeout: float | None = None) -> None:
        self.seed = seed
        super().__init__(model, comm=comm, timeout=timeout)

    def _make(self, array):
        return _ADPSGD(array, comm=self.comm, seed=self.seed, timeout=self.timeout)

    def _step(self):
        for c in self.comms:
            c.step()

    def drain(self) -> None:
        """Collective: passive ranks take the averages made into their windows since their
        last step (before evaluating, checkpointing or freeing)."""
        with self._ordered():
            for c in self.comms:
                if not c.closed:
                    c.drain()


