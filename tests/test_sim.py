"""The simulator without MPI: conservation, exact averaging at powers of two up to 1024,
consensus on every graph. Its bit-for-bit cross-check against real ranks is in tests/mpi."""

import numpy as np
import pytest

from mpigossip import sim
from mpigossip import topology as T


@pytest.mark.parametrize("p", [2, 8, 64, 1024])
def test_exponential_graph_is_exact_after_log2_p_rounds(p):
    x = np.random.default_rng(p).integers(-1000, 1000, (p, 4)).astype(np.float64)
    s = sim.PushSumSim(x, T.ExponentialGraph())
    for _ in range(p.bit_length() - 1):
        s.step()
    assert np.array_equal(s.debiased(), np.broadcast_to(x.mean(axis=0), x.shape))


@pytest.mark.parametrize("make", [lambda: T.ExponentialGraph(), lambda: T.AlternatingExponentialGraph(),
                                  lambda: T.RingGraph(), lambda: T.RandomPeers(peers=1, seed=2),
                                  lambda: T.UndirectedRing(), lambda: T.TorusGraph()])
def test_every_graph_conserves_mass_and_reaches_consensus(make):
    p = 16
    x = np.random.default_rng(1).integers(-1000, 1000, (p, 8)).astype(np.float64)
    s = sim.PushSumSim(x, make())
    for _ in range(200):
        s.step()
    np.testing.assert_allclose(s.x.sum(axis=0), x.sum(axis=0), rtol=1e-12)
    assert s.w.sum() == pytest.approx(p, rel=1e-12)
    assert sim.consensus_error(s.debiased()) < 0.05 * sim.consensus_error(x)  # rings mix slowest


def test_consensus_curve_falls_and_scales_with_p():
    small = sim.consensus_curve(T.ExponentialGraph(), 16, 6)
    big = sim.consensus_curve(T.ExponentialGraph(), 1000, 6)  # not a power of two: not exact
    assert small[3] < 1e-12 and big[-1] < big[0] < 1.0


def test_gossip_push_sim_reaches_consensus_and_rejects_bad_input():
    x = np.random.default_rng(2).standard_normal((8, 5))
    g = sim.GossipPushSim(x, seed=3)
    for _ in range(60):
        g.step()
    assert sim.consensus_error(g.x) < 1e-3 * sim.consensus_error(x)
    with pytest.raises(ValueError, match=r"\(p, n\)"):
        sim.PushSumSim(np.zeros(4))


def test_the_simulator_does_not_load_mpi():
    import subprocess
    import sys
    code = "import sys, mpigossip.sim; assert 'mpi4py.MPI' not in sys.modules, 'MPI loaded'"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120).returncode == 0


def test_pushsum_with_delay_conserves_mass_in_flight_and_the_vector_round_matches_the_exact_one():
    """With messages d rounds in flight, x and w plus what is in flight sum to their start at
    every round; without delay the vectorized round equals the exact (kernel) round."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 5))
    for delay in (1, 3):
        s = sim.PushSumSim(x, T.ExponentialGraph(), delay=delay)
        assert not s.exact
        for k in range(7):
            s.step()
            flight_x = sum(f[0] for f in s.in_flight)
            flight_w = sum(f[1] for f in s.in_flight)
            np.testing.assert_allclose(s.x.sum(axis=0) + flight_x.sum(axis=0), x.sum(axis=0), atol=1e-12)
            assert s.w.sum() + flight_w.sum() == pytest.approx(16.0, abs=1e-12)
            assert len(s.in_flight) == min(k + 1, delay) and (s.w > 0).all()
    exact, fast = sim.PushSumSim(x, T.ExponentialGraph()), sim.PushSumSim(x, T.ExponentialGraph(), exact=False)
    for _ in range(6):
        exact.step(), fast.step()
        np.testing.assert_allclose(fast.x, exact.x, rtol=1e-13, atol=1e-14)
        np.testing.assert_allclose(fast.w, exact.w, rtol=1e-13)
    with pytest.raises(ValueError, match="delay must be an integer >= 0"):
        sim.PushSumSim(x, delay=-1)
