import time

import numpy as np
import pytest

import mpigossip as mg

from .helpers import comm, same_on_all_ranks


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("stage", [None, True])
def test_blocking_and_nonblocking_exact_mean(dtype, stage):
    c = comm()
    n = 1001
    x = (np.arange(n) * (c.rank + 1)).astype(dtype)
    expected = np.arange(n) * (c.size + 1) / 2.0
    with mg.AllreduceAverager(x, comm=c, stage=stage) as avg:
        avg.average()
        np.testing.assert_allclose(x, expected, rtol=1e-6)
        x[:] = (np.arange(n) * (c.rank + 1)).astype(dtype)
        avg.start()
        assert avg.in_flight
        avg.finish()
        np.testing.assert_allclose(x, expected, rtol=1e-6)
        assert avg.steps == 2 and "steps=2" in repr(avg)


@pytest.mark.mpi(min_size=2)
def test_start_returns_before_completion_is_forced():
    """Rank 0 joins the Iallreduce late: on the others start() must have returned
    with the request still incomplete (it cannot complete without rank 0)."""
    c = comm()
    x = np.full(64, float(c.rank))
    avg = mg.AllreduceAverager(x, comm=c)
    flag = np.zeros(1)
    if c.rank == 0:
        c.Recv(flag, source=1, tag=99)  # wait until rank 1 has checked
        avg.start()
    else:
        avg.start()
        assert not avg.test(), "Iallreduce completed without rank 0"
        if c.rank == 1:
            c.Send(flag, dest=0, tag=99)
    avg.finish()
    assert np.all(x == (c.size - 1) / 2.0)
    avg.free()


@pytest.mark.mpi(min_size=2)
def test_different_lengths_raise_same_error_everywhere():
    c = comm()
    x = np.zeros(10 + (c.rank == c.size - 1))
    t0 = time.monotonic()
    with pytest.raises(ValueError) as err:
        mg.AllreduceAverager(x, comm=c)
    assert time.monotonic() - t0 < 30
    assert "differs across ranks" in str(err.value) and f"rank {c.size - 1}: 11" in str(err.value)
    assert same_on_all_ranks(c, str(err.value))


@pytest.mark.mpi(min_size=2)
def test_bad_buffer_on_one_rank_raises_everywhere():
    c = comm()
    x = np.zeros((4, 4))[:, 0] if c.rank == 1 else np.zeros(4)
    with pytest.raises(ValueError) as err:
        mg.AllreduceAverager(x, comm=c)
    assert "rank 1: buf: array of shape (4,)" in str(err.value) and "not C-contiguous" in str(err.value)
    assert same_on_all_ranks(c, str(err.value))
    y = np.zeros(4, dtype=np.float32 if c.rank == 0 else np.float64)
    with pytest.raises(ValueError, match="differs across ranks"):
        mg.AllreduceAverager(y, comm=c)


@pytest.mark.mpi(min_size=1)
def test_misuse():
    c = comm()
    avg = mg.AllreduceAverager(np.zeros(3), comm=c)
    with pytest.raises(RuntimeError, match="start"):
        avg.finish()
    avg.start()
    with pytest.raises(RuntimeError, match="in flight"):
        avg.average()
    avg.free()  # completes the average in flight first
    assert "freed" in repr(avg)
    with pytest.raises(ValueError, match="timeout"):
        mg.AllreduceAverager(np.zeros(3), comm=c, timeout=0)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("chunk_bytes", [8, 24, 1000, 1 << 20])
def test_chunked_average_is_exact(chunk_bytes):
    """Chunks of 1 and 3 elements, a ragged last chunk, one chunk: every element reduced once."""
    c = comm()
    x = (np.arange(1001) * (c.rank + 1)).astype(np.float64)
    with mg.AllreduceAverager(x, comm=c, chunk_bytes=chunk_bytes) as avg:
        avg.average()
    np.testing.assert_array_equal(x, np.arange(1001) * (c.size + 1) / 2.0)


@pytest.mark.mpi(min_size=1)
def test_default_chunks_follow_the_transport():
    """4 MiB chunks when every rank shares one node (in-cache scaling), the whole buffer when
    the ranks span nodes (each chunk would cost the network's latency rounds again)."""
    from mpi4py import MPI
    c = comm()
    shared = c.Split_type(MPI.COMM_TYPE_SHARED)
    one_node = c.allreduce(shared.Get_size() == c.size, op=MPI.LAND)
    shared.Free()
    x = (np.arange(3 << 20) % 1000 * (c.rank + 1)).astype(np.float32)  # 12 MB: 3 chunks on one node
    with mg.AllreduceAverager(x, comm=c) as avg:
        assert avg.chunk_bytes == (4 << 20 if one_node else x.nbytes)
        avg.average()
    np.testing.assert_array_equal(x, (np.arange(3 << 20) % 1000 * (c.size + 1) / 2.0).astype(np.float32))
    with mg.AllreduceAverager(x, comm=c, chunk_bytes=1000) as avg:
        assert avg.chunk_bytes == 1000


@pytest.mark.mpi(min_size=2)
def test_chunk_bytes_must_agree_and_be_positive_on_every_rank():
    """Different chunk sizes would pair chunks of different lengths in Allreduce."""
    c = comm()
    with pytest.raises(ValueError) as err:
        mg.AllreduceAverager(np.zeros(100), comm=c, chunk_bytes=64 if c.rank else 128)
    assert "chunk_bytes differs across ranks" in str(err.value) and "rank 0: 128" in str(err.value)
    assert same_on_all_ranks(c, str(err.value))
    with pytest.raises(ValueError) as err:
        mg.AllreduceAverager(np.zeros(100), comm=c, chunk_bytes=0 if c.rank == 1 else 64)
    assert "rank 1: chunk_bytes must be an integer >= 1, got 0" in str(err.value)
    assert same_on_all_ranks(c, str(err.value))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("make", [
    lambda x, c: mg.AllreduceAverager(x, comm=c), lambda x, c: mg.PushSum(x, comm=c),
    lambda x, c: mg.Gossip(x, comm=c), lambda x, c: mg.DPSGD(x, comm=c), lambda x, c: mg.ADPSGD(x, comm=c),
], ids=["AllreduceAverager", "PushSum", "Gossip", "DPSGD", "ADPSGD"])
def test_a_read_only_buffer_on_one_rank_raises_everywhere_at_construction(make):
    """It used to fail on that rank alone, mid-step (numpy's "output array is read-only"),
    while the others waited for the deadline."""
    c = comm()
    x = np.zeros(8)
    x.flags.writeable = c.rank != 1
    with pytest.raises(ValueError) as err:
        make(x, c)
    assert "rank 1: x is read-only" in str(err.value).replace("buf is", "x is"), str(err.value)
    assert same_on_all_ranks(c, str(err.value))


@pytest.mark.mpi(min_size=2)
def test_pushsum_z_not_matching_x_on_one_rank_raises_everywhere():
    c = comm()
    x = np.zeros(8)
    z = np.zeros(8, dtype=np.float32 if c.rank == 1 else np.float64)
    with pytest.raises(ValueError) as err:
        mg.PushSum(x, comm=c, z=z)
    assert "rank 1: z must match x" in str(err.value), str(err.value)
    assert same_on_all_ranks(c, str(err.value))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", ["ring", "node-ring"])
@pytest.mark.parametrize("dtype", [np.float16, np.float64])
@pytest.mark.parametrize("n", [1, 7, 70001])
def test_the_rings_give_the_exact_mean_and_the_same_bytes_everywhere(algorithm, dtype, n):
    """The ring and node-aware ring (mpigossip.exact.ring) forced, on sizes below the world size
    (empty blocks), ragged ones and several segments per block: the exact mean of integer data,
    the same bytes on every rank, blocking and nonblocking (start, test until done, finish)
    alike, and repeated use of the same scratch."""
    c = comm()
    def data():
        return ((np.arange(n) % 17) * (c.rank + 1)).astype(dtype)
    expected = (np.arange(n) % 17) * (c.size + 1) / 2.0
    x = data()
    with mg.AllreduceAverager(x, comm=c, algorithm=algorithm, segment_bytes=64 * 4) as avg:
        assert avg.algorithm == algorithm and algorithm in repr(avg)
        for _ in range(2):
            x[:] = data()
            avg.average()
            np.testing.assert_allclose(x, expected, rtol=1e-3 if dtype == np.float16 else 1e-12)
            assert same_on_all_ranks(c, x.tobytes())
        x[:] = data()
        avg.start()
        while not avg.test():
            pass
        avg.finish()
        np.testing.assert_allclose(x, expected, rtol=1e-3 if dtype == np.float16 else 1e-12)
        assert same_on_all_ranks(c, x.tobytes()) and avg.steps == 3


@pytest.mark.mpi(min_size=1)
def test_a_bad_algorithm_or_segment_is_refused_on_every_rank():
    c = comm()
    cases = [({"algorithm": "tree"}, "algorithm must be one of"),
             ({"segment_bytes": 0}, "segment_bytes must be an integer >= 1")]
    if c.size > 1:
        cases.append(({"algorithm": "ring" if c.rank == 0 else "mpi"}, "algorithm differs across ranks"))
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message) as err:
            mg.AllreduceAverager(np.zeros(8), comm=c, **kwargs)
        assert same_on_all_ranks(c, str(err.value))


def _start_all_finish_in_reverse(c, avgs, xs):
    """Start every averager, drive them to completion newest first, and check each exact mean
    (rank r, averager i holds ``r + 10 i``)."""
    for a in avgs:
        a.start()
    done = set()
    while len(done) < len(avgs):
        for i in reversed(range(len(avgs))):
            if i not in done and avgs[i].test():
                done.add(i)
    for i, (a, x) in enumerate(zip(avgs, xs)):
        a.finish()
        np.testing.assert_array_equal(x, np.full(x.size, (c.size - 1) / 2 + 10 * i))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm", ["ring", "node-ring"])
def test_rings_in_flight_together_on_one_communicator_keep_their_messages(algorithm):
    """A model's gradient buckets: several averagers on one communicator (one layout, dup=False),
    started in order and driven in the reverse order, as a backward pass may. With one tag
    scheme for every ring, a later ring's message matched an earlier ring's receive; each ring
    now has tags of its own."""
    from mpigossip.exact.ring import Layout
    c = comm()
    shared = c.Dup()
    layout = Layout(shared, timeout=60)
    xs = [np.full(5000 + 1000 * i, float(c.rank + 10 * i)) for i in range(3)]
    avgs = [mg.AllreduceAverager(x, comm=shared, dup=False, layout=layout, algorithm=algorithm, segment_bytes=4096)
            for x in xs]
    _start_all_finish_in_reverse(c, avgs, xs)
    for a in avgs:
        a.free()
    layout.free()
    shared.Free()


@pytest.mark.mpi(min_size=2)
def test_averagers_with_layouts_of_their_own_on_one_communicator_keep_their_messages():
    """Averagers made with dup=False on one communicator and no shared layout: their tag
    windows come from one count cached on the communicator (each layout had its own count from
    0: the second ring's messages matched the first's receives)."""
    c = comm()
    shared = c.Dup()
    xs = [np.full(6000 + 1000 * i, float(c.rank + 10 * i)) for i in range(2)]
    avgs = [mg.AllreduceAverager(x, comm=shared, dup=False, algorithm="ring", segment_bytes=4096) for x in xs]
    for _ in range(2):
        _start_all_finish_in_reverse(c, avgs, xs)
        for i, x in enumerate(xs):
            x[:] = c.rank + 10 * i
    for a in avgs:
        a.free()
    shared.Free()
