import random
import time

import numpy as np
import pytest

import mpigossip as mg

from .helpers import comm, consensus_distance, same_on_all_ranks


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_identical_inputs_stay_identical(mode):
    c = comm()
    x = np.linspace(-1, 1, 333)
    ref = x.copy()
    g = mg.Gossip(x, comm=c, mode=mode, seed=4)
    for _ in range(20):
        g.step()
        if mode == "pull":
            assert np.array_equal(x, ref)  # 0.5 * a + 0.5 * a == a exactly
        else:  # (own * a + m * a) / (own + m) may round in the last bit
            np.testing.assert_allclose(x, ref, rtol=1e-14, atol=1e-15)
    g.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_consensus_distance_shrinks(mode):
    c = comm()
    x = np.random.default_rng(c.rank).standard_normal(500)
    g = mg.Gossip(x, comm=c, mode=mode, seed=1)
    d0 = consensus_distance(c, x)
    for _ in range(40):
        g.step()
        c.Barrier()  # lockstep, so that pull sees every peer's latest value
    assert consensus_distance(c, x) < 0.05 * d0
    g.free()


def _run(c, mode, seed, tau):
    x = np.arange(64, dtype=np.float64) * (c.rank + 1)
    g = mg.Every(mg.Gossip(x, comm=c, mode=mode, seed=seed), tau)
    peers = []
    for _ in range(12):
        g.step()
        if g.exchanged:
            peers.append(tuple(g.last_peers))
        c.Barrier()
    assert g.steps == 12
    g.free()
    return x, peers, g.exchanges


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_reproducible_from_the_seed(mode):
    c = comm()
    x1, p1, r1 = _run(c, mode, seed=9, tau=2)
    x2, p2, r2 = _run(c, mode, seed=9, tau=2)
    assert r1 == r2 == 6
    assert p1 == p2, "the target schedule is not reproducible"
    if mode == "push":  # pull reads whatever the target last published: timing-dependent by design
        assert np.array_equal(x1, x2)
    _, p3, _ = _run(c, mode, seed=10, tau=2)
    if c.size > 2:
        assert c.allreduce(int(p1 != p3)) > 0  # another seed gives another schedule somewhere


@pytest.mark.mpi(min_size=2)
def test_pull_never_sees_a_torn_vector():
    """Each rank's vector is constant; peers publish new constants while others pull at
    random times. A torn (half-published) vector would make an average non-constant."""
    c = comm()
    n = 200_000
    x = np.full(n, float(c.rank))
    g = mg.Gossip(x, comm=c, mode="pull", seed=2)
    rng = random.Random(c.rank)
    for _ in range(30):
        x[:] = float(rng.randrange(1000))  # a new constant vector each round
        g.step()
        assert x.min() == x.max(), "pulled a torn vector"
        if rng.random() < 0.5:
            time.sleep(0.001)
    g.free()


@pytest.mark.mpi(min_size=2)
def test_push_matches_reference_average():
    """Push averages own x (weight 1, or 2 on a self-push) with every arrival."""
    c = comm()
    x = np.full(10, float(c.rank * 3))
    g = mg.Gossip(x, comm=c, mode="push", seed=5)
    g.step()
    targets = g.topology.choices(0)
    senders = [s for s, (t,) in enumerate(targets) if t == c.rank and s != c.rank]
    own = 2.0 if targets[c.rank] == [c.rank] else 1.0
    expected = (own * c.rank * 3 + sum(3.0 * s for s in senders)) / (own + len(senders))
    np.testing.assert_allclose(x, expected)
    g.free()


@pytest.mark.mpi(min_size=2)
def test_bad_arguments_raise_everywhere():
    c = comm()
    with pytest.raises(ValueError) as err:
        mg.Gossip(np.zeros(4), comm=c, mode="pull" if c.rank else "shout")
    assert "rank 0: mode must be one of" in str(err.value) and same_on_all_ranks(c, str(err.value))
    with pytest.raises(ValueError, match="tau"):
        mg.Gossip(np.zeros(4), comm=c, tau=0)


@pytest.mark.mpi(min_size=2)
def test_one_sided_windows_across_nodes_without_progress_warn_once(monkeypatch):
    """A one-sided communicator whose windows span nodes while Open MPI's TCP progress thread is
    unset says so once, on rank 0, naming the setting; on one node, or with the thread set,
    nothing (on the emulated cluster this runs across nodes, on one machine on one node)."""
    import os
    import warnings

    from mpi4py import MPI

    from mpigossip.onesided import progress, rma
    c = comm()
    node = c.Split_type(MPI.COMM_TYPE_SHARED)
    spans = node.Get_size() < c.Get_size()
    node.Free()
    expected = (spans and "Open MPI" in MPI.Get_library_version()
                and not os.environ.get(progress.VARIABLE, "").strip() and c.rank == 0)
    monkeypatch.setattr(rma, "_warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            mg.Gossip(np.zeros(8), comm=c, mode="pull").free()
        mg.ParameterServer(8, np.float64, comm=c).free()
    said = [str(w.message) for w in caught if "progress thread" in str(w.message)]
    assert len(said) == (1 if expected else 0), said
    assert all(progress.VARIABLE in text and text.startswith("Gossip:") for text in said), said
