"""Gossiping SGD (Jin et al.), pull and push."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..decentralized.gossip import Gossip
from .base import _Periodic

if TYPE_CHECKING:
    import torch
    from mpi4py import MPI


class GossipPull(_Periodic):
    """Gossiping SGD, pull variant (one-sided RMA), every ``tau`` steps."""

    name = "gossip-pull"
    mode = "pull"
    wire: str | None = None  # a pull reads the window's own dtype

    def __init__(self, model: torch.nn.Module, *, comm: MPI.Intracomm, tau: int = 1, seed: int = 0,
                 timeout: float | None = None) -> None:
        self.tau, self.seed = tau, seed
        super().__init__(model, comm=comm, timeout=timeout)

    def _make(self, array):
        return self._every(Gossip(array, comm=self.comm, mode=self.mode, seed=self.seed, timeout=self.timeout,
                                  wire=self.wire))



class GossipPush(GossipPull):
    """Gossiping SGD, push variant, every ``tau`` steps. With ``hierarchical=True``: the
    exact mean inside each node (shared memory) at every step, gossip between nodes.

    ``on_failure="continue"`` (flat only): the survivors of a failed rank go on, as for
    :class:`~mpigossip.torch.SGP`, pushing to targets drawn over them."""

    name = "gossip-push"
    mode = "push"

    def __init__(self, model: torch.nn.Module, *, comm: MPI.Intracomm, tau: int = 1, seed: int = 0,
                 hierarchical: bool = False, node_size: int | None = None, wire: str | None = None,
                 on_failure: str = "abort", timeout: float | None = None) -> None:
        self.hierarchical, self.node_size, self.wire = bool(hierarchical), node_size, wire
        self._check_on_failure(on_failure, hierarchical and "needs the flat gossip, not hierarchical")
        super().__init__(model, comm=comm, tau=tau, seed=seed, timeout=timeout)

    def _tolerant_groups(self):
        return [c.inner for c in self.comms]  # each Gossip, under its Every(tau)

    def _make(self, array):
        if not self.hierarchical:
            extra = {} if self.on_failure == "abort" else {"on_failure": self.on_failure}
            return self._every(Gossip(array, comm=self.comm, mode=self.mode, seed=self.seed, timeout=self.timeout,
                                      wire=self.wire, **extra))
        return self._every(self._hierarchical(array, Gossip, mode="push", seed=self.seed, wire=self.wire))
