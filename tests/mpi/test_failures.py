"""PushSum, D-PSGD, AllreduceAverager and gossip push with on_failure="continue" while no rank fails: the
same results as the default paths, bit for bit, on every buffer kind (their persistent requests,
one-piece combine and ring must not change the arithmetic: integer data, exact in any order),
and their misuse refused alike on every rank. A rank that does fail: tests/test_faults.py
(launched under ULFM) and the emulated cluster's faults."""

import numpy as np
import pytest
from mpi4py import MPI

import mpigossip as mg
from mpigossip import topology as T
from mpigossip.resilience import failures

from .helpers import comm, global_sum
from .test_kinds import KINDS, integer_data, make, to_host


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("kind, stage", KINDS)
def test_tolerant_step_is_bitwise_the_default_step(kind, stage):
    c = comm()
    topos = [T.ExponentialGraph(peers=1), T.RandomPeers(peers=1, seed=5)]
    if c.size >= 4:
        topos.append(T.ExponentialGraph(peers=2))
    for topo in topos:
        host = integer_data()
        ref, zref = host.copy(), np.zeros_like(host)
        x, z = make(kind, host), make(kind, np.zeros_like(host))
        with pytest.warns(RuntimeWarning, match="without ULFM") if c.rank == 0 and not failures.enabled() else \
                _nothing():
            tolerant = mg.PushSum(x, comm=c, topology=topo, z=z, stage=stage, on_failure="continue")
        plain = mg.PushSum(ref, comm=c, topology=topo, z=zref, chunk_bytes=800)
        total = global_sum(c, ref)
        for _ in range(8):
            tolerant.step()
            plain.step()
            np.testing.assert_array_equal(to_host(x), ref)
            np.testing.assert_array_equal(to_host(z), zref)
            assert tolerant.weight == plain.weight
        np.testing.assert_allclose(global_sum(c, to_host(x)), total, rtol=1e-12, atol=1e-9)  # (exact with shares 1/2)
        assert tolerant.failures == [] and tolerant.steps == 8
        assert abs(c.allreduce(tolerant.weight) - c.size) < 1e-12
        tolerant.free()
        plain.free()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.mpi(min_size=1)
def test_tolerant_misuse_is_refused():
    c = comm()
    x = np.ones(16)
    with pytest.raises(ValueError, match="on_failure must be one of 'abort', 'continue', got 'ignore'"):
        mg.PushSum(x, comm=c, on_failure="ignore")
    with pytest.raises(ValueError, match="on_failure='continue' moves the buffer's own dtype, not wire='bf16'"):
        mg.PushSum(x, comm=c, on_failure="continue", wire="bf16")
    if c.size > 1:
        with pytest.raises(ValueError, match="on_failure"):  # must be the same on every rank
            mg.PushSum(x, comm=c, on_failure="continue" if c.rank == 0 else "abort")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        ps = mg.PushSum(x, comm=c, on_failure="continue")
    with pytest.raises(RuntimeError, match="not with on_failure='continue'"):
        ps.join()
    ps.step()
    ps.free()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("kind, stage", KINDS)
def test_tolerant_overlap_is_the_default_overlap(kind, stage):
    """Overlap mode (start()/finish(), as OSGP) on persistent requests: with max_delay=0 (every
    finish() waits for its step's messages) bit for bit the default overlap path; with
    max_delay=1 Σx and Σw exact once drained, and z = x / w the same on every rank in the end."""
    c = comm()
    for delay in (0, 1):
        host = integer_data()
        ref = host.copy()
        x = make(kind, host)
        tolerant = _quiet(mg.PushSum, x, comm=c, stage=stage, max_delay=delay, on_failure="continue")
        plain = mg.PushSum(ref, comm=c, max_delay=delay)
        total = global_sum(c, ref)
        for k in range(8):
            for ps in (tolerant, plain):
                if ps.started:
                    ps.finish()
                ps.start()
            if delay == 0 and k:
                np.testing.assert_array_equal(to_host(x), ref)
                assert tolerant.weight == plain.weight
        for ps in (tolerant, plain):
            ps.finish()
            ps.drain()
        assert not tolerant.in_flight and tolerant.steps == 8 and tolerant.failures == []
        np.testing.assert_allclose(global_sum(c, to_host(x)), total, rtol=1e-12, atol=1e-9)
        assert abs(c.allreduce(tolerant.weight) - c.size) < 1e-12
        for _ in range(60):     # the synchronous step after a drain: the ranks reach consensus
            tolerant.step()
        z = to_host(x) / tolerant.weight
        np.testing.assert_allclose(z, c.bcast(z), rtol=1e-5, atol=1e-5)
        tolerant.free()
        plain.free()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("kind, stage", KINDS)
def test_tolerant_agp_conserves_mass_and_refuses_join(kind, stage):
    """Asynchronous Gradient Push on persistent requests (on_failure="continue"), no rank failing:
    the ranks step at different paces, and once drained Σx and Σw are exact and z agrees;
    join() (leave) is refused."""
    import time
    c = comm()
    host = integer_data()
    x = make(kind, host)
    total = global_sum(c, host)
    ps = _quiet(mg.PushSum, x, comm=c, stage=stage, max_delay=None, on_failure="continue")
    assert isinstance(ps, mg.AsyncPushSum) and ps.on_failure == "continue"
    for k in range(12 + 3 * c.rank):   # uneven: AGP's ranks need not take the same steps
        ps.step()
        if c.rank == 0:
            time.sleep(0.002)
    ps.drain()
    np.testing.assert_allclose(global_sum(c, to_host(x)), total, rtol=1e-12, atol=1e-9)
    assert abs(c.allreduce(ps.weight) - c.size) < 1e-12 and ps.failures == []
    with pytest.raises(RuntimeError, match="not with on_failure='continue'"):
        ps.join()
    for _ in range(3):   # training goes on after a drain
        ps.step()
    ps.free()


def _quiet(cls, *args, **kwargs):
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "without ULFM": the launch of the MPI tests
        return cls(*args, **kwargs)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("kind, stage", KINDS)
def test_tolerant_dpsgd_and_mean_are_bitwise_the_default(kind, stage):
    c = comm()
    host = integer_data()
    x, ref = make(kind, host), host.copy()
    tolerant = _quiet(mg.DPSGD, x, comm=c, stage=stage, on_failure="continue")
    plain = mg.DPSGD(ref, comm=c, chunk_bytes=800)
    for _ in range(6):
        tolerant.step()
        plain.step()
        np.testing.assert_array_equal(to_host(x), ref)
    assert tolerant.failures == [] and tolerant.members == list(range(c.size))
    tolerant.free()
    plain.free()
    rng = np.random.default_rng(c.rank)
    floats = rng.standard_normal(50_000)
    cases = [(n, algorithm, algorithm) for n in (integer_data(), integer_data(n=max(1, c.size - 1)))
             for algorithm in ("ring", "node-ring")]
    # floats: the one ring schedule, the same additions in the same order (on one node the node-aware
    # ring's halves over the node are the flat ring's); and "auto", which never picks MPI's under continue
    cases += [(floats, "ring", "ring"), (floats, "auto", "auto")]
    one_node = len(set(c.allgather(MPI.Get_processor_name()))) == 1
    if one_node:
        cases.append((floats, "node-ring", "ring"))
    for n, algorithm, reference in cases:
        y, yref = make(kind, n), n.copy()
        tolerant = _quiet(mg.AllreduceAverager, y, comm=c, stage=stage, on_failure="continue", algorithm=algorithm)
        plain = mg.AllreduceAverager(yref, comm=c, algorithm=reference)
        if algorithm == "auto":
            assert tolerant.algorithm in ("ring", "node-ring") and plain.algorithm in ("mpi", "ring", "node-ring")
            if tolerant.algorithm != plain.algorithm:   # (auto picked MPI's for the default: compare within 1 ulp)
                plain.free()
                plain = mg.AllreduceAverager(yref, comm=c, algorithm=tolerant.algorithm)
        for r in range(4):
            fresh = n + r
            yref[...] = fresh
            if hasattr(y, "copy_"):  # torch (CPU or CUDA)
                y.copy_(make(kind, fresh))
            else:                    # numpy, cupy
                y[...] = make(kind, fresh)
            if r % 2:                # start()/test()/finish(): the nonblocking form of the same ring
                tolerant.start()
                plain.start()
                while not (tolerant.test() & plain.test()):
                    pass
                tolerant.finish()
                plain.finish()
            else:
                tolerant.average()
                plain.average()
            np.testing.assert_array_equal(to_host(y), yref, err_msg=f"{algorithm} against {reference}")
            assert len({float(v) for v in c.allgather(float(to_host(y)[0]))}) == 1  # the same on every rank
        assert tolerant.steps == 4 and tolerant.failures == []
        assert f" {tolerant.algorithm} " in repr(tolerant)
        tolerant.free()
        plain.free()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("kind, stage", KINDS)
def test_tolerant_gossip_push_is_bitwise_the_default(kind, stage):
    """The same targets from the seed, and the same fused average of the same messages in the
    same order, self-pushes (weight 2) included: the same bits."""
    c = comm()
    host = integer_data()
    x, ref = make(kind, host), host.copy()
    tolerant = _quiet(mg.Gossip, x, comm=c, mode="push", seed=11, stage=stage, on_failure="continue")
    plain = mg.Gossip(ref, comm=c, mode="push", seed=11)
    for _ in range(6):
        tolerant.step()
        plain.step()
        assert tolerant.last_peers == plain.last_peers
        np.testing.assert_array_equal(to_host(x), ref)
    assert tolerant.failures == [] and tolerant.members == list(range(c.size)) and tolerant.steps == 6
    tolerant.free()
    plain.free()


@pytest.mark.mpi(min_size=1)
def test_tolerant_mean_misuse_is_refused():
    c = comm()
    y = np.ones(16)
    with pytest.raises(ValueError, match="on_failure='continue' moves the buffer's own dtype, not wire='int8'"):
        mg.AllreduceAverager(y, comm=c, on_failure="continue", wire="int8")
    with pytest.raises(ValueError, match="on_failure must be one of"):
        mg.DPSGD(y, comm=c, on_failure=True)
    with pytest.raises(ValueError, match="a pull reads a one-sided window, which Open MPI's fault tolerance"):
        mg.Gossip(y, comm=c, mode="pull", on_failure="continue")
    with pytest.raises(ValueError, match="on_failure='continue' moves the buffer's own dtype, not wire='bf16'"):
        mg.Gossip(y, comm=c, mode="push", wire="bf16", on_failure="continue")
    with pytest.raises(ValueError, match="algorithm='mpi' cannot survive a failed rank"):
        mg.AllreduceAverager(y, comm=c, on_failure="continue", algorithm="mpi")
    avg = _quiet(mg.AllreduceAverager, y, comm=c, on_failure="continue")
    with pytest.raises(RuntimeError, match="not with on_failure='continue'"):
        avg.join()
    avg.average()
    avg.free()


def _Double():
    import torch

    class Double(torch.nn.Module):  # float32 activations into a float64 layer (two parameter groups)
        def forward(self, x):
            return x.double()
    return Double()


@pytest.mark.mpi(min_size=1)
def test_torch_wrappers_under_continue_without_a_failure():
    """What on_failure="continue" covers (several groups, BatchNorm statistics, the outer methods,
    AllReduce SGD: the same gradients as the overlapped path) and what it refuses."""
    torch = pytest.importorskip("torch")
    import mpigossip.torch as mgt
    c = comm()
    two_groups = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2).double())
    sgp = _quiet(mgt.SGP, two_groups, comm=c, on_failure="continue")  # several groups recover together
    sgp.step()
    assert sgp.failures == [] and [g._together for g in sgp._tolerant_groups()] == [True, True]
    sgp.free()
    bn = _quiet(mgt.AllReduce, torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2)), comm=c,
                on_failure="continue")
    bn.step()  # the parameters' group and the BatchNorm statistics' group
    assert len(bn._tolerant_groups()) == 2 and all(g.on_failure == "continue" for g in bn._tolerant_groups())
    bn.free()
    with pytest.raises(ValueError, match="needs the flat D-PSGD, not hierarchical"):
        mgt.DPSGD(torch.nn.Linear(3, 2), comm=c, hierarchical=True, on_failure="continue")
    with pytest.raises(ValueError, match="needs the flat gossip, not hierarchical"):
        mgt.GossipPush(torch.nn.Linear(3, 2), comm=c, hierarchical=True, on_failure="continue")
    push = _quiet(mgt.GossipPush, torch.nn.Linear(3, 2), comm=c, tau=2, on_failure="continue")
    for _ in range(3):
        push.step()
    assert push.failures == [] and push.comms[0].exchanges == 1
    push.free()
    with pytest.raises(ValueError, match="slowmo: on_failure='continue': inner_mixing's exact mean"):
        _quiet(mgt.make, "slowmo", torch.nn.Linear(3, 2), comm=c, base="sgp", inner_mixing=True,
               on_failure="continue")
    local = _quiet(mgt.make, "localsgd", torch.nn.Linear(3, 2), comm=c, base="sgp", inner_steps=2,
                   on_failure="continue")
    for _ in range(4):  # two averages, each followed by an agreement that no rank failed
        local.step()
    assert local.failures == [] and local.base._agreeing and local.base.comms[0]._together
    assert local.base.comms[0].steps == 2
    local.free()
    grads = []  # AllReduce SGD: the same mean of the gradients as the overlapped default path
    for extra in ({}, {"on_failure": "continue"}):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(3, 4), _Double(), torch.nn.Linear(4, 2).double())
        ddp = _quiet(mgt.GradientAllReduce, net, comm=c, bucket_mb=1e-5, **extra)
        for _ in range(2):  # the second pass accumulates into the averaged buffer, as DDP's does
            x = torch.full((5, 3), float(c.rank + 1))
            net(x).double().sum().backward()
        grads.append([p.grad.clone() for p in net.parameters()])
        ddp.step()
        assert ddp.failures == []
        ddp.free()
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="allreduce: on_failure='continue' moves the buffer's own dtype, not wire"):
        mgt.GradientAllReduce(torch.nn.Linear(3, 2), comm=c, wire="bf16", on_failure="continue")
    osgp = _quiet(mgt.OSGP, torch.nn.Linear(3, 2), comm=c, on_failure="continue")   # one group, on its own
    for _ in range(3):
        osgp.step()
    assert osgp.failures == [] and not osgp.comms[0]._together
    osgp.free()
    with pytest.raises(ValueError, match="osgp: on_failure='continue' in overlap mode recovers one parameter group"):
        _quiet(mgt.OSGP, torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2).double()), comm=c,
               on_failure="continue")
    agp = _quiet(mgt.AGP, torch.nn.Linear(3, 2), comm=c, on_failure="continue")   # AGP alike
    for _ in range(3):
        agp.step()
    assert agp.failures == [] and agp.comms[0].on_failure == "continue"
    agp.free()
    algo = _quiet(mgt.AllReduce, torch.nn.Linear(3, 2), comm=c, on_failure="continue")
    algo.step()
    assert algo.failures == [] and len(algo.comms) == 1 and not algo.comms[0]._together
    algo.free()


@pytest.mark.mpi(min_size=2)
def test_a_cancelled_receive_is_pending_again_and_one_that_matched_is_not():
    """failures.Message.cancel: a receive nothing matched comes back cancelled (pending again:
    a cancelled request tests as complete, so it must be restarted or dropped, never taken for
    arrived); one whose message had come comes back complete, with the data. A restart
    receives the next message."""
    c = comm()
    if c.rank > 1:
        for _ in range(4):
            c.Barrier()
        return
    other = 1 - c.rank
    if c.rank == 0:
        data = np.zeros(3)
        message = failures.Message([c.Recv_init(data, source=other, tag=7)])
        message.start()
        assert message.cancel("test", comm=c, timeout=30) == [0]
        assert message.pending() == [0]
        c.Barrier()                       # (1) rank 1 sends now
        c.Barrier()                       # (2) it has left
        message.restart([0])
        while not message.test("test"):
            pass
        assert data.tolist() == [1.0, 2.0, 3.0]
        message.start()
        c.Barrier()                       # (3) the next one is on its way
        while not c.Iprobe(source=other, tag=8):   # sent after the tag-7 message: that one is here
            pass
        assert message.cancel("test", comm=c, timeout=30) == []
        assert message.pending() == [] and data.tolist() == [4.0, 5.0, 6.0]
        c.Recv(np.zeros(1), source=other, tag=8)
        message.requests[0].Free()
    else:
        c.Barrier()
        c.Send(np.array([1.0, 2.0, 3.0]), dest=other, tag=7)
        c.Barrier()
        c.Barrier()
        c.Send(np.array([4.0, 5.0, 6.0]), dest=other, tag=7)
        c.Send(np.zeros(1), dest=other, tag=8)
    c.Barrier()
