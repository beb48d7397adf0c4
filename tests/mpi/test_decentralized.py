"""D-PSGD and AD-PSGD: exact invariants on dyadic data, on every buffer kind, under delays."""

import random
import time

import numpy as np
import pytest

import mpigossip as mg
from mpigossip import topology as T

from .helpers import comm, consensus_distance, global_sum, same_on_all_ranks
from .test_kinds import KINDS, make, to_host


def integers(seed, n, low=-1000, high=1000):
    return np.random.default_rng(seed).integers(low, high, n).astype(np.float64)


def dyadic_graphs(size):
    """Doubly stochastic graphs whose weights are powers of two at this size."""
    out = [T.UndirectedRing(weights="lazy"), T.PairedExponentialGraph(), T.TorusGraph(weights="lazy")]
    return [g for g in out if all(v.denominator & (v.denominator - 1) == 0
                                  for row in g.bind(size).mixing_matrix(0) for v in row)]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("kind, stage", KINDS)
def test_dpsgd_preserves_the_mean_and_equals_the_replay(kind, stage):
    c = comm()
    for topo in dyadic_graphs(c.size):
        host = integers(30 + c.rank, 1031)
        x = make(kind, host)
        X = np.array(c.allgather(host))
        total = global_sum(c, host)
        d = mg.DPSGD(x, comm=c, topology=topo, stage=stage, chunk_bytes=1024)
        for k in range(10):
            X = np.array(d.topology.mixing_matrix(k), dtype=np.float64) @ X  # exact: dyadic
            d.step()
            assert np.array_equal(to_host(x), X[c.rank]), f"{topo!r} step {k}"
            assert np.array_equal(global_sum(c, to_host(x)), total), f"{topo!r}: the mean moved at step {k}"
        d.free()


@pytest.mark.mpi(min_size=2)
def test_dpsgd_reaches_consensus_with_metropolis_weights():
    c = comm()
    x = np.random.default_rng(c.rank).standard_normal(500)
    mean = global_sum(c, x) / c.size
    before = consensus_distance(c, x)
    with mg.DPSGD(x, comm=c, topology=T.UndirectedExponentialGraph()) as d:
        for _ in range(30):
            d.step()
    assert consensus_distance(c, x) < 1e-3 * before
    assert np.allclose(global_sum(c, x) / c.size, mean, rtol=0, atol=1e-12)


@pytest.mark.mpi(min_size=3)
def test_dpsgd_rejects_a_matrix_that_is_not_doubly_stochastic_on_every_rank():
    c = comm()
    with pytest.raises(ValueError) as err:
        mg.DPSGD(np.zeros(10), comm=c, topology=T.RandomPeers(peers=1, seed=1))
    assert "doubly stochastic" in str(err.value) and same_on_all_ranks(c, str(err.value))
    with pytest.raises(ValueError) as err:  # column-stochastic, row 0 receives too much
        mg.DPSGD(np.zeros(10), comm=c, topology=T.CallableGraph(lambda r, k: [(r, 0.5), (0, 0.5)] if r else [(0, 1.0)]))
    assert "row 0 of the mixing matrix" in str(err.value) and same_on_all_ranks(c, str(err.value))


@pytest.mark.mpi(min_size=2)
def test_dpsgd_arguments_must_agree():
    c = comm()
    with pytest.raises(ValueError) as err:
        mg.DPSGD(np.zeros(10), comm=c, chunk_bytes=64 if c.rank else 128)
    assert "chunk_bytes differs" in str(err.value) and same_on_all_ranks(c, str(err.value))
    with pytest.raises(ValueError):
        mg.DPSGD(np.zeros(10 + (c.rank == 1)), comm=c)


# -------------------------------------------------------------------------------- AD-PSGD

@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("kind, stage", [k for k in KINDS if "direct" not in k.id and k.id != "numpy-staged"])
def test_adpsgd_conserves_mass_and_never_tears(kind, stage):
    """Every rank's vector is constant (all elements equal) and stays so unless an average
    reads or writes a half-updated window; Σx changes only by the local updates. Ranks run
    at random paces, so averages land while passive ranks fold their updates."""
    c = comm()
    n = 1 << 18  # 2 MB of float64: a window write is far from atomic
    rng = random.Random(f"adpsgd:{c.rank}")
    x = make(kind, np.full(n, float(c.rank * 64)))
    step_update = make(kind, np.full(n, float(c.rank % 3 - 1)))
    total = float(c.size * 64 * (c.size - 1) // 2) * n
    with mg.ADPSGD(x, comm=c, seed=4) as ad:
        # Every average adds at most one bit; there are actives x steps averages in all, and
        # values start below 2^9: 40 averages keep every value exact in float64.
        steps = 40 // ((c.size + 1) // 2)
        for k in range(steps):
            x += step_update
            if rng.random() < 0.4:
                time.sleep(rng.random() * 2e-3)
            ad.step()
            host = to_host(x)
            assert host.min() == host.max(), f"torn vector at step {k}: {host.min()} .. {host.max()}"
        total += float(sum(r % 3 - 1 for r in range(c.size))) * steps * n
        ad.drain()
        host = to_host(x)
        assert host.min() == host.max()
        assert float(global_sum(c, host).sum()) == total
        assert ad.exchanges == (steps if c.size > 1 else 0) and ad.steps == steps


@pytest.mark.mpi(min_size=2)
def test_adpsgd_moves_towards_consensus():
    c = comm()
    x = np.random.default_rng(c.rank).standard_normal(1000)
    mean = global_sum(c, x) / c.size
    before = consensus_distance(c, x)
    with mg.ADPSGD(x, comm=c, seed=1) as ad:
        for _ in range(40):
            ad.step()
            c.Barrier()  # no local updates: exchanges alone
        ad.drain()
    assert consensus_distance(c, x) < 0.2 * before
    assert np.allclose(global_sum(c, x) / c.size, mean, atol=1e-12)


@pytest.mark.mpi(min_size=2)
def test_adpsgd_roles_and_bad_seed():
    c = comm()
    with mg.ADPSGD(np.zeros(4), comm=c) as ad:
        assert ad.active == (c.rank % 2 == 0)
        ad.step()
        assert (ad.last_peer % 2 == 1) if ad.active else ad.last_peer is None
    with pytest.raises(ValueError) as err:
        mg.ADPSGD(np.zeros(4), comm=c, seed=1.5 if c.rank == 0 else 1)
    assert "seed must be an integer" in str(err.value) and same_on_all_ranks(c, str(err.value))
