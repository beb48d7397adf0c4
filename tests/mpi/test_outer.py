"""Outer optimizers (local SGD, SlowMo, DiLoCo) over averaging communicators, against a
replay in numpy of the same local updates and outer rule."""

import numpy as np
import pytest

import mpigossip as mg
from mpigossip.exact import outer as outer_mod

from .helpers import comm, global_sum, same_on_all_ranks

N = 5003


def local_update(rank, step):
    """A deterministic 'gradient step' that differs per rank and step."""
    return np.random.default_rng(1000 * step + rank).standard_normal(N) * 0.1


def replay(c, steps, H, lr, mu, nesterov, warmup=0):
    """Every rank's model after ``steps`` steps, computed with numpy only: the mean over
    ranks stands in for the AllReduce."""
    start = np.linspace(-1, 1, N)
    xs = [start.copy() for _ in range(c.size)]
    anchor, m = start.copy(), np.zeros(N)
    for k in range(1, steps + 1):
        for r in range(c.size):
            xs[r] += local_update(r, k)
        if k <= warmup or (k - warmup) % H == 0:
            avg = sum(xs) / c.size
            if k <= warmup or (lr == 1.0 and mu == 0.0):
                anchor = avg.copy()
            else:
                g = anchor - avg
                m = mu * m + g
                anchor = anchor - lr * (g + mu * m if nesterov else m)
            xs = [anchor.copy() for _ in range(c.size)]
    return xs[c.rank]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("method, H, warmup", [("localsgd", 4, 0), ("localsgd", 3, 5), ("slowmo", 4, 0),
                                               ("diloco", 5, 2)])
def test_outer_over_allreduce_matches_the_replay(method, H, warmup):
    c = comm()
    x = np.linspace(-1, 1, N)
    outer = mg.Outer(x, mg.AllreduceAverager(x, comm=c), inner_steps=H, method=method, warmup=warmup)
    steps = 17
    for k in range(1, steps + 1):
        x += local_update(c.rank, k)
        assert outer.step() is None
        assert outer.exchanged == (k <= warmup or (k - warmup) % H == 0)
    lr, mu, nesterov = outer_mod.METHODS[method]
    np.testing.assert_allclose(x, replay(c, steps, H, lr, mu, nesterov, warmup), rtol=1e-12, atol=1e-12)
    assert outer.exchanges == warmup + (steps - warmup) // H
    outer.free()


@pytest.mark.mpi(min_size=2)
def test_local_sgd_anchor_is_the_exact_mean():
    """lr = 1, no momentum: after an outer step every rank holds the AllReduce mean, bit for bit."""
    c = comm()
    x = np.random.default_rng(c.rank).standard_normal(N)
    outer = mg.Outer(x, mg.AllreduceAverager(x, comm=c), inner_steps=1)
    outer.step()
    assert same_on_all_ranks(c, x.tobytes())
    np.testing.assert_allclose(x, global_sum(c, x) / c.size, rtol=1e-15)
    outer.free()


def skewed(n):
    """Rank 0 keeps 3/4 and sends 1/4 to rank 1; every other rank keeps 1/2 and sends 1/2 to
    the next: column-stochastic, not doubly stochastic, so PushSum's weights leave 1."""
    def fn(rank, step):
        return [(rank, 0.75), (1, 0.25)] if rank == 0 else [(rank, 0.5), ((rank + 1) % n, 0.5)]
    return fn


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("method", ["localsgd", "slowmo", "diloco"])
def test_outer_over_pushsum_keeps_the_weight_and_the_mass(method):
    """Over SGP on a graph whose weights leave 1 the anchors differ per rank; the outer step
    writes x = w * anchor (the model is x / w) and leaves PushSum's weights alone (their sum
    stays the number of ranks). With plain averaging (local SGD) it moves no mass: Σx is the
    start plus every local update."""
    c = comm()
    x = np.random.default_rng(c.rank).standard_normal(N)
    total = global_sum(c, x)
    ps = mg.PushSum(x, comm=c, topology=mg.topology.CallableGraph(skewed(c.size)))
    outer = mg.Outer(x, ps, inner_steps=2, method=method)
    weights = []
    for k in range(1, 9):
        update = local_update(c.rank, k)
        x += update
        total += global_sum(c, update)
        outer.step()
        if outer.exchanged:
            weights.append(ps.weight)
            np.testing.assert_allclose(x / ps.weight, outer._anchor, rtol=1e-12, atol=1e-12,
                                       err_msg="the outer step did not write x = w * anchor")
    assert max(c.allgather(max(abs(w - 1) for w in weights))) > 0.1, "the weights stayed 1: nothing tested"
    assert abs(c.allreduce(ps.weight) - c.size) < 1e-12
    if method == "localsgd":
        np.testing.assert_allclose(global_sum(c, x), total, rtol=0, atol=1e-9 * np.abs(total).max(),
                                   err_msg="plain averaging moved mass")
    assert np.all(np.isfinite(x))
    assert outer.exchanges == 4 and ps.steps == 4
    outer.free()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("method", ["slowmo", "diloco"])
def test_the_first_anchor_is_the_model_x_over_w(method):
    """Built over a PushSum whose weight is not 1 (x = w z), the first anchor is the model z,
    not x: on a graph where every rank keeps its whole share and with no local update the
    pseudo-gradient is 0, so outer steps move nothing. (The anchor was x: the first outer step
    then pulled z towards w z.)"""
    c = comm()
    z = np.linspace(-1, 1, N) + c.rank
    w = 1.0 + c.rank
    x = w * z
    ps = mg.PushSum(x, comm=c, weight=w, topology=mg.topology.CallableGraph(lambda rank, step: [(rank, 1.0)]))
    outer = mg.Outer(x, ps, inner_steps=1, method=method)
    np.testing.assert_allclose(outer._anchor, z, rtol=1e-15, atol=0)
    for _ in range(3):
        outer.step()
    np.testing.assert_allclose(x / ps.weight, z, rtol=1e-14, atol=1e-14)
    outer.free()


@pytest.mark.mpi(min_size=2)
def test_resume_continues_exactly():
    """state_dict after 6 steps, a fresh object loads it, 6 more steps: the same model as 12
    steps without a break (anchor and momentum restored)."""
    c = comm()

    def run(steps, x, outer):
        for k in range(outer.steps + 1, outer.steps + steps + 1):
            x += local_update(c.rank, k)
            outer.step()

    x = np.linspace(-1, 1, N)
    whole = mg.Outer(x, mg.AllreduceAverager(x, comm=c), inner_steps=4, method="diloco")
    run(12, x, whole)
    whole.free()

    y = np.linspace(-1, 1, N)
    first = mg.Outer(y, mg.AllreduceAverager(y, comm=c), inner_steps=4, method="diloco")
    run(6, y, first)
    state, saved = first.state_dict(), y.copy()
    first.free()
    z = saved.copy()
    second = mg.Outer(z, mg.AllreduceAverager(z, comm=c), inner_steps=4, method="diloco")
    second.load_state_dict(state)
    assert second.steps == 6 and second.exchanges == 1
    run(6, z, second)
    assert np.array_equal(z, x)
    second.free()


@pytest.mark.mpi(min_size=2)
def test_a_skipped_update_does_not_desynchronise_the_ranks():
    """A mixed-precision scaler skips some ranks' optimizer steps (inf gradients): they still
    call step(), so every rank averages at the same steps (a collective averager would
    otherwise hang) and ends with the same model."""
    c = comm()
    x = np.zeros(N)
    outer = mg.Outer(x, mg.AllreduceAverager(x, comm=c), inner_steps=3, method="slowmo")
    rng = np.random.default_rng(c.rank)
    for k in range(1, 13):
        if rng.random() < 0.4:  # this rank's update was skipped
            pass
        else:
            x += local_update(c.rank, k)
        outer.step()
    assert same_on_all_ranks(c, outer.exchanges)
    assert same_on_all_ranks(c, x.tobytes())
    outer.free()


@pytest.mark.mpi(min_size=1)
def test_bad_arguments_raise_the_same_error_everywhere():
    c = comm()
    x = np.zeros(10)
    avg = mg.AllreduceAverager(x, comm=c)
    for kwargs, match in (({"inner_steps": 0}, "inner_steps"), ({"inner_steps": 2, "method": "adam"}, "method"),
                          ({"inner_steps": 2, "lr": 0.0}, "lr"), ({"inner_steps": 2, "momentum": 1.0}, "momentum"),
                          ({"inner_steps": 2, "warmup": -1}, "warmup")):
        with pytest.raises(ValueError, match=match):
            mg.Outer(x, avg, **kwargs)
    if c.size > 1:  # one rank's wrong value: every rank raises
        with pytest.raises(ValueError, match="inner_steps"):
            mg.Outer(x, avg, inner_steps=0 if c.rank == 1 else 2)
        with pytest.raises(ValueError, match="differ across ranks"):
            mg.Outer(x, avg, inner_steps=2 + (c.rank == 1))
    with pytest.raises(TypeError, match="averager"):
        mg.Outer(x, object(), inner_steps=2)
    avg.free()


@pytest.mark.mpi(min_size=3)
@pytest.mark.parametrize("wire", [None, "bf16"])
def test_slowmo_over_sgp_with_inner_mixing(wire):
    """SlowMo as Wang et al. run it over SGP: the base gossips at every step, an outer step
    takes the exact mean first, so every rank leaves it with the same model (a regular graph
    keeps w = 1); in between the models differ. Without inner mixing the base gossips only at
    the outer step."""
    torch = pytest.importorskip("torch")
    import mpigossip.torch as mgt
    c = comm()
    for mixing in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Linear(5, 3)
        algo = mgt.make("slowmo", model, comm=c, base="sgp", inner_steps=3, inner_mixing=mixing, wire=wire)
        for step in range(1, 8):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01 * (c.rank + 1) * step)
            algo.step()
            assert algo.base.steps == (step if mixing else step // 3)
            flat = torch.cat([p.detach().ravel() for p in model.parameters()]).numpy().copy()
            # (without inner mixing the outer step follows one gossip step: each rank its own anchor)
            assert same_on_all_ranks(c, flat.tobytes()) == (mixing and step % 3 == 0), (mixing, step)
        algo.free()
    with pytest.raises(ValueError, match="inner_mixing"):
        mgt.make("slowmo", model, comm=c, base="sgp", inner_mixing="yes")
