"""The simulator's SGD: the elastic round conserves mass, gossip pull averages pairs, every
scheme minimises the convex problem, and AllReduce is plain SGD on the pooled batch."""

import numpy as np
import pytest

from mpigossip import sim
from mpigossip import topology as T
from mpigossip.sim import sgd as sgd_mod


def _problem(seed=0, n=600, d=5, classes=3):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, n)
    x = rng.standard_normal((classes, d))[y] * 2 + rng.standard_normal((n, d))
    return sim.SoftmaxRegression(x, y, classes)


def test_gradient_matches_finite_differences():
    prob = _problem()
    w = np.random.default_rng(1).standard_normal(prob.size) * 0.1
    batch = np.arange(len(prob.y))[None, :]
    g = prob.gradients(w[None, :], batch)[0]
    eps = 1e-6
    for j in (0, 3, prob.size - 1):
        e = np.zeros(prob.size)
        e[j] = eps
        assert g[j] == pytest.approx((prob.loss(w + e) - prob.loss(w - e)) / (2 * eps), rel=1e-5, abs=1e-8)


@pytest.mark.parametrize("p", [1, 4, 33])
def test_elastic_round_conserves_the_sum_and_moves_toward_the_center(p):
    rng = np.random.default_rng(p)
    x, center = rng.standard_normal((p, 7)), rng.standard_normal(7)
    before_x, before_c = x.copy(), center.copy()
    sim.elastic_round(x, center, 0.9)
    np.testing.assert_allclose(x.sum(axis=0) + center, before_x.sum(axis=0) + before_c, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(x, before_x - 0.9 / p * (before_x - before_c), rtol=1e-12)


def test_pull_round_averages_each_row_with_its_target_old_value():
    p = 9
    g = T.RandomPeers(peers=1, seed=3, allow_self=True).bind(p)
    x = np.random.default_rng(0).standard_normal((p, 4))
    old = x.copy()
    sim.pull_round(x, g, 5)
    for i in range(p):
        (t,) = g.out_peers(i, 5)
        np.testing.assert_array_equal(x[i], (old[i] + old[t]) / 2)


def test_allreduce_is_sgd_on_the_pooled_batch():
    prob, p, lr = _problem(), 4, 0.3
    r = sim.run_sgd(prob, "allreduce", p, steps=3, lr=lr, batch=8, seed=5, eval_every=3)
    rng, w = np.random.default_rng(5), np.zeros(prob.size)
    for _ in range(3):
        b = rng.integers(0, len(prob.y), (p, 8)).reshape(1, -1)
        w = w - lr * prob.gradients(w[None, :], b)[0]
    assert r["loss"][-1] == prob.loss(w) and r["consensus"][-1] == 0.0


#: AGP's schedule in the tests: most shares taken in a step after they left, some late
DELAYS = (1, 1, 1, 1, 1, 2, 2, 2, 3, 4)


def _with(scheme):
    """AGP with every share taken a step after it left (the time model's schedule on a fast link)."""
    return {"delays": (1,)} if scheme == "agp" else {}


@pytest.mark.parametrize("scheme", sim.SCHEMES)
def test_every_scheme_minimises_the_convex_problem(scheme):
    prob = _problem()
    r = sim.run_sgd(prob, scheme, 8, steps=150, lr=0.1, batch=8, seed=1, **_with(scheme))
    # AllReduce on the same batches; for AllReduce itself, on other batches (the same run would prove nothing)
    ref = sim.run_sgd(prob, "allreduce", 8, steps=150, lr=0.1, batch=8, seed=2 if scheme == "allreduce" else 1)
    assert r["loss"][-1] < 0.5 * r["loss"][0]
    # all near the same minimum at a small step (AGP slower: its update scales by the weight on the ranks, and
    # half of it is in flight)
    assert r["loss"][-1] == pytest.approx(ref["loss"][-1], rel=0.2 if scheme == "agp" else 0.1)
    assert r["steps"][0] == 0 and r["steps"][-1] == 150 and len(r["loss"]) == len(r["consensus"])
    if scheme != "allreduce":
        assert r["consensus"][-1] > 0  # independent batches: the ranks' models differ


def test_sgp_at_p8_stays_close_to_consensus_on_the_exponential_graph():
    prob = _problem()
    r = sim.run_sgd(prob, "sgp", 8, steps=100, lr=0.05, batch=8, seed=2)
    g = sim.run_sgd(prob, "gossip-push", 8, steps=100, lr=0.05, batch=8, seed=2)
    assert r["consensus"][-1] < g["consensus"][-1]  # exact averaging after 3 steps vs random pushes


@pytest.mark.parametrize("kwargs, message", [
    ({"scheme": "ring"}, "scheme"), ({"p": 0}, "p must"), ({"steps": 1.5}, "steps must"),
    ({"lr": 0.0}, "lr must"), ({"beta": 1.5}, "beta must"), ({"tau": True}, "tau must"),
    ({"scheme": "gossip-pull", "delay": 1}, "delay is PushSum's"), ({"scheme": "sgp", "delay": -1}, "delay must"),
    ({"skew": 1.5}, "skew must"), ({"scheme": "agp"}, "delays .* is given with scheme 'agp'"),
    ({"delays": (1,)}, "delays .* is given with scheme 'agp' and only then"),
    ({"scheme": "agp", "delays": (1,), "tau": 2}, "tau must be 1"),
    ({"scheme": "agp", "delays": (1, -1)}, "delays must be >= 0")])
def test_run_sgd_rejects_bad_arguments(kwargs, message):
    args = {"scheme": "sgp", "p": 4, "steps": 2, "lr": 0.1, **kwargs}
    with pytest.raises(ValueError, match=message):
        sim.run_sgd(_problem(), args.pop("scheme"), args.pop("p"), **args)


def test_problem_rejects_bad_labels():
    with pytest.raises(ValueError, match="labels"):
        sim.SoftmaxRegression(np.zeros((3, 2)), [0, 1, 5], 3)


def test_skewed_batches_draw_each_ranks_share_from_its_own_class():
    rng = np.random.default_rng(0)
    prob = _problem()
    count = np.bincount(prob.y)
    start = np.concatenate([[0], np.cumsum(count)[:-1]])
    own = (np.argsort(prob.y, kind="stable"), start, count, np.arange(6) % len(count))
    b = sgd_mod._batches(rng, prob, 6, 8, 0.5, own)
    assert b.shape == (6, 8)
    for i in range(6):
        assert (prob.y[b[i, :4]] == i % len(count)).all()      # the first half: rank i's class


def test_sgp_mixing_less_often_or_late_leaves_the_ranks_further_apart():
    """SGP with a round every 8 steps, or its messages 2 rounds late, ends with a larger consensus
    distance than every step; with skewed data the ranks' own models reach less accuracy."""
    prob = _problem()
    every = sim.run_sgd(prob, "sgp", 8, steps=80, lr=0.1, batch=8, seed=3, skew=0.75)
    rare = sim.run_sgd(prob, "sgp", 8, steps=80, lr=0.1, batch=8, seed=3, skew=0.75, tau=8)
    late = sim.run_sgd(prob, "sgp", 8, steps=80, lr=0.1, batch=8, seed=3, skew=0.75, delay=2)
    assert rare["consensus"][-1] > 2 * every["consensus"][-1] and late["consensus"][-1] > every["consensus"][-1]
    assert np.mean(rare["rank_accuracy"][-5:]) < np.mean(every["rank_accuracy"][-5:])
    assert every["tau"] == 1 and rare["tau"] == 8 and late["delay"] == 2 and every["skew"] == 0.75


def test_agps_mixing_keeps_every_share_and_late_shares_leave_the_ranks_apart():
    """AsyncPushSumSim: x and w with what accumulates and what is in flight sum to the start
    through 300 rounds (to rounding), a rank that gave too much keeps its shares (the floor),
    and with most shares late (the time model's schedule over a slow link) the ranks' models
    end further apart than with every share taken a step later, further still than PushSum
    every step; no share ever arriving leaves them as far apart as no mixing at all."""
    x = np.random.default_rng(0).standard_normal((16, 6))
    for delays in ((0,), DELAYS, (40, 45)):
        m = sim.AsyncPushSumSim(x, delays=delays, seed=1)
        for _ in range(300):
            m.step()
            assert m.w.min() >= m.min_weight / 2          # below the floor a rank gives nothing more
        tx, tw = m.totals()
        assert np.abs(tx - x.sum(axis=0)).max() < 1e-12 and tw == pytest.approx(16, abs=1e-12)
    prob = _problem()
    runs = {d: sim.run_sgd(prob, "agp", 8, steps=120, lr=0.1, batch=8, seed=3, skew=0.75, delays=d)
            for d in ((1,), DELAYS, (30, 40), ())}
    sgp = sim.run_sgd(prob, "sgp", 8, steps=120, lr=0.1, batch=8, seed=3, skew=0.75)
    alone = sim.run_sgd(prob, "sgp", 8, steps=120, lr=0.1, batch=8, seed=3, skew=0.75, tau=1000)
    c = {d: r["consensus"][-1] for d, r in runs.items()}
    assert sgp["consensus"][-1] < c[(1,)] < c[DELAYS] < c[(30, 40)]
    assert c[()] == pytest.approx(alone["consensus"][-1], rel=1e-6)    # nothing arrives: no mixing
    assert runs[DELAYS]["delays"] == list(DELAYS) and sgp["delays"] is None


def _mlp(seed=0, n=400, d=5, classes=3, hidden=8):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, n)
    x = rng.standard_normal((classes, d))[y] * 2 + rng.standard_normal((n, d))
    return sim.MLP(x, y, classes, hidden=hidden)


def test_mlp_gradient_matches_finite_differences_for_every_rank_at_once():
    """Both layers, the hidden layer's bias row, and two ranks' parameters in one call (the
    vectorised pass must not mix ranks)."""
    prob = _mlp()
    params = np.stack([prob.initial(1), prob.initial(2)])
    batch = np.stack([np.arange(len(prob.y))] * 2)
    g = prob.gradients(params, batch)
    eps = 1e-6
    first = prob._first[0] * prob._first[1]
    for r in (0, 1):
        for j in (0, first - 1, first, first + prob.hidden * prob.classes, prob.size - 1):
            e = np.zeros(prob.size)
            e[j] = eps
            numeric = (prob.loss(params[r] + e) - prob.loss(params[r] - e)) / (2 * eps)
            assert g[r, j] == pytest.approx(numeric, rel=1e-5, abs=1e-8), (r, j)


def test_mlp_starts_every_rank_from_one_random_point_and_learns():
    """Zero would keep the hidden units alike: the start is random, the same on every rank
    (the schemes then differ only in mixing); SGD takes the MLP well above chance."""
    prob = _mlp()
    a, b = prob.initial(0), prob.initial(0)
    np.testing.assert_array_equal(a, b)
    assert np.std(a) > 0 and not np.array_equal(a, prob.initial(1))
    r = sim.run_sgd(prob, "allreduce", 4, steps=300, lr=0.2, batch=16, seed=0, eval_every=300)
    assert r["consensus"][0] == 0.0
    assert r["accuracy"][-1] > 0.8 and r["accuracy"][-1] > r["accuracy"][0] + 0.2, r["accuracy"]
    with pytest.raises(ValueError, match="hidden"):
        sim.MLP(np.zeros((3, 2)), [0, 1, 2], 3, hidden=0)
    with pytest.raises(ValueError, match="labels"):
        sim.MLP(np.zeros((3, 2)), [0, 1, 5], 3)


@pytest.mark.parametrize("scheme", sim.SCHEMES)
def test_every_scheme_trains_the_mlp(scheme):
    prob = _mlp(seed=3)
    r = sim.run_sgd(prob, scheme, 8, steps=300, lr=0.2, batch=16, seed=1, eval_every=300, **_with(scheme))
    assert r["loss"][-1] < 0.6 * r["loss"][0], r["loss"]
