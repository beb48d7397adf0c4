"""Ranks that leave (uneven data shards, ``mpigossip.Join``): PushSum hands a leaver's whole
(x, w) to a survivor and goes on over the others; nothing hangs, no mass is lost, on every
buffer kind, synchronous and overlapping, one rank or several at a time."""

import numpy as np
import pytest

import mpigossip as mg
from mpigossip import topology as T

from .helpers import comm, global_sum
from .test_kinds import KINDS, make, to_host

EXACT = 1e-12  # relative drift of Σx that float64 rounding explains; a lost share is far larger


def data(rank, n=1031):
    return np.random.default_rng(700 + rank).integers(-1000, 1000, n).astype(np.float64)


# Batches per rank. Shards differ by 2 or more, so that when a rank ends its loop the ranks
# with fewer batches have all handed off (a rank leaves two steps after its loop: the step in
# which it asks, then the hand-off), and the check after the loop runs over exactly those left.
SCHEDULES = {
    "one at a time": lambda r: 3 + 2 * r,
    "two at a time": lambda r: 3 + 2 * (r // 2),
    "all at once": lambda r: 4,
}


def run(kind, stage, overlap, shards, max_delay=1, wire=None):
    """Every rank trains on its shard inside ``Join``, adding its rank + 1 to x per batch; the
    ranks with the longest shard check, before they leave, that they hold all the mass."""
    c = comm()
    n = [shards(r) for r in range(c.size)]
    x = make(kind, data(c.rank))
    ps = mg.PushSum(x, comm=c, topology=T.ExponentialGraph(peers=1), stage=stage, max_delay=max_delay, wire=wire)
    with mg.Join(ps):
        for _ in range(n[c.rank]):
            x += c.rank + 1
            if overlap:
                ps.start()
                ps.finish()
            else:
                ps.step()
        if n[c.rank] == max(n):  # the others have left: Σx and Σw over these hold everything
            ps.drain()
            last = [r for r in range(c.size) if n[r] == max(n)]
            assert ps.members == last and ps.size == len(last)
            total = sum(data(r) for r in range(c.size)) + sum((r + 1) * n[r] for r in range(c.size))
            held = global_sum(ps.comm, to_host(x))
            scale = sum(np.abs(data(r)).sum() for r in range(c.size)) + sum((r + 1) * n[r] for r in range(c.size))
            assert np.abs(held - total).max() <= EXACT * scale, "mass lost or counted twice in a hand-off"
            assert abs(ps.comm.allreduce(ps.weight) - c.size) < 1e-12
    assert ps.left and ps.weight == 0.0
    expected = {}
    for r in range(c.size):
        expected.setdefault(n[r] + 1, []).append(r)  # asks at step n, hands off at the top of n + 1
    mine = [(s, rs) for s, rs in sorted(expected.items()) if s <= n[c.rank] + 1]
    assert ps.departures == mine
    assert np.all(np.isfinite(to_host(x)))
    return ps, x, n


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind, stage", KINDS)
@pytest.mark.parametrize("overlap", [False, True], ids=["step", "overlap"])
def test_uneven_shards_leave_one_at_a_time_with_the_mass_exact(kind, stage, overlap):
    run(kind, stage, overlap, SCHEDULES["one at a time"])


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("schedule", ["two at a time", "all at once"])
@pytest.mark.parametrize("overlap,max_delay", [(False, 1), (True, 0), (True, 2)])
def test_several_ranks_leave_at_once(schedule, overlap, max_delay):
    run("numpy", None, overlap, SCHEDULES[schedule], max_delay=max_delay)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("overlap", [False, True], ids=["step", "overlap"])
def test_a_compressed_pushsum_hands_off_in_full_precision(overlap):
    """With int8 messages the sender keeps its rounding error: the hand-off must carry it too
    (in the buffer's dtype), or Σx drifts by the format's rounding."""
    run("numpy", None, overlap, SCHEDULES["one at a time"], wire="int8")


@pytest.mark.mpi(min_size=2)
def test_the_last_rank_keeps_the_average():
    """All mass ends on the last rank (weight = world size): the model it leaves with is the
    exact average of everything the ranks started with and added."""
    c = comm()
    ps, x, n = run("numpy", None, False, SCHEDULES["one at a time"])
    if c.rank == c.size - 1:
        total = sum(data(r) for r in range(c.size)) + sum((r + 1) * n[r] for r in range(c.size))
        np.testing.assert_allclose(x, total / c.size, rtol=1e-12, atol=1e-9)


@pytest.mark.mpi(min_size=2)
def test_join_and_leave_misuse_raise():
    c = comm()
    x = data(c.rank)
    ps = mg.PushSum(x, comm=c)
    with pytest.raises(RuntimeError, match="join"):
        ps.leave()
    ps.free()
    # Joining at different steps: the same error on every rank.
    x = data(c.rank)
    a = mg.PushSum(x, comm=c, topology=T.ExponentialGraph(peers=1))
    b = mg.PushSum(data(c.rank), comm=c, topology=T.ExponentialGraph(peers=1))
    a.steps += c.rank % 2  # as if the ranks stood at different steps
    with pytest.raises(RuntimeError, match="same step"):
        a.join()
    b.join()
    b.leave()
    with pytest.raises(RuntimeError, match="has left"):
        b.step()
    b.free()  # a no-op once left
    a.steps -= c.rank % 2
    a.free()
    with pytest.raises(TypeError, match="join"):
        mg.Join(object())


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind, stage", KINDS)
@pytest.mark.parametrize("algorithm", ["mpi", "ring", "node-ring"])
@pytest.mark.parametrize("overlap", [False, True], ids=["average", "start-finish"])
def test_allreduce_join_averages_over_the_ranks_still_training(kind, stage, algorithm, overlap):
    """DDP's join: rank r has 2 + r batches; in each round the ranks still training put a
    value of their own in the buffer and every rank, those that left too, ends with the mean
    over the ranks still training (to float64 rounding: the sum is scaled by 1/size, then by
    size/live; a zero not added, a stale value or a wrong divisor is off by a whole value)."""
    c = comm()
    n = [2 + r for r in range(c.size)]
    x = make(kind, data(c.rank))
    avg = mg.AllreduceAverager(x, comm=c, algorithm=algorithm, stage=stage)

    def mean_of(k):  # the mean of what the ranks still training at round k put in
        live = [r for r in range(c.size) if n[r] > k]
        return sum(data(r) * 720 + k for r in live) / len(live), len(live)

    with mg.Join(avg):
        for k in range(n[c.rank]):
            x[...] = make(kind, data(c.rank) * 720 + k)
            if overlap:
                avg.start()
                avg.finish()
            else:
                avg.average()
            expected, live = mean_of(k)
            assert avg.active == live
            np.testing.assert_allclose(to_host(x), expected, rtol=1e-14, atol=1e-9)
    # After leaving, x followed the others' means: it holds the last one.
    last, _ = mean_of(max(n) - 1)
    np.testing.assert_allclose(to_host(x), last, rtol=1e-14, atol=1e-9)
    assert avg.left and avg.active == 0
    avg.free()


@pytest.mark.mpi(min_size=2)
def test_allreduce_join_misuse_raises():
    c = comm()
    avg = mg.AllreduceAverager(data(c.rank), comm=c)
    with pytest.raises(RuntimeError, match="join"):
        avg.leave()
    avg.steps += c.rank % 2
    with pytest.raises(RuntimeError, match="same step"):
        avg.join()
    avg.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind, stage", KINDS)
@pytest.mark.parametrize("drain_every", [0, 3], ids=["no-drain", "drain-every-3"])
def test_agp_ranks_leave_with_the_mass_exact(kind, stage, drain_every):
    """Asynchronous Gradient Push: rank r has 3 + 2r batches and never waits; a rank out of
    data leaves at once and is dropped at the others' next drain (every 3 of their steps, or
    only when the last ranks drain). The ranks with the longest shard then hold all the mass."""
    c = comm()
    n = [3 + 2 * r for r in range(c.size)]
    x = make(kind, data(c.rank))
    ps = mg.AsyncPushSum(x, comm=c, topology=T.ExponentialGraph(peers=1), stage=stage)
    with mg.Join(ps):
        for k in range(n[c.rank]):
            x += c.rank + 1
            ps.step()
            if drain_every and k % drain_every == drain_every - 1:
                ps.drain()
        if n[c.rank] == max(n):
            ps.drain()  # meets the ranks waiting in leave(): they drop out here
            assert ps.members == [c.size - 1] and ps.size == 1
            total = sum(data(r) for r in range(c.size)) + sum((r + 1) * n[r] for r in range(c.size))
            scale = sum(np.abs(data(r)).sum() for r in range(c.size)) + sum((r + 1) * n[r] for r in range(c.size))
            assert np.abs(to_host(x) - total).max() <= EXACT * scale, "mass lost or counted twice"
            assert abs(ps.weight - c.size) < 1e-12
    assert ps.left and ps.weight == 0.0
    assert np.all(np.isfinite(to_host(x)))
    assert any(c.rank in rs for _, rs in ps.departures)


@pytest.mark.mpi(min_size=2)
def test_agp_sends_a_leaving_rank_nothing_more():
    """Rank 0 leaves at once; the others step 40 times before their first drain. Told by the
    notice, they stop giving it shares (and take back those put aside for it): it receives at
    most the few sent before the notice arrived. Without the notice every exchange with it
    would park a share there until the drain (with 40 steps, 10 or more per rank)."""
    c = comm()
    x = data(c.rank)
    ps = mg.AsyncPushSum(x, comm=c, topology=T.ExponentialGraph(peers=1))
    with mg.Join(ps):
        if c.rank:
            for _ in range(40):
                ps.step()
            ps.drain()
            assert abs(ps.comm.allreduce(ps.weight) - c.size) < 1e-12
    assert ps.left
    if c.rank == 0:
        assert ps.received.sum() <= 3 * (c.size - 1), f"received {ps.received} after leaving"


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", ["sgp", "osgp", "agp"])
def test_torch_wrappers_leave_with_uneven_shards(name):
    """The torch SGP family under ``Join``, two parameter groups (float64 and float32): rank r
    takes 3 + 2r optimizer steps of +lr (r + 1) per element. SGP and OSGP apply each update to
    the numerators, so the ranks with the longest shard end with Σx = Σ_r lr (r + 1) n_r and
    Σw = world size; AGP (x = w z) ends with Σw exact. No rank hangs; each leaves with a
    finite model."""
    torch = pytest.importorskip("torch")
    import mpigossip.torch as mgt

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Parameter(torch.zeros(7, dtype=torch.float64))
            self.b = torch.nn.Parameter(torch.zeros(3, dtype=torch.float32))

    c = comm()
    n = [3 + 2 * r for r in range(c.size)]
    lr = 0.25
    model = Two()
    algo = {"sgp": mgt.SGP, "osgp": mgt.OSGP, "agp": mgt.AGP}[name](model, comm=c)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    with mg.Join(algo):
        for _ in range(n[c.rank]):
            for p in model.parameters():
                p.grad = torch.full_like(p, -(c.rank + 1.0))
            opt.step()
            algo.step()
        if n[c.rank] == max(n):
            algo.drain()
            for ps, x in zip(algo.comms, algo.numerators):
                assert ps.size == 1 and abs(ps.weight - c.size) < 1e-9
                if name != "agp":
                    expected = lr * sum((r + 1) * n[r] for r in range(c.size))
                    np.testing.assert_allclose(np.asarray(x, np.float64), expected, rtol=1e-5)
    assert algo.left
    for p in model.parameters():
        assert torch.isfinite(p).all()
    with pytest.raises(RuntimeError, match="left"):
        algo.step()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("overlap", [False, True], ids=["step", "overlap"])
def test_joined_and_freed_without_leaving(overlap):
    """Joined, stepped, freed without anyone leaving: the last step's flags are completed (no
    request left on a freed communicator), and a second PushSum then works as usual."""
    c = comm()
    x = data(c.rank)
    ps = mg.PushSum(x, comm=c)
    ps.join()
    for _ in range(3):
        if overlap:
            ps.start()
            ps.finish()
        else:
            ps.step()
    assert ps._members._request is not None  # posted at the last step, not yet completed
    ps.free()
    assert ps.closed
    y = data(c.rank)
    with mg.PushSum(y, comm=c) as again:
        again.step()
