"""The node mean in shared memory and hierarchical averaging. On one machine the ranks
are split into emulated nodes of ``node_size`` consecutive ranks (the same code path as
real nodes, whose split is ``COMM_TYPE_SHARED``); the emulated cluster (tests/cluster) runs
the same tests across network namespaces, where the nodes are real."""

import numpy as np
import pytest
from mpi4py import MPI

import mpigossip as mg
from mpigossip import topology as T

from .helpers import comm, global_sum, same_on_all_ranks
from .test_kinds import KINDS, make, to_host


def shared_size(c):
    """Ranks per shared-memory node (the smallest, if nodes differ)."""
    shared = c.Split_type(MPI.COMM_TYPE_SHARED, key=c.rank)
    n = shared.Get_size()
    shared.Free()
    return c.allreduce(n, op=MPI.MIN)


def node_sizes(c):
    return [s for s in (1, 2, 4) if shared_size(c) % s == 0] + [None]


def integers(seed, n=1027):
    return np.random.default_rng(seed).integers(-1000, 1000, n).astype(np.float64)


def grouping(c, node_size):
    """``(index of this rank's group, members of every group, L)``: the groups NodeMean forms,
    ordered by their lowest rank (the inter-node communicators' order)."""
    shared = c.Split_type(MPI.COMM_TYPE_SHARED, key=c.rank)
    L = node_size or shared.Get_size()
    gid = (shared.allreduce(c.rank, op=MPI.MIN), shared.Get_rank() // L)
    shared.Free()
    ids = c.allgather(gid)
    groups = sorted(set(ids), key=lambda g: min(r for r, h in enumerate(ids) if h == g))
    return groups.index(gid), [[r for r, h in enumerate(ids) if h == g] for g in groups], L


def node_mean_replay(c, host, node_size):
    X = np.array(c.allgather(host))
    index, members, L = grouping(c, node_size)
    return X[members[index]].sum(axis=0) * (1.0 / L), X, L


def same_within_nodes(c, node_size, x):
    index, members, _ = grouping(c, node_size)
    blobs = c.allgather(np.asarray(x).tobytes())
    return len({blobs[r] for r in members[index]}) == 1


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("kind, stage", [k for k in KINDS if "direct" not in k.id and k.id != "numpy-staged"])
def test_node_mean_is_exact_and_identical_within_each_node(kind, stage):
    c = comm()
    for node_size in node_sizes(c):
        host = integers(40 + c.rank)
        expected, _, L = node_mean_replay(c, host, node_size)
        x = make(kind, host)
        with mg.NodeMean(x, comm=c, node_size=node_size) as nm:
            assert nm.local_size == L
            for _ in range(3):  # repeated: segments reused
                nm.average()
                if L & (L - 1) == 0:  # power of two: the mean of integers is exact
                    assert np.array_equal(to_host(x), expected)
                else:
                    assert np.allclose(to_host(x), expected, rtol=1e-15, atol=0)
        assert same_within_nodes(c, node_size, to_host(x)), "ranks of one node differ"


@pytest.mark.mpi(min_size=1)
def test_node_mean_in_the_window_is_exact_large_and_repeated():
    """The buffer in the shared segment: one fused pass per mean. Slices span several
    blocks of the fused loop (and a ragged end); every rank changes its buffer between
    means, as training does."""
    c = comm()
    n = 3 * (1 << 15) + 77
    for node_size in node_sizes(c):
        with mg.NodeMean.allocate(n, np.float64, comm=c, node_size=node_size) as nm:
            L = nm.local_size
            assert isinstance(nm.array, np.ndarray) and nm.array.size == n and not nm.array.any()
            for k in range(4):
                host = integers(70 + 10 * k + c.rank, n)
                nm.array[:] = host
                expected, _, _ = node_mean_replay(c, host, node_size)
                nm.average()
                if L & (L - 1) == 0:
                    assert np.array_equal(nm.array, expected), f"round {k}"
                else:
                    assert np.allclose(nm.array, expected, rtol=1e-15, atol=0)
            assert same_within_nodes(c, node_size, nm.array), "ranks of one node differ"


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("node_size", [1, 2])
@pytest.mark.parametrize("allocate", [False, True])
def test_hierarchical_pushsum_conserves_and_equals_the_node_level_replay(node_size, allocate):
    c = comm()
    if shared_size(c) % node_size:
        pytest.skip("the ranks of a node are not a multiple of node_size")
    nodes = c.size // node_size
    topo = T.ExponentialGraph()
    if 1.0 / (len(topo.bind(nodes).out_peers(0, 0)) + 1) not in (0.5, 1.0):
        pytest.skip("shares not dyadic between this many nodes")
    host = integers(50 + c.rank)
    mean, X, L = node_mean_replay(c, host, node_size)
    me, members, _ = grouping(c, node_size)
    node_x = np.array([X[m].sum(axis=0) / L for m in members])
    node_w = np.ones(nodes)
    total = X.sum(axis=0)
    if allocate:
        h = mg.Hierarchical.allocate(host.size, host.dtype, comm=c, inter=mg.PushSum, node_size=node_size,
                                     topology=topo)
        x = h.array
        x[:] = host
    else:
        x = host.copy()
        h = mg.Hierarchical(x, comm=c, inter=mg.PushSum, node_size=node_size, topology=topo)
    with h:
        assert h.nodes == nodes
        bound = topo.bind(nodes)
        for k in range(12):
            P = np.array(bound.mixing_matrix(k), dtype=np.float64)
            node_x, node_w = P @ node_x, P @ node_w
            h.step()
            assert np.array_equal(x, node_x[me]), f"step {k}"
            assert h.weight == node_w[me]
            assert np.array_equal(global_sum(c, x), total)
            assert c.allreduce(h.weight) == c.size


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("inter", ["allreduce", "dpsgd", "gossip", "none"])
def test_hierarchical_with_every_inter_node_communicator(inter):
    c = comm()
    node_size = 2 if shared_size(c) % 2 == 0 else 1
    nodes = c.size // node_size
    host = integers(60 + c.rank)
    mean, X, L = node_mean_replay(c, host, node_size)
    x = host.copy()
    cls, options = {"allreduce": (mg.AllreduceAverager, {}), "dpsgd": (mg.DPSGD, {"topology": T.PairedExponentialGraph()}),
                    "gossip": (mg.Gossip, {"mode": "push", "seed": 3}), "none": (None, {})}[inter]
    with mg.Hierarchical(x, comm=c, inter=cls, node_size=node_size, **options) as h:
        h.step()
        if inter == "none":
            assert np.array_equal(x, mean)
        elif inter == "allreduce" and nodes & (nodes - 1) == 0:
            assert np.array_equal(x, X.mean(axis=0)) or np.allclose(x, X.mean(axis=0), rtol=1e-15)
        elif inter == "dpsgd" and nodes & (nodes - 1) == 0:
            for _ in range(nodes.bit_length() - 2):  # exact average after log2(nodes) steps
                h.step()
            assert np.array_equal(x, X.sum(axis=0) / c.size)
        assert same_within_nodes(c, node_size, x), "ranks of one node differ"


@pytest.mark.mpi(min_size=2)
def test_hierarchical_bad_arguments_fail_on_every_rank():
    c = comm()
    with pytest.raises(ValueError) as err:
        mg.NodeMean(np.zeros(8), comm=c, node_size=shared_size(c) + 1)
    assert "node_size must be a positive divisor" in str(err.value) and same_on_all_ranks(c, str(err.value))
    if shared_size(c) > 1:
        with pytest.raises(ValueError) as err:
            mg.NodeMean(np.zeros(1), comm=c)
        assert "fewer than the" in str(err.value) and same_on_all_ranks(c, str(err.value))
    with pytest.raises(ValueError) as err:
        mg.Hierarchical(np.zeros(8), comm=c, inter=mg.Gossip, mode="pull")
    assert "mode='push'" in str(err.value) and same_on_all_ranks(c, str(err.value))
    with pytest.raises(ValueError) as err:
        mg.Hierarchical(np.zeros(8), comm=c, inter="pushsum")
    assert "communicator class" in str(err.value)
