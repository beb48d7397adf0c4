"""The simulator (mpigossip.sim, no MPI) against real ranks: at the world size of this run
its rows equal the communicators' buffers bit for bit, step after step."""

import numpy as np
import pytest

import mpigossip as mg
from mpigossip import sim
from mpigossip import topology as T

from .helpers import comm


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("make", [lambda: T.ExponentialGraph(), lambda: T.RandomPeers(peers=1, seed=5),
                                  lambda: T.AlternatingExponentialGraph(peers=1)])
def test_pushsum_equals_the_simulator_bit_for_bit(make):
    c = comm()
    X = np.random.default_rng(9).standard_normal((c.size, 777))  # same on every rank
    x = X[c.rank].copy()
    ps = mg.PushSum(x, comm=c, topology=make(), chunk_bytes=1024)
    s = sim.PushSumSim(X, make())
    for k in range(12):
        ps.step()
        s.step()
        assert np.array_equal(x, s.x[c.rank]), f"step {k}"
        assert ps.weight == s.w[c.rank]
    ps.free()


@pytest.mark.mpi(min_size=2)
def test_gossip_push_equals_the_simulator_bit_for_bit():
    c = comm()
    X = np.random.default_rng(10).standard_normal((c.size, 513))
    x = X[c.rank].copy()
    g = mg.Gossip(x, comm=c, mode="push", seed=4)
    s = sim.GossipPushSim(X, seed=4)
    for k in range(12):
        g.step()
        s.step()
        assert np.array_equal(x, s.x[c.rank]), f"round {k}"
    g.free()
