"""Gossiping SGD (Jin et al.), pull and push."""

from ..gossip import Gossip
from .base import _Periodic


class GossipPull(_Periodic):
    """Gossiping SGD, pull variant (one-sided RMA), every ``tau`` steps."""

    name = "gossip-pull"
    mode = "pull"
    wire = None  # a pull reads the window's own dtype

    def __init__(self, model, *, comm, tau=1, seed=0, timeout=None):
        self.tau, self.seed = tau, seed
        super().__init__(model, comm=comm, timeout=timeout)

    def _make(self, array):
        return self._every(Gossip(array, comm=self.comm, mode=self.mode, seed=self.seed, timeout=self.timeout,
                                  wire=self.wire))



class GossipPush(GossipPull):
    """Gossiping SGD, push variant, every ``tau`` steps. With ``hierarchical=True``: the
    exact mean inside each node (shared memory) at every step, gossip between nodes."""

    name = "gossip-push"
    mode = "push"

    def __init__(self, model, *, comm, tau=1, seed=0, hierarchical=False, node_size=None, wire=None, timeout=None):
        self.hierarchical, self.node_size, self.wire = bool(hierarchical), node_size, wire
        super().__init__(model, comm=comm, tau=tau, seed=seed, timeout=timeout)

    def _make(self, array):
        if not self.hierarchical:
            return super()._make(array)
        return self._every(self._hierarchical(array, Gossip, mode="push", seed=self.seed, wire=self.wire))
