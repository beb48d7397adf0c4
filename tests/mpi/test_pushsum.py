import random
import time

import numpy as np
import pytest

import mpigossip as mg
from mpigossip import topology as T
from mpigossip.decentralized.pushsum_base import PushSumBase

from .helpers import comm, consensus_distance, global_sum, same_on_all_ranks


def integer_data(c, n=257):
    rng = np.random.default_rng(100 + c.rank)
    return rng.integers(-1000, 1000, n).astype(np.float64)


def topologies(size):
    out = [T.ExponentialGraph(peers=1), T.RingGraph(), T.RandomPeers(peers=1, seed=7)]
    if size >= 4:
        out.append(T.ExponentialGraph(peers=2) if size < 5 else T.ExponentialGraph(peers=3))
    return out


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("index", range(4))
def test_sync_step_conserves_sum_x_and_sum_w_exactly(index):
    """Shares 1/2 (and 1/4) are exact in float64: any drift is a lost or double-counted message."""
    c = comm()
    topos = topologies(c.size)
    if index >= len(topos):
        pytest.skip("topology needs more ranks")
    topo = topos[index]
    share = 1.0 / (len(topo.bind(c.size).out_peers(0, 0)) + 1)
    if share not in (1.0, 0.5, 0.25):
        pytest.skip("shares not dyadic at this size: arithmetic not exact")
    x = integer_data(c)
    total = global_sum(c, x)
    ps = mg.PushSum(x, comm=c, topology=topo)
    # Each step adds log2(1/share) bits to the denominators: stay within float64's 53 bits.
    for _ in range(24 if share == 0.5 else 12):
        ps.step()
        assert np.array_equal(global_sum(c, x), total), f"sum x drifted at step {ps.steps}"
        assert c.allreduce(ps.weight) == c.size
    ps.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("chunk_bytes, slots", [(8, 1), (40, 2), (56, 3), (2048, 2)])
def test_chunked_step_is_bitwise_the_whole_buffer_step(chunk_bytes, slots):
    """Pipelined chunks (1, 5 and 7 elements, a ragged last chunk, slots reused many times)
    must give exactly what one whole-buffer exchange gives, on regular and non-regular
    graphs, including the fused de-bias."""
    c = comm()
    topos = [T.ExponentialGraph(peers=1), T.RandomPeers(peers=1, seed=3)]
    if c.size >= 4:
        topos.append(T.ExponentialGraph(peers=2))
    for topo in topos:
        x = np.random.default_rng(c.rank).standard_normal(257)
        ref = x.copy()
        z, zref = np.zeros_like(x), np.zeros_like(x)
        chunked = mg.PushSum(x, comm=c, topology=topo, z=z, chunk_bytes=chunk_bytes, slots=slots)
        whole = mg.PushSum(ref, comm=c, topology=topo, z=zref, chunk_bytes=1 << 20)
        for _ in range(6):
            chunked.step()
            whole.step()
            assert np.array_equal(x, ref) and np.array_equal(z, zref), f"{topo!r} step {chunked.steps}"
            assert chunked.weight == whole.weight
        chunked.free()
        whole.free()


@pytest.mark.mpi(min_size=2)
def test_chunk_settings_must_agree_on_every_rank():
    c = comm()
    with pytest.raises(ValueError) as err:
        mg.PushSum(np.zeros(100), comm=c, chunk_bytes=64 if c.rank else 128)
    assert "chunk_bytes differs across ranks" in str(err.value) and same_on_all_ranks(c, str(err.value))
    with pytest.raises(ValueError) as err:
        mg.PushSum(np.zeros(100), comm=c, slots=0 if c.rank == 1 else 2)
    assert "rank 1: slots must be an integer >= 1, got 0" in str(err.value)
    assert same_on_all_ranks(c, str(err.value))


@pytest.mark.mpi(min_size=3)
def test_non_regular_graph_weights_vary_and_z_is_correct():
    c = comm()
    x = integer_data(c)
    mean = global_sum(c, x) / c.size
    ps = mg.PushSum(x, comm=c, topology=T.RandomPeers(peers=1, seed=11))
    weights = set()
    for _ in range(60):
        ps.step()
        weights.add(round(ps.weight, 12))
    assert len(set().union(*c.allgather(weights))) > 1, "w never changed on a non-regular graph"
    np.testing.assert_allclose(ps.debiased(), mean, rtol=1e-6, atol=1e-6)
    ps.free()


@pytest.mark.mpi(min_size=2)
def test_exact_average_after_log2_steps_on_power_of_two():
    c = comm()
    if c.size & (c.size - 1):
        pytest.skip("world size is not a power of two")
    x = integer_data(c)
    mean = global_sum(c, x) / c.size
    z = np.zeros_like(x)
    ps = mg.PushSum(x, comm=c, topology=T.ExponentialGraph(peers=1), z=z)
    for _ in range(c.size.bit_length() - 1):
        ps.step()
    assert ps.z is z
    assert np.array_equal(z, mean)  # fused de-bias of the last combine
    assert np.array_equal(ps.debiased(), mean)
    ps.free()


@pytest.mark.mpi(min_size=3)
def test_consensus_distance_falls_geometrically():
    c = comm()
    x = integer_data(c)
    ps = mg.PushSum(x, comm=c, topology=T.ExponentialGraph(peers=1))
    d0 = consensus_distance(c, ps.debiased())
    for _ in range(30):
        ps.step()
    d30 = consensus_distance(c, ps.debiased())
    assert d30 < 1e-6 * d0
    ps.free()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("max_delay", [0, 1, 3])
def test_overlap_with_random_delays_conserves_mass_after_drain(max_delay):
    c = comm()
    x = integer_data(c)
    total = global_sum(c, x)
    ps = mg.PushSum(x, comm=c, topology=T.ExponentialGraph(peers=1), max_delay=max_delay)
    rng = random.Random(c.rank)
    for _ in range(40):
        ps.start()
        if rng.random() < 0.3:
            time.sleep(rng.random() * 0.004)  # a slow step
        ps.finish()
        x -= 0.0  # the gradient step would go here
    ps.drain()
    assert not ps.in_flight
    assert np.array_equal(global_sum(c, x), total)
    assert c.allreduce(ps.weight) == c.size
    for _ in range(120):  # then converge without delays (rate depends on timing at max_delay > 0)
        ps.start()
        ps.finish()
    ps.drain()
    np.testing.assert_allclose(ps.debiased(), total / c.size, rtol=1e-7, atol=1e-7)
    ps.free()


@pytest.mark.mpi(min_size=2)
def test_overlap_consumes_late_messages_within_the_bound():
    """Rank 0 sleeps at every step: the others run ahead, but never more than max_delay."""
    c = comm()
    x = integer_data(c)
    total = global_sum(c, x)
    ps = mg.PushSum(x, comm=c, topology=T.RingGraph(), max_delay=2)
    for _ in range(10):
        ps.start()
        if c.rank == 0:
            time.sleep(0.01)
        ps.finish()
        assert all(m.step >= ps.steps - 2 for m in ps._osgp.pending)
    ps.drain()
    assert np.array_equal(global_sum(c, x), total)
    ps.free()


@pytest.mark.mpi(min_size=2)
def test_step_while_in_flight_and_bad_arguments():
    c = comm()
    x = np.zeros(8)
    ps = mg.PushSum(x, comm=c, max_delay=1)
    ps.start()
    with pytest.raises(RuntimeError, match="finish"):
        ps.start()
    ps.finish()
    ps.free()
    with pytest.raises(ValueError) as err:
        mg.PushSum(x, comm=c, topology=T.ExponentialGraph(peers=c.size + 1))
    assert "needs at least" in str(err.value) and same_on_all_ranks(c, str(err.value))
    with pytest.raises(ValueError, match="max_delay"):
        mg.PushSum(x, comm=c, max_delay=-1)
    with pytest.raises(ValueError, match="differs across ranks"):
        mg.PushSum(np.zeros(8 + c.rank), comm=c)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_low_precision_and_staged(dtype):
    c = comm()
    x = np.full(100, float(c.rank), dtype=dtype)
    ps = mg.PushSum(x, comm=c, topology=T.CompleteGraph(), stage=True)
    ps.step()
    np.testing.assert_allclose(ps.debiased().astype(np.float64), (c.size - 1) / 2, rtol=1e-2)
    assert ps.debiased().dtype == dtype
    ps.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("topology", ["exponential", "random"])
def test_agp_reaches_consensus_without_waiting(topology):
    """Asynchronous Gradient Push: rank r starts at r (a constant vector); a step is 1 ms of
    "compute" and one exchange; the last rank runs half as many steps more. After drain() the
    mean is exact and every z = x / w is near it (within 1% of the initial spread, P - 1).
    Without any compute between steps a rank can finish before any message has moved, and
    mixing then depends on who ran ahead: AGP mixes as fast as the ranks' messages arrive."""
    c = comm()
    x = np.full(256, float(c.rank))
    ps = mg.PushSum(x, comm=c, topology=mg.topology.make(topology, seed=1), max_delay=None)
    # a sibling of PushSum with its own contract, not a PushSum
    assert isinstance(ps, mg.AsyncPushSum) and not isinstance(ps, mg.PushSum)
    assert isinstance(ps, PushSumBase)
    for _ in range(60 if c.rank < c.size - 1 else 90):
        time.sleep(1e-3)
        ps.step()
    ps.drain()
    z = ps.debiased()
    mean = (c.size - 1) / 2
    assert global_sum(c, x)[0] == pytest.approx(c.size * mean, rel=1e-12)
    assert np.all(z == z[0]), "a share was added to part of the vector"
    spread = max(c.allgather(abs(float(z[0]) - mean)))
    assert spread < 1e-2 * (c.size - 1), spread
    assert "AsyncPushSum" in repr(ps) and "idle" in repr(ps)
    ps.free()
    with pytest.raises(RuntimeError, match="freed"):
        ps.step()


@pytest.mark.mpi(min_size=1)
def test_agp_bad_arguments():
    c = comm()
    with pytest.raises(ValueError, match="takes no z"):
        mg.PushSum(np.zeros(4), comm=c, max_delay=None, z=np.zeros(4))
    with pytest.raises(ValueError, match="receives must be an integer >= 1"):
        mg.AsyncPushSum(np.zeros(4), comm=c, receives=0)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="max_delay must be an integer >= 0 or None"):
            mg.PushSum(np.zeros(4), comm=c, max_delay=bad)
    ps = mg.PushSum(np.zeros(4), comm=c, max_delay=None)
    with pytest.raises(RuntimeError, match="start"):
        ps.finish()
    ps.start()
    with pytest.raises(RuntimeError, match="finish"):
        ps.start()
    with pytest.raises(RuntimeError, match="finish"):
        ps.drain()
    ps.finish()
    ps.free()


class _FakeEvent:
    def __init__(self, log):
        self.log, self.done = log, False

    def synchronize(self):
        self.done = True


class _FakeCuda:
    """Just enough of cupy.cuda for Transport's ordering of device work (no GPU needed)."""

    def __init__(self):
        self.events = []
        cuda = self

        class Stream:
            def record(self, event):
                cuda.events.append(event)
                return event

        self.stream = Stream()
        self.Event = lambda disable_timing=True: _FakeEvent(cuda.events)

    def get_current_stream(self):
        return self.stream


@pytest.mark.mpi(min_size=2)
def test_agp_reposts_a_receive_only_after_the_combine_reading_it(monkeypatch):
    """With device buffers handed to MPI directly (CUDA-aware), AGP's combine is a kernel that
    reads a receive buffer asynchronously: the next Irecv into that buffer must wait for it,
    or MPI overwrites a share the kernel has not read yet (silently wrong mass). Here the
    receive buffers pose as device memory with a fake CUDA: every combine must record an
    event on the slot, and the next receive posted into the slot must first wait for it."""
    from types import SimpleNamespace

    from mpigossip.core import buffers
    c = comm()
    fake = _FakeCuda()
    monkeypatch.setattr(buffers, "_cupy", lambda: SimpleNamespace(cuda=fake))
    x = np.full(64, float(c.rank))
    ps = mg.AsyncPushSum(x, comm=c)
    for slot in ps._slots:
        slot.transport.buffer.on_device = True  # its kernels still run in numpy, at once
    for _ in range(20):
        time.sleep(1e-3)
        ps.step()
    ps.drain()
    monkeypatch.undo()
    combined = int(ps.received.sum())
    assert combined > 0
    assert len(fake.events) == combined, "a combine read a receive slot without recording an event"
    waited = sum(e.done for e in fake.events)  # by Transport.memory, before the slot went to MPI again
    assert waited >= combined - len(ps._slots), "a receive was posted into a slot a combine may still read"
    ps.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("on_failure", ["abort", "continue"])
def test_agp_posts_a_known_senders_next_receive_before_its_share_arrives(on_failure, recwarn):
    """A share that arrives with no receive posted sits in MPI's queue of unexpected messages
    (a copy, and MPI memory of a model's size): after the first share from a rank, that rank
    owns a slot whose receives are posted again at once. With the default slots (one per
    in-peer of the exponential graph, and one more) most shares land in a receive posted
    ahead; with ``receives=1`` none do. Each epoch's receives posted ahead are cancelled at
    its drain (the next has other tags): training goes on over two epochs, mass exact at
    each drain, and nothing is left posted at the end."""
    c = comm()
    counts = {}
    for receives in (None, 1):
        x = np.full(4096, float(c.rank))
        ps = mg.AsyncPushSum(x, comm=c, receives=receives, on_failure=on_failure)
        if receives is None:
            graph = T.ExponentialGraph(peers=1, size=c.size)
            peers = {p for k in range(graph.period) for p in graph.in_peers(c.rank, k)}
            assert len(ps._slots) == min(len(peers), 4) + 1
        for _ in range(2):   # two epochs: the second posts with the other tags
            for _ in range(80):
                time.sleep(5e-4)
                ps.step()
            ps.drain()
            assert global_sum(c, x)[0] == pytest.approx(c.size * (c.size - 1) / 2, rel=1e-12)
            assert c.allreduce(ps.weight) == pytest.approx(c.size, rel=1e-12)
            assert not ps.in_flight and all(s.src is None and s.message is None for s in ps._slots)
        counts[receives] = (int(ps.received.sum()), ps.preposted)
        ps.free()
    received, ahead = counts[None]
    assert received > 0 and ahead <= received
    assert c.allreduce(ahead) >= c.allreduce(received) // 2, counts   # most shares, over all ranks
    assert counts[1][1] == 0 and counts[1][0] > 0, counts
