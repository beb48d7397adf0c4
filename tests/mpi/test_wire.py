"""Compressed messages (wire=) on every communicator that sends the model: PushSum's mass
and D-PSGD's mean stay exact (the sender keeps its rounding error), AllReduce in a 16-bit or
int8 format ends identical on every rank with no inf/NaN near the format's limits, and bad
or mismatched formats raise the same error on every rank."""

import numpy as np
import pytest

import mpigossip as mg
from mpigossip import topology as T
from mpigossip.core.wire import FORMATS, INT8_BLOCK

from .helpers import comm, consensus_distance, global_sum, same_on_all_ranks
from .test_mixing import dyadic_fn

# Relative drift of Σx that rounding in float64 can explain; a format's own rounding
# (2^-8 for bf16, 2^-7 for int8) left uncorrected would be 1e5 times larger.
EXACT = 1e-11


def data(c, n=3 * INT8_BLOCK + 77, dtype=np.float64):
    rng = np.random.default_rng(100 + c.rank)
    return (rng.standard_normal(n) * 10 + c.rank).astype(dtype)


def assert_mass(c, x, total, scale):
    drift = np.abs(global_sum(c, x) - total).max()
    assert drift <= EXACT * scale, f"sum x drifted by {drift:.3g} (scale {scale:.3g})"


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("topology", ["exponential", "dyadic", "staged"])
def test_pushsum_step_keeps_the_mass_exact_under_compression(fmt, topology):
    c = comm()
    x = data(c)
    total, scale = global_sum(c, x), float(c.allreduce(np.abs(x).sum()))
    mean = total / c.size
    topo = T.CallableGraph(dyadic_fn(c.size), period=2) if topology == "dyadic" else T.ExponentialGraph(peers=1)
    ps = mg.PushSum(x, comm=c, topology=topo, wire=fmt, chunk_bytes=8 * INT8_BLOCK,
                    stage=True if topology == "staged" else None)
    for _ in range(30):
        ps.step()
        assert_mass(c, x, total, scale)
        assert abs(c.allreduce(ps.weight) - c.size) < 1e-12
    tol = {"bf16": 2.0 ** -7, "fp16": 2.0 ** -10, "int8": 2.0 ** -6}[fmt] * np.abs(mean).max()
    np.testing.assert_allclose(ps.debiased(), mean, rtol=0, atol=tol)
    ps.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("max_delay", [0, 1])
def test_overlap_keeps_the_mass_exact_under_compression(fmt, max_delay):
    """Overlap PushSum in a format beside the same run in float64: Σx exact, the ranks' z = x / w
    brought together as in the plain run (their spread a fraction of the unmixed one: an
    exchange that moved nothing fails here), and with max_delay=0 (deterministic arrivals)
    z close to the plain run's, within the format's rounding (the wrong shares fail)."""
    c = comm()
    x = data(c, dtype=np.float64)
    y = x.copy()
    total, scale = global_sum(c, x), float(c.allreduce(np.abs(x).sum()))
    topo = T.CallableGraph(dyadic_fn(c.size), period=2)
    ps = mg.PushSum(x, comm=c, topology=topo, max_delay=max_delay, wire=fmt)
    plain = mg.PushSum(y, comm=c, topology=topo, max_delay=max_delay)
    # The first half of the steps adds rank-dependent values between start() and finish(); the
    # second half only mixes. A drive kept to the end would set the spread left: with max_delay=1
    # the weights w differ between ranks, an equal addition to x is unequal in z = x / w, and
    # runs on loaded nodes ended at 0.35 of the unmixed spread (timing's, not a fault). Mixing
    # alone ends below 0.01 of it; an exchange that moved nothing stays near 1.
    steps, driven = 24, 12
    for k in range(steps):
        for v, p in ((x, ps), (y, plain)):
            if k < driven:
                v += c.rank + k
            p.start()
            p.finish()
        if k < driven:
            total += sum(r + k for r in range(c.size))
    ps.drain()
    plain.drain()
    assert_mass(c, x, total, scale + driven * c.size * x.size * c.size)
    assert abs(c.allreduce(ps.weight) - c.size) < 1e-12
    z, zp = x / ps.weight, y / plain.weight
    start = data(c, dtype=np.float64) + sum(c.rank + k for k in range(driven))  # each rank alone
    alone = consensus_distance(c, start)
    assert consensus_distance(c, zp) < 0.1 * alone, "the plain run did not mix: nothing tested"
    assert consensus_distance(c, z) < 0.1 * alone, "compressed overlap did not mix"
    if max_delay == 0:  # which messages a finish() adds is then fixed: the two runs meet
        tol = 2.0 ** -5 * np.abs(zp).max()  # the formats' rounding, kept and sent on over 24 steps
        np.testing.assert_allclose(z, zp, rtol=0, atol=tol, err_msg="compressed overlap strayed from the plain one")
    ps.free()
    plain.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("fmt", FORMATS)
def test_dpsgd_keeps_the_mean_exact_and_float32_stays_close(fmt):
    c = comm()
    x = data(c)
    total, scale = global_sum(c, x), float(c.allreduce(np.abs(x).sum()))
    d = mg.DPSGD(x, comm=c, wire=fmt, chunk_bytes=4 * INT8_BLOCK)
    for _ in range(10):
        d.step()
        assert_mass(c, x, total, scale)
    d.free()
    y = data(c, dtype=np.float32)
    ref = data(c, dtype=np.float32)
    a, b = mg.DPSGD(y, comm=c, wire=fmt), mg.DPSGD(ref, comm=c)
    for _ in range(3):
        a.step()
        b.step()
    np.testing.assert_allclose(y, ref, rtol=0, atol=0.05 * np.abs(ref).max())
    a.free()
    b.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n", [5, 2 * INT8_BLOCK + 3, 40000])
def test_allreduce_in_a_wire_format_is_identical_everywhere_and_close(fmt, n):
    c = comm()
    x = data(c, n, np.float32)
    mean = (global_sum(c, x) / c.size).astype(np.float32)
    av = mg.AllreduceAverager(x, comm=c, wire=fmt)
    av.average()
    assert same_on_all_ranks(c, x.tobytes()), "ranks disagree after a compressed mean"
    tol = {"bf16": 2.0 ** -7, "fp16": 2.0 ** -9, "int8": 2.0 ** -5}[fmt] * np.abs(mean).max()
    np.testing.assert_allclose(x, mean, rtol=0, atol=tol)
    x[:] = data(c, n, np.float32)
    av.start()
    av.test()
    av.finish()  # the overlapped form gives the same bytes
    y = data(c, n, np.float32)
    mg.AllreduceAverager(y, comm=c, wire=fmt).average()
    assert np.array_equal(x, y)
    av.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("fmt, big", [("fp16", 6.0e4), ("bf16", 3.0e38), ("int8", 3.0e38)])
def test_allreduce_near_the_format_limits_has_no_inf_or_nan(fmt, big):
    """Every rank holds values near the format's largest: a sum before scaling would overflow."""
    c = comm()
    x = np.full(3 * INT8_BLOCK, big, np.float32)
    x[1::2] = -big * 0.5
    x[INT8_BLOCK:2 * INT8_BLOCK] = 0.0  # an all-zero int8 block
    expect = x.copy()
    mg.AllreduceAverager(x, comm=c, wire=fmt).average()
    assert np.all(np.isfinite(x))
    np.testing.assert_allclose(x, expect, rtol=2.0 ** -6)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("fmt", FORMATS)
def test_gossip_push_in_a_wire_format_follows_the_plain_one(fmt):
    c = comm()
    x, ref = data(c, dtype=np.float32), data(c, dtype=np.float32)
    a = mg.Gossip(x, comm=c, mode="push", seed=3, wire=fmt)
    b = mg.Gossip(ref, comm=c, mode="push", seed=3)
    for _ in range(6):
        a.step()
        b.step()
    np.testing.assert_allclose(x, ref, rtol=0, atol=0.03 * np.abs(ref).max())
    assert c.allreduce(int(not np.array_equal(x, ref))), "the wire format changed nothing on any rank"
    a.free()
    b.free()


@pytest.mark.mpi(min_size=2)
def test_bad_and_mismatched_wire_formats_raise_everywhere():
    c = comm()
    cases = [
        (lambda: mg.PushSum(np.zeros(8), comm=c, wire="bf17"), "one of"),
        (lambda: mg.DPSGD(np.zeros(8), comm=c, wire="bf16" if c.rank == 0 else None), "wire differs"),
        (lambda: mg.AllreduceAverager(np.zeros(8, np.float16), comm=c, wire="fp16"), "as many bytes"),
        (lambda: mg.Gossip(np.zeros(8), comm=c, mode="pull", wire="bf16"), "mode='push'"),
        (lambda: mg.PushSum(np.zeros(8), comm=c, max_delay=None, wire="bf16"), "max_delay"),
    ]
    for make, match in cases:
        with pytest.raises(ValueError, match=match) as err:
            make()
        assert same_on_all_ranks(c, str(err.value))


@pytest.mark.mpi(min_size=2)
def test_hierarchical_passes_the_wire_format_between_nodes():
    """node_size=1: every rank its own node, so PushSum between "nodes" does all the mixing."""
    c = comm()
    h = mg.Hierarchical.allocate(3 * INT8_BLOCK, "float64", comm=c, inter=mg.PushSum, node_size=1, wire="int8")
    plain = mg.Hierarchical.allocate(3 * INT8_BLOCK, "float64", comm=c, inter=mg.PushSum, node_size=1)
    h.array[:] = plain.array[:] = data(c, h.array.size)
    total, scale = global_sum(c, h.array), float(c.allreduce(np.abs(h.array).sum()))
    assert "wire=int8" in repr(h.inter)
    for _ in range(5):
        h.step()
        plain.step()
    assert_mass(c, h.inter.buffer.array, total, scale)
    z, zp = h.inter.debiased(), plain.inter.debiased()
    err = np.abs(z - zp).max()
    assert err <= 2.0 ** -5 * np.abs(zp).max(), f"int8 between nodes strayed {err:.3g} from the plain run"
    assert err > 1e-9 * np.abs(zp).max(), "nothing was rounded: the format was not used between nodes"
    h.free()
    plain.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", ["step", "overlap"])
def test_compressed_pushsum_resumes_bit_for_bit(mode):
    """bf16's stochastic rounding draws its bits from (rank, step, offset), not from a stream:
    a run taken up from a state_dict after 3 steps ends bit for bit like one never stopped."""
    c = comm()

    def run(ps, k):
        for _ in range(k):
            if mode == "step":
                ps.step()
            else:
                ps.start()
                ps.finish()
        ps.drain()

    x, y = data(c, dtype=np.float32), data(c, dtype=np.float32)
    options = dict(comm=c, wire="bf16", max_delay=0, chunk_bytes=4 * INT8_BLOCK)
    with mg.PushSum(x, **options) as a:
        run(a, 3)
        run(a, 3)
    with mg.PushSum(y, **options) as b:
        run(b, 3)
        state = b.state_dict()
    with mg.PushSum(y, **options) as b:
        b.load_state_dict(state)
        run(b, 3)
        assert b.steps == 6 and b.weight == a.weight
    assert np.array_equal(x, y)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("how", ["allreduce", "pushsum"])
def test_a_non_finite_value_on_one_rank_stays_in_its_element(fmt, bad, how):
    """One NaN (or inf) on rank 0, as a diverging gradient or a mixed-precision loss scaler's
    overflow brings: after a compressed AllReduce or PushSum step it is non-finite in that
    element on every rank that receives it (as MPI's float32 Allreduce leaves it: no silent
    finite value), and every other element is what the same step gives without it."""
    c = comm()
    n, at = 3 * INT8_BLOCK + 77, INT8_BLOCK + 10
    results = []
    for poisoned in (False, True):
        x = data(c, n, np.float32)
        if poisoned and c.rank == 0:
            x[at] = bad
        if how == "allreduce":
            avg = mg.AllreduceAverager(x, comm=c, wire=fmt)
            avg.average()
        else:
            avg = mg.PushSum(x, comm=c, topology=T.CompleteGraph(), wire=fmt, chunk_bytes=8 * INT8_BLOCK)
            avg.step()
        avg.free()
        results.append(x)
    clean, dirty = results
    assert not np.isfinite(dirty[at]), f"rank {c.rank}: the {bad} became {dirty[at]}"
    if bad == np.inf and fmt != "int8" and how == "allreduce":
        assert dirty[at] == np.inf  # (int8 sends any non-finite value as NaN)
    others = np.arange(n) != at
    assert np.array_equal(dirty[others], clean[others]), "a non-finite value changed other elements"


def pseudo_nodes(c, per_node):
    """A Layout of ``c`` as if every ``per_node`` consecutive ranks shared a node (one machine
    standing in for several nodes: the node-aware paths' exchanges between nodes run)."""
    from mpigossip.exact.ring import Layout
    layout = Layout.__new__(Layout)
    layout.comm, layout.node = c, c.Split(c.rank // per_node, c.rank)
    layout.local_size, layout.one_node, layout.uniform = per_node, per_node == c.size, True
    layout.nodes, layout._cross, layout._runs = c.size // per_node, None, 0
    return layout


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n", [3, 2 * INT8_BLOCK + 3, 40000])
@pytest.mark.parametrize("nodes", ["real", "pairs"])
def test_node_aware_allreduce_in_a_wire_format(fmt, n, nodes):
    """algorithm="node-ring" with a wire format: average() reduces inside each node in full
    precision and compresses only between nodes (on one node: nothing to compress, the exact
    mean); identical bytes on every rank and within the format's error of the mean; its
    start()/finish() run the flat compressed exchange. "pairs": every two ranks as one node."""
    from mpi4py import MPI
    c = comm()
    if nodes == "pairs" and (c.size < 4 or c.size % 2):
        pytest.skip("pairs of ranks as nodes need an even world of at least 4")
    layout = pseudo_nodes(c, 2) if nodes == "pairs" else None
    x = data(c, n, np.float32)
    mean = (global_sum(c, x) / c.size).astype(np.float32)
    av = mg.AllreduceAverager(x, comm=c, wire=fmt, algorithm="node-ring", layout=layout)
    assert av._node_compressed is not None
    av.average()
    assert same_on_all_ranks(c, x.tobytes()), "ranks disagree after a node-aware compressed mean"
    tol = {"bf16": 2.0 ** -7, "fp16": 2.0 ** -9, "int8": 2.0 ** -5}[fmt] * np.abs(mean).max()
    np.testing.assert_allclose(x, mean, rtol=0, atol=tol)
    node = c.Split_type(MPI.COMM_TYPE_SHARED)
    if node.Get_size() == c.size and layout is None:   # one node: full precision all the way
        np.testing.assert_allclose(x, mean, rtol=1e-6, atol=1e-6 * np.abs(mean).max())
    node.Free()
    x[:] = data(c, n, np.float32)
    av.start()
    av.finish()
    assert same_on_all_ranks(c, x.tobytes())
    np.testing.assert_allclose(x, mean, rtol=0, atol=tol)
    av.free()
    if layout is not None:
        layout.free()
