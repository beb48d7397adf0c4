"""Gossiping SGD (Jin et al.), pull and push."""

from ..gossip import Gossip
from .base import _Periodic


class GossipPull(_Periodic):
    """Gossiping SGD, pull variant (one-sided RMA), every ``tau`` steps."""

    name = "gossip-pull"
    mode = "pull"
    _counters = ("calls", "rounds")

    def __init__(self, model, *, comm, tau=1, seed=0, timeout=None):
        self.tau, self.seed = tau, seed
        super().__init__(model, comm=comm, timeout=timeout)

    def _make(self, array):
        return Gossip(array, comm=self.comm, mode=self.mode, seed=self.seed, tau=self.tau, timeout=self.timeout)



class GossipPush(GossipPull):
    """Gossiping SGD, push variant, every ``tau`` steps."""

    name = "gossip-push"
    mode = "push"
