"""PushSum with non-uniform, user-given mixing weights: exact against a replay of the
mixing matrices, conservation in overlap mode, and bad matrices rejected on every rank."""

import numpy as np
import pytest

import mpigossip as mg
from mpigossip import topology as T

from .helpers import comm, global_sum, same_on_all_ranks


def dyadic_fn(n):
    """Rank r keeps 1/2 and sends 1/4, 1/8, 1/8 to r+1+k%2, r+2, r+3 (merged where they
    coincide): non-uniform, time-varying, every weight a power of two."""
    def fn(rank, step):
        out = {}
        for peer, w in ((rank, 0.5), ((rank + 1 + step % 2) % n, 0.25), ((rank + 2) % n, 0.125),
                        ((rank + 3) % n, 0.125)):
            out[peer] = out.get(peer, 0.0) + w
        return list(out.items())
    return fn


def all_x(c, x):
    return np.array(c.allgather(np.array(x)))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", ["callable", "matrix"])
def test_sync_step_equals_the_matrix_replay_bit_for_bit(kind):
    c = comm()
    fn = dyadic_fn(c.size)
    topo = T.CallableGraph(fn, period=2)
    if kind == "matrix":
        bound = topo.bind(c.size)
        topo = T.MatrixGraph([np.array(bound.mixing_matrix(k), dtype=np.float64) for k in range(2)])
    x = np.random.default_rng(c.rank).integers(-1000, 1000, 301).astype(np.float64)
    X, W = all_x(c, x), np.ones(c.size)
    ps = mg.PushSum(x, comm=c, topology=topo, chunk_bytes=512)
    for k in range(12):
        P = np.array(ps.topology.mixing_matrix(k), dtype=np.float64)
        X, W = P @ X, P @ W  # exact: dyadic weights, few bits
        ps.step()
        assert np.array_equal(x, X[c.rank]), f"step {k}"
        assert ps.weight == W[c.rank]
    ps.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("max_delay", [0, 1, 2])
def test_overlap_with_non_uniform_weights_conserves_exactly(max_delay):
    c = comm()
    x = np.random.default_rng(c.rank).integers(-1000, 1000, 1000).astype(np.float64)
    total = global_sum(c, x)
    ps = mg.PushSum(x, comm=c, topology=T.CallableGraph(dyadic_fn(c.size), period=2), max_delay=max_delay)
    for k in range(12):
        x += c.rank + k  # a local update, known to all: the expected sum moves by it
        total += sum(r + k for r in range(c.size))
        ps.start()
        ps.finish()
    ps.drain()
    assert np.array_equal(global_sum(c, x), total)
    assert c.allreduce(ps.weight) == c.size
    ps.free()


@pytest.mark.mpi(min_size=2)
def test_a_matrix_that_loses_mass_is_rejected_on_every_rank():
    c = comm()
    n = c.size
    with pytest.raises(ValueError) as err:  # column n-1 keeps only 1/4 and sends 1/2
        mg.PushSum(np.zeros(8), comm=c, topology=T.CallableGraph(
            lambda r, k: [(r, 0.5 if r < n - 1 else 0.25), ((r + 1) % n, 0.5)]))
    assert f"column {n - 1} of the mixing matrix sums to 0.75" in str(err.value)
    assert same_on_all_ranks(c, str(err.value))
    # Valid at step 0, wrong at step 1: the step raises, with the same message everywhere.
    topo = T.CallableGraph(lambda r, k: [(r, 0.5), ((r + 1) % n, 0.5 if k == 0 or r else 0.25)])
    ps = mg.PushSum(np.zeros(8), comm=c, topology=topo)
    ps.step()
    with pytest.raises(ValueError) as err:
        ps.step()
    assert "step 1: column 0" in str(err.value) and same_on_all_ranks(c, str(err.value))
    ps.free()


@pytest.mark.mpi(min_size=3)
@pytest.mark.parametrize("overlap", [False, True])
def test_a_peers_per_step_schedule_follows_the_replay(overlap):
    c = comm()
    topo = T.ExponentialGraph(peers=[1, 2])
    x = np.random.default_rng(c.rank).standard_normal(100)
    X, W = all_x(c, x), np.ones(c.size)
    ps = mg.PushSum(x, comm=c, topology=topo, max_delay=0)
    for k in range(8):
        P = np.array(ps.topology.mixing_matrix(k), dtype=np.float64)
        X, W = P @ X, P @ W
        if overlap:
            ps.start()
            ps.finish()
        else:
            ps.step()
        assert ps.topology.peers_at(k) == len(ps.topology.out_peers(c.rank, k))
    ps.drain()
    np.testing.assert_allclose(x, X[c.rank], rtol=1e-12, atol=1e-12)
    assert ps.weight == pytest.approx(W[c.rank], rel=1e-12)
    ps.free()
