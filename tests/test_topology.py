"""Topologies at every world size 1..64, without MPI."""

from fractions import Fraction

import numpy as np
import pytest

from mpigossip import topology as T

SIZES = range(1, 65)


def graphs(n):
    """Every graph that can be bound to n ranks, with a name for messages."""
    out = [T.ExponentialGraph(peers=1), T.RingGraph(), T.RingGraph(bidirectional=True),
           T.CompleteGraph(), T.RandomPeers(peers=1, seed=3)]
    for peers in (2, 3):
        if n == 1 or peers <= (n - 1).bit_length():
            out.append(T.ExponentialGraph(peers=peers))
        if n > peers:
            out.append(T.RandomPeers(peers=peers, seed=5))
    if n % 2 == 0:
        out += [T.BipartiteExponentialGraph(peers=1), T.BipartiteExponentialGraph(peers=1, alternating=True)]
    out += [T.AlternatingExponentialGraph(peers=1), T.NPeerExponentialGraph(peers=1)]
    if n > 3:
        out += [T.AlternatingExponentialGraph(peers=2), T.NPeerExponentialGraph(peers=2)]
    return [g.bind(n) for g in out + undirected(n)]


def undirected(n):
    return [g.bind(n) for w in T.WEIGHTS for g in (T.UndirectedRing(weights=w), T.UndirectedExponentialGraph(
        weights=w), T.TorusGraph(weights=w), T.PairedExponentialGraph(weights=w))]


def steps_to_check(g):
    return range(g.period + 1 if g.period else 8)


@pytest.mark.parametrize("n", SIZES)
def test_in_out_consistent_and_column_stochastic(n):
    for g in graphs(n):
        for k in steps_to_check(g):
            outs = [g.out_peers(r, k) for r in range(n)]
            for r in range(n):
                assert len(set(outs[r])) == len(outs[r]), (g, k, r)
                assert r not in outs[r], (g, k, r)
                assert all(0 <= p < n for p in outs[r])
                ins = g.in_peers(r, k)
                assert ins == sorted(s for s in range(n) if r in outs[s]), (g, k, r)
                self_w, peer_w = g.mixing_weights(r, k)
                assert set(peer_w) == set(outs[r])
                assert abs(self_w + sum(peer_w.values()) - 1.0) < 1e-12
            P = g.mixing_matrix(k)
            for src in range(n):
                assert sum(P[dst][src] for dst in range(n)) == Fraction(1), (g, k, src)


def _strongly_connected(n, edges):
    def reach(adj):
        seen, todo = {0}, [0]
        while todo:
            for v in adj[todo.pop()]:
                if v not in seen:
                    seen.add(v)
                    todo.append(v)
        return len(seen) == n
    fwd = {v: set() for v in range(n)}
    bwd = {v: set() for v in range(n)}
    for a, b in edges:
        fwd[a].add(b)
        bwd[b].add(a)
    return reach(fwd) and reach(bwd)


@pytest.mark.parametrize("n", SIZES)
def test_union_over_a_period_is_strongly_connected(n):
    for g in graphs(n):
        window = g.period if g.period else 4 * n + 8
        edges = {(r, p) for k in range(window) for r in range(n) for p in g.out_peers(r, k)}
        assert _strongly_connected(n, edges), g


@pytest.mark.parametrize("n", SIZES)
def test_deterministic(n):
    for g in graphs(n):
        again = type(g)(**g._params()).bind(n)
        for k in range(10):
            for r in range(n):
                assert g.out_peers(r, k) == again.out_peers(r, k)
                assert g.in_peers(r, k) == again.in_peers(r, k)


@pytest.mark.parametrize("n", [2, 4, 8, 16, 32, 64])
def test_exponential_power_of_two_is_exact_average_after_log2_steps(n):
    g = T.ExponentialGraph(peers=1).bind(n)
    steps = n.bit_length() - 1
    M = np.eye(n)  # entries are dyadic: float64 products are exact here
    for k in range(steps):
        M = np.array(g.mixing_matrix(k), dtype=np.float64) @ M
    assert np.array_equal(M, np.full((n, n), 1.0 / n))


def test_exponential_hops_cycle():
    g = T.ExponentialGraph(peers=1).bind(8)
    assert [g.hops(k) for k in range(4)] == [[1], [2], [4], [1]]
    assert g.out_peers(5, 1) == [7] and g.in_peers(5, 2) == [1]
    g2 = T.ExponentialGraph(peers=2).bind(9)  # hops 1, 2, 4, 8
    assert g2.hops(0) == [1, 2] and g2.hops(1) == [4, 8]


def test_world_size_one_has_no_peers():
    for g in graphs(1):
        assert g.out_peers(0, 0) == [] and g.in_peers(0, 0) == []
        assert g.mixing_weights(0, 0) == (1.0, {})


def test_bipartite_edges_join_parities():
    g = T.BipartiteExponentialGraph(peers=2).bind(16)
    for k in range(g.period):
        for r in range(16):
            assert all((r + p) % 2 == 1 for p in g.out_peers(r, k))


def test_random_peers_varies_in_degree_and_allows_self_when_asked():
    g = T.RandomPeers(peers=1, seed=0).bind(8)
    degrees = {len(g.in_peers(r, k)) for k in range(20) for r in range(8)}
    assert len(degrees) > 1  # not regular
    s = T.RandomPeers(peers=1, seed=0, allow_self=True).bind(4)
    assert any(s.out_peers(r, k) == [r] for k in range(50) for r in range(4))


@pytest.mark.parametrize("make, n, match", [
    (lambda: T.ExponentialGraph(peers=3), 4, "needs at least 5 ranks"),
    (lambda: T.BipartiteExponentialGraph(), 5, "even world size"),
    (lambda: T.BipartiteExponentialGraph(), 1, "even world size"),
    (lambda: T.RandomPeers(peers=4), 4, "needs at least 5 ranks"),
])
def test_too_few_ranks_is_a_clear_error(make, n, match):
    with pytest.raises(ValueError, match=match):
        make().bind(n)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_bad_world_size(bad):
    with pytest.raises(ValueError, match="world size"):
        T.RingGraph().bind(bad)


def test_bad_arguments_and_unbound_use():
    with pytest.raises(ValueError, match="peers"):
        T.ExponentialGraph(peers=0)
    with pytest.raises(ValueError, match="not bound"):
        T.ExponentialGraph().out_peers(0, 0)
    with pytest.raises(ValueError, match="unknown topology"):
        T.make("hypercube")
    with pytest.raises(ValueError, match="outside"):
        T.RingGraph(size=4).out_peers(4, 0)
    assert isinstance(T.make("random", peers=2, seed=1), T.RandomPeers)


@pytest.mark.parametrize("n", SIZES)
def test_undirected_graphs_are_symmetric_and_doubly_stochastic(n):
    for g in undirected(n):
        for k in steps_to_check(g):
            P = g.mixing_matrix(k)
            for i in range(n):
                assert sum(P[i]) == 1, (g, k, i)
                assert g.out_peers(i, k) == g.in_peers(i, k)
                for j in range(n):
                    assert P[i][j] == P[j][i], (g, k, i, j)
            g.check_step(k, doubly=True)


def test_lazy_weights_are_dyadic_on_ring_torus_and_matching():
    for g in (T.UndirectedRing(weights="lazy").bind(8), T.TorusGraph(weights="lazy").bind(16),
              T.PairedExponentialGraph().bind(8)):
        for row in g.mixing_matrix(0):
            for v in row:
                assert v.denominator & (v.denominator - 1) == 0, (g, v)


@pytest.mark.parametrize("n", [2, 4, 8, 16, 32])
def test_paired_exponential_is_exact_average_after_log2_steps(n):
    g = T.PairedExponentialGraph().bind(n)
    M = np.eye(n)
    for k in range(n.bit_length() - 1):
        M = np.array(g.mixing_matrix(k), dtype=np.float64) @ M
    assert np.array_equal(M, np.full((n, n), 1.0 / n))


def test_the_sgp_papers_graphs_match_the_reference_schedule():
    # Alternating sign: +1, -1, +2, -2, +4 (-4 = +4 mod 8), one offset per step.
    g = T.AlternatingExponentialGraph().bind(8)
    assert g.offsets() == [1, -1, 2, -2, 4] and g.period == 5
    assert [g.out_peers(3, k) for k in range(6)] == [[4], [2], [5], [1], [7], [4]]
    assert g.in_peers(3, 1) == [4]
    # N-peer with 2 peers: offsets t * 3^j (t = 1, 2; 3^j <= n - 1), two per step.
    n2 = T.NPeerExponentialGraph(peers=2).bind(9)
    assert n2.offsets() == [1, 2, 3, 6] and n2.hops(0) == [1, 2] and n2.hops(1) == [3, 6]
    assert T.NPeerExponentialGraph(peers=1).bind(16).offsets() == T.ExponentialGraph().bind(16).offsets()
    b = T.BipartiteExponentialGraph(alternating=True).bind(16)
    assert b.offsets() == [1, -1, 3, -3, 5, -5, 9, -9]
    for k in range(b.period):
        for r in range(16):
            assert all((r + p) % 2 == 1 for p in b.out_peers(r, k))


def test_callable_and_matrix_graphs():
    # Rank r keeps 1/2 and sends 1/4 to r+1 and r+2: non-uniform, column-stochastic, dyadic.
    def fn(rank, step):
        return [(rank, 0.5), ((rank + 1) % 4, 0.25), ((rank + 2 + step) % 4, 0.25)]
    g = T.CallableGraph(fn, period=2).bind(4)
    assert g.mixing_weights(0, 0) == (0.5, {1: 0.25, 2: 0.25})
    assert g.in_peers(0, 1) == [1, 3] and g.out_peers(0, 1) == [1, 3]
    g.check_step(0)
    P = np.array([[0.5, 0.5, 0, 0], [0.5, 0.5, 0, 0], [0, 0, 0.5, 0.5], [0, 0, 0.5, 0.5]])
    Q = np.array([[0.5, 0, 0.5, 0], [0, 0.5, 0, 0.5], [0.5, 0, 0.5, 0], [0, 0.5, 0, 0.5]])
    m = T.MatrixGraph([P, Q]).bind(4)
    assert m.period == 2 and m.out_peers(0, 0) == [1] and m.out_peers(0, 1) == [2]
    M = np.array(m.mixing_matrix(1), dtype=np.float64) @ np.array(m.mixing_matrix(0), dtype=np.float64)
    assert np.array_equal(M, np.full((4, 4), 0.25))
    m.check_step(0, doubly=True)
    f = T.MatrixGraph(lambda step: P).bind(4)
    assert f.period == 0 and f.mixing_weights(3, 7) == (0.5, {2: 0.5})


@pytest.mark.parametrize("make, match", [
    (lambda: T.CallableGraph(lambda r, k: [(r, 0.5), ((r + 1) % 4, 0.25)]), "column 0 of the mixing matrix sums to 0.75"),
    (lambda: T.CallableGraph(lambda r, k: [(r, 0.5), (4, 0.5)]), "column 0 names peer 4, outside"),
    (lambda: T.CallableGraph(lambda r, k: [(r, 0.5), ((r + 1) % 4, -0.5), ((r + 2) % 4, 1.0)]), "weights must be"),
    (lambda: T.CallableGraph(lambda r, k: [((r + 1) % 4, 0.5), ((r + 1) % 4, 0.5)]), "lists peer 1 twice"),
    (lambda: T.CallableGraph(lambda r, k: 3), "must return"),
    (lambda: T.CallableGraph(5), "must be callable"),
    (lambda: T.MatrixGraph([np.eye(3)]), r"expected \(4, 4\)"),
    (lambda: T.MatrixGraph([[[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0.5]]]), "column 3"),
    (lambda: T.TorusGraph(rows=3), "does not divide"),
    (lambda: T.UndirectedRing(weights="uniform"), "weights must be one of"),
])
def test_bad_mixing_is_a_clear_error(make, match):
    with pytest.raises(ValueError, match=match):
        make().bind(4)


def test_column_but_not_row_stochastic_fails_the_doubly_check_naming_the_row():
    # Everyone sends half to rank 0: columns sum to 1, row 0 gets 2.
    g = T.CallableGraph(lambda r, k: [(r, 0.5), (0, 0.5)] if r else [(0, 1.0)]).bind(4)
    g.check_step(0)
    with pytest.raises(ValueError, match="row 0 of the mixing matrix sums to 2.5"):
        g.check_step(0, doubly=True)
    T.ExponentialGraph().bind(5).check_step(0, doubly=True)  # regular: doubly stochastic, not symmetric
    with pytest.raises(ValueError, match="row 0"):
        g.check_step(3, doubly=True)  # aperiodic: checked again at every step


def test_make_knows_every_name():
    for name in T.NAMES:
        g = T.make(name, peers=1, seed=2).bind(8)
        assert g.out_peers(0, 0) is not None
    for name in T.UNDIRECTED:
        for n in range(1, 17):
            g = T.make(name).bind(n)
            for k in steps_to_check(g):
                g.check_step(k, doubly=True)


def test_a_peers_per_step_schedule():
    g = T.ExponentialGraph(peers=[1, 2]).bind(16)  # hops 1, 2, 4, 8
    assert [g.hops(k) for k in range(5)] == [[1], [2, 4], [8], [1, 2], [4]]
    assert g.period == 8 and g.peers_at(3) == 2
    for k in range(2 * g.period):
        assert g.hops(k) == g.hops(k + g.period)
        for r in range(16):
            assert g.in_peers(r, k) == sorted((r - h) % 16 for h in g.hops(k))
        g.check_step(k, doubly=True)
    a = T.AlternatingExponentialGraph(peers=(2, 1)).bind(8)
    assert [a.hops(k) for k in range(3)] == [[1, -1], [2], [-2, 4]]
    with pytest.raises(ValueError, match="needs at least 9 ranks"):
        T.ExponentialGraph(peers=[1, 4]).bind(8)
    with pytest.raises(ValueError, match="schedule is empty"):
        T.ExponentialGraph(peers=[])
    with pytest.raises(ValueError, match="it sets the base"):
        T.NPeerExponentialGraph(peers=[1, 2])
