"""torch wrappers on real ranks (this file imports torch: it tests the torch adapter)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import mpigossip as mg  # noqa: E402
import mpigossip.torch as mgt  # noqa: E402
from mpigossip.core.registry import WIRE  # noqa: E402

from .helpers import comm, global_sum, same_on_all_ranks  # noqa: E402


def data(rank, n=64, d=5):
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    y = x @ torch.arange(1.0, d + 1, dtype=torch.float64) + 0.5
    return x, y


def grad_at(z, x, y):
    """Gradient of 0.5 * mean((x w + b - y)^2) at z = [w, b]."""
    x, y = x.numpy(), y.numpy()
    w, b = z[:-1], z[-1]
    r = x @ w + b - y
    return np.concatenate([x.T @ r / len(y), [r.mean()]])


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("topology", ["exponential", "random"])
def test_sgp_wrapper_follows_pushsum_driven_by_hand(topology):
    """Algorithm 1: gradient at z = x / w, applied to x, then PushSum. Same seed, same path."""
    c = comm()
    x, y = data(c.rank)
    lr, steps = 0.05, 25
    topo = lambda: mg.topology.make(topology, seed=3)  # noqa: E731
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 1).double()
    sgp = mgt.SGP(model, comm=c, topology=topo())
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    # By hand: numerator and PushSum on a flat numpy buffer, same initial parameters.
    num = np.concatenate([p.detach().numpy().ravel() for p in (model.weight, model.bias)]).astype(np.float64)
    ps = mg.PushSum(num, comm=c, topology=topo())
    for _ in range(steps):
        loss = 0.5 * ((model(x).squeeze(1) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sgp.step()
        z = ps.debiased()
        num -= lr * grad_at(z, x, y)
        ps.step()
    z = ps.debiased()
    ours = np.concatenate([model.weight.detach().numpy().ravel(), model.bias.detach().numpy()])
    np.testing.assert_allclose(ours, z, rtol=1e-10, atol=1e-12)
    assert sgp.weights[0] == pytest.approx(ps.weight, rel=1e-12)
    sgp.free()
    ps.free()


UNSYNCHRONISED = ("easgd", "asgd", "adpsgd", "gossip-pull", "agp")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("wire", [None, "bf16", "int8"])
def test_allreduce_averages_the_gradients_of_a_backward_pass_in_a_wire_format(wire):
    """The gradient buckets' averaging runs in the backward pass: each rank's loss on its own
    batch, backward(), and every .grad is the mean of the ranks' own gradients (computed here
    by plain MPI on a copy of the model), within the format's rounding, the same bytes on every
    rank. Small buckets: several of them, the last ones started while backward goes on."""
    c = comm()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Tanh(), torch.nn.Linear(48, 8))
    twin = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Tanh(), torch.nn.Linear(48, 8))
    twin.load_state_dict(model.state_dict())
    algo = mgt.make("allreduce", model, comm=c, bucket_mb=4096 * 4 / 2 ** 20, wire=wire)
    g = torch.Generator().manual_seed(100 + c.rank)
    data, target = torch.randn(16, 64, generator=g), torch.randn(16, 8, generator=g)
    for net in (model, twin):
        torch.nn.functional.mse_loss(net(data), target).backward()
    ours = torch.cat([p.grad.ravel() for p in model.parameters()]).double().numpy()
    mean = global_sum(c, torch.cat([p.grad.ravel() for p in twin.parameters()]).double().numpy()) / c.size
    assert np.abs(mean).max() > 0
    tol = {None: 1e-6, "bf16": 2.0 ** -7, "int8": 2.0 ** -6}[wire] * np.abs(mean).max()
    np.testing.assert_allclose(ours, mean, rtol=0, atol=tol)
    assert same_on_all_ranks(c, ours.tobytes())
    if wire is not None:  # float32's own rounding is ~1e-7 of that: the format was used
        assert np.abs(ours - mean).max() > 1e-4 * np.abs(mean).max(), "the gradients did not travel in the format"
    algo.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", list(mgt.ALGORITHMS) + [f"{a} hierarchical" for a in mgt.HIERARCHICAL]
                         + [f"{a} wire" for a in WIRE])
def test_every_wrapper_keeps_views_and_drives_consensus(name):
    c = comm()
    name, _, variant = name.partition(" ")
    hierarchical = variant == "hierarchical"
    torch.manual_seed(c.rank)  # different initial models: the wrapper broadcasts rank 0's
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    options = {"tau": 1, "beta": 0.5, "max_delay": 1, "inner_steps": 3}  # outer optimizers: 10 outer steps
    if variant == "wire":
        options["wire"] = "int8"  # the coarsest format: every rank still ends AllReduce with the same bytes
    if hierarchical:
        from .test_hierarchical import shared_size
        options.update(hierarchical=True, node_size=2 if shared_size(c) % 2 == 0 else 1)
    algo = mgt.make(name, model, comm=c, **{k: v for k, v in options.items() if k in mgt.OPTIONS[name]})
    if variant == "wire":  # every communicator that sends the model got the format
        comms = [b.averager for b in algo.buckets] if name == "allreduce" else algo.comms
        assert comms and all("wire=int8" in repr(x) for x in comms), comms
    first = [p.detach().clone() for p in model.parameters()]
    same = c.allgather(torch.cat([f.ravel() for f in first]).numpy())
    assert all(np.array_equal(same[0], s) for s in same)
    for step in range(30):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * (c.rank + 1))  # a different "update" per rank
        algo.step()
        if name in UNSYNCHRONISED:  # in lockstep: how far apart they end must not depend on who ran ahead
            c.Barrier()
    algo.drain()
    algo.flat.check_views()
    state = algo.state_dict()
    assert state["algorithm"] == name and state["steps"] == 30
    # Consensus: the ranks drifted apart by 0.01 * (rank + 1) a step; without communication the
    # largest distance from the mean would be 0.3 * (P - 1) / 2 after 30 steps (a wrapper that
    # communicated nothing would leave exactly that).
    def spread():
        flat = torch.cat([p.detach().ravel() for p in model.parameters()]).double().numpy()
        mean = global_sum(c, flat) / c.size
        return max(c.allgather(float(np.abs(flat - mean).max())))

    alone = 0.3 * (c.size - 1) / 2
    if name == "allreduce":  # averages gradients, not these updates: only the initial broadcast counts
        assert spread() == pytest.approx(alone, rel=1e-3)
    elif name == "allreduce-params":
        assert spread() < 1e-6
    elif name == "asgd":  # every worker pulled the center after its push: they differ by one step's drift
        assert spread() <= 0.01 * c.size, (spread(), alone)
        c.Barrier()  # once every push has landed, a step without an update pulls the same center
        algo.step()
        assert spread() < 1e-6
    else:  # EASGD's workers move by beta / P towards the center: the slowest to agree
        assert spread() < (0.75 if name == "easgd" else 0.5) * alone, (name, spread(), alone)
    algo.free()
    algo.free()  # a second free() does nothing
    for use in (algo.step, algo.consensus_parameters, algo.state_dict):
        with pytest.raises(RuntimeError, match="has been freed"):
            use()  # the ranks would drift apart silently otherwise


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", ["allreduce", "sgp", "easgd"])
def test_batchnorm_statistics_broadcast_averaged_and_in_the_consensus(name):
    """Buffers start as rank 0's; AllReduce keeps them equal on every rank; every algorithm's
    consensus_buffers() is their exact mean (what the consensus model evaluates with)."""
    c = comm()
    torch.manual_seed(c.rank)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    bn = model[1]
    with torch.no_grad():
        bn.running_mean.fill_(float(c.rank))
        bn.num_batches_tracked.fill_(c.rank)
    algo = mgt.make(name, model, comm=c)
    for tensor in (bn.running_mean, bn.running_var, bn.num_batches_tracked):
        values = c.allgather(tensor.detach().numpy().copy())
        assert all(np.array_equal(values[0], v) for v in values), "buffers not broadcast at construction"
    assert float(bn.running_mean[0]) == 0.0
    for _ in range(4):
        model(torch.randn(16, 4) + 3.0 * c.rank)  # training mode: statistics of this rank's data
        algo.step()
    mean = global_sum(c, bn.running_mean.detach().numpy()) / c.size
    np.testing.assert_allclose(algo.consensus_buffers()[0][:8], mean, rtol=1e-6)
    spread = max(c.allgather(float(np.abs(bn.running_mean.detach().numpy() - mean).max())))
    if name == "allreduce":
        assert spread < 1e-5, "AllReduce left the ranks with different BatchNorm statistics"
    else:
        assert spread > 0.1, "the statistics were expected to stay each rank's own"
    # The consensus model: exact means of parameters and statistics, in a copy or in a given model.
    own = {k: v.detach().clone() for k, v in model.state_dict().items()}
    copy = algo.consensus_model()
    into = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    assert algo.consensus_model(into=into) is into
    for m in (copy, into):
        assert m is not model
        for key, value in m.state_dict().items():
            expected = own[key] if key.endswith("num_batches_tracked") else \
                torch.from_numpy(global_sum(c, own[key].double().numpy()) / c.size).to(value.dtype)
            torch.testing.assert_close(value, expected, rtol=1e-6, atol=1e-7, msg=key)
    for key, value in model.state_dict().items():
        assert torch.equal(value, own[key]), "consensus_model() changed the rank's own model"
    algo.free()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("set_to_none, passes", [(True, 1), (False, 1), (True, 2)])
def test_gradient_allreduce_gives_every_rank_adam_on_the_clipped_mean_gradient(set_to_none, passes):
    """Against a hand-made reference on every rank, as DDP defines it: local gradients, their
    exact mean by a blocking Allreduce, clipped to a norm, Adam. When backward() returns the
    gradients are averaged (clip_grad_norm_ between backward and optimizer.step() sees the mean,
    without a call to synchronize()). Many small buckets (two per layer), a layer unused on odd
    steps (its gradient is then zero or absent), both ways of zeroing gradients, and gradient
    accumulation over two backward passes."""
    c = comm()
    torch.manual_seed(0)

    def build():
        return torch.nn.ModuleDict({"a": torch.nn.Linear(6, 16), "b": torch.nn.Linear(16, 3),
                                    "skip": torch.nn.Linear(6, 3)})

    ours, ref = build(), build()
    ref.load_state_dict(ours.state_dict())
    algo = mgt.make("allreduce", ours, comm=c, bucket_mb=64 / 2 ** 20)  # 64-byte buckets
    assert len(algo.buckets) >= 4
    shared = algo.buckets[0].averager.comm
    assert all(b.averager.comm == shared for b in algo.buckets), "one communicator per bucket"
    opt, ref_opt = torch.optim.Adam(ours.parameters(), lr=0.01), torch.optim.Adam(ref.parameters(), lr=0.01)
    rng = torch.Generator().manual_seed(1 + c.rank)
    max_norm, clipped = 0.05, 0

    def loss(model, x, step):
        out = model["b"](torch.relu(model["a"](x)))
        return (out ** 2).mean() + (model["skip"](x).mean() if step % 2 == 0 else 0.0)

    for step in range(6):
        xs = [torch.randn(8, 6, generator=rng) for _ in range(passes)]
        opt.zero_grad(set_to_none=set_to_none)
        for x in xs:
            loss(ours, x, step).backward()
        norm = torch.nn.utils.clip_grad_norm_(ours.parameters(), max_norm)
        opt.step()
        algo.step()
        ref_opt.zero_grad(set_to_none=True)
        for x in xs:
            loss(ref, x, step).backward()
        for p in ref.parameters():
            g = np.zeros(p.shape, np.float32) if p.grad is None else p.grad.numpy().copy()
            c.Allreduce(mg_mpi().IN_PLACE, g)
            p.grad = torch.from_numpy(g / c.size)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        clipped += bool(ref_norm > max_norm)
        assert float(norm) == pytest.approx(float(ref_norm), rel=1e-5), "clipping saw unaveraged gradients"
        ref_opt.step()
        for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
            np.testing.assert_allclose(p.detach().numpy(), q.detach().numpy(), rtol=1e-5, atol=1e-6,
                                       err_msg=f"{name} at step {step}")
    assert clipped >= 3, "the clipping norm never bit: the test would not see unaveraged gradients"
    same = c.allgather(torch.cat([p.detach().ravel() for p in ours.parameters()]).numpy())
    assert all(np.array_equal(same[0], s) for s in same), "ranks hold different models"
    algo.free()
    opt.zero_grad()
    loss(ours, x, 0).backward()
    opt.step()  # after free(): a plain optimizer again, no hook left behind


def mg_mpi():
    from mpi4py import MPI
    return MPI


@pytest.mark.mpi(min_size=1)
def test_make_refuses_options_the_algorithm_does_not_take():
    c = comm()
    model = torch.nn.Linear(3, 2)
    with pytest.raises(TypeError) as err:
        mgt.make("sgp", model, comm=c, peer=2, max_delay=3, tau=9)
    text = str(err.value)
    assert "unexpected options max_delay, peer, tau" in text and "sgp takes topology, peers, wire, on_failure, hierarchical, node_size, timeout" in text
    with pytest.raises(TypeError, match="unexpected option beta; allreduce takes bucket_mb, wire, on_failure, timeout"):
        mgt.make("allreduce", model, comm=c, beta=0.5)
    with pytest.raises(ValueError, match="unknown algorithm"):
        mgt.make("sgd", model, comm=c)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", ["sgp", "allreduce", "diloco"])
def test_make_without_broadcast_keeps_each_ranks_model_and_refuses_a_split_choice(name):
    """``make(..., broadcast=False)`` (a heal, a resume: every rank loads its state next) leaves
    each rank's parameters and buffers its own, an outer method's base too; the default starts
    every rank from rank 0's. A choice not the same on every rank raises on every rank (a broadcast
    entered by some ranks only would hang)."""
    c = comm()

    def model_of(rank):
        torch.manual_seed(rank)
        return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))

    own = model_of(c.rank)
    before = [t.detach().clone() for t in own.state_dict().values()]
    algo = mgt.make(name, own, comm=c, broadcast=False)
    assert all(torch.equal(a, b) for a, b in zip(before, own.state_dict().values()))
    algo.free()
    first = model_of(c.rank)
    algo = mgt.make(name, first, comm=c)
    assert same_on_all_ranks(c, np.concatenate([t.detach().numpy().ravel() for t in first.state_dict().values()
                                                if t.dtype.is_floating_point]).tobytes())
    algo.free()
    with pytest.raises(ValueError, match="broadcast must be the same on every rank"):
        mgt.make(name, model_of(c.rank), comm=c, broadcast=c.rank == 0)
    with pytest.raises(TypeError, match="broadcast must be True or False"):
        mgt.make(name, model_of(c.rank), comm=c, broadcast=1)


def test_flat_parameters_group_by_dtype_and_are_views():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2).double(), torch.nn.Linear(2, 2))
    flat = mgt.FlatParameters(model)
    assert [g.dtype for g in flat.groups] == [torch.float32, torch.float64]
    assert flat.numel == sum(p.numel() for p in model.parameters())
    flat.groups[0].fill_(2.0)
    assert float(model[0].weight.detach()[0, 0]) == 2.0 and float(model[2].bias.detach()[1]) == 2.0
    flat.check_views()
    model[0].weight.data = torch.zeros(3, 3)
    with pytest.raises(RuntimeError, match="no longer views"):
        flat.check_views()
