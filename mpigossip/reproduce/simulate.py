"""The simulator's part of ``reproduce`` (no MPI): consensus error per graph at p = 1024,
SGD with each averaging scheme on a convex problem as p grows (finding (d) beyond 16), and
the time model's steps per second of those schemes at those p (their time to the target)."""

import numpy as np

from .. import sim
from .. import topology as topo_mod
from ..train import data as data_mod

#: Graphs whose consensus curves are drawn ("complete" is exact in one step and costs p^2).
GRAPHS = ("exponential", "alternating", "npeer", "bipartite", "ring", "random", "undirected-ring",
          "undirected-exponential", "torus", "paired")
#: Step sizes of the simulated SGD (plain SGD on softmax regression): small and large.
SIM_LRS = (0.05, 1.0)


def consensus_curves(p, steps):
    """{graph: relative consensus error after each step} for PushSum's de-biased models."""
    out = {}
    for name in GRAPHS:
        try:
            graph = topo_mod.make(name, peers=2 if name == "npeer" else 1, seed=0)
            graph.bind(p)
        except ValueError:
            continue  # a graph that does not exist at this p (e.g. a torus needs a factorisation)
        out[name] = sim.consensus_curve(graph, p, steps)
    return out


def problem(seed):
    """The synthetic accuracy runs' data (:data:`.experiments.PROBLEM`) as a convex softmax regression."""
    d = data_mod.synthetic(10000, 12, 10, seed, clusters=8, label_noise=0.2)
    return sim.SoftmaxRegression(d.x_train, d.y_train, d.classes, x_test=d.x_test, y_test=d.y_test)


def digits_problem(seed):
    """scikit-learn's digits as a convex softmax regression, split in halves by ``seed`` (899
    test images: an accuracy step of 0.1%): its accuracy rises for hundreds of steps at lr
    0.05, where the synthetic data's plateaus within a few dozen."""
    d = data_mod.digits(seed)
    x, y = np.concatenate([d.x_train, d.x_test]), np.concatenate([d.y_train, d.y_test])
    order = np.random.default_rng(seed).permutation(len(y))
    train, test = order[:len(y) // 2], order[len(y) // 2:]
    return sim.SoftmaxRegression(x[train], y[train], d.classes, x_test=x[test], y_test=y[test])


def digits_mlp_problem(seed):
    """The same halves of the digits (:func:`digits_problem`) for a non-convex model: an MLP
    with 32 tanh units (:class:`mpigossip.sim.MLP`), every rank starting from the same random
    parameters."""
    d = data_mod.digits(seed)
    x, y = np.concatenate([d.x_train, d.x_test]), np.concatenate([d.y_train, d.y_test])
    order = np.random.default_rng(seed).permutation(len(y))
    train, test = order[:len(y) // 2], order[len(y) // 2:]
    return sim.MLP(x[train], y[train], d.classes, hidden=32, x_test=x[test], y_test=y[test])


def sgd_scaling(sizes, steps, seeds, progress):
    """Every scheme x p x step size x seed; returns the runs' records (lists, JSON-ready)."""
    records = []
    for seed in seeds:
        prob = problem(seed)
        for p in sizes:
            progress(f"simulator: SGD at p = {p}, seed {seed}")
            for lr in SIM_LRS:
                for scheme in (s for s in sim.SCHEMES if s != "agp"):   # AGP mixes by a time model's schedule
                    r = sim.run_sgd(prob, scheme, p, steps=steps, lr=lr, batch=16, seed=seed)
                    records.append({**r, "seed": seed})
    return records


#: The timed runs' model in MB (the Fashion-MNIST MLP, width 256), as the time model's
#: validation takes it (``timemodel validate --reproduction-mb``).
TIMED_MB = 1.03

#: The time model's method for each simulated scheme (gossip push is not in the time model).
TIMED_SCHEMES = {"allreduce": "allreduce", "sgp": "sgp", "gossip-pull": "gossip-pull", "easgd": "easgd"}


def predicted_speeds(calibration, sizes, *, mb, compute, per_node=2, rate_gbit=1.0, steps=3, progress=None):
    """The time model's rows (:func:`mpigossip.sim.scaling.predict`: steps per second per rank)
    of :data:`TIMED_SCHEMES` at each of ``sizes`` on a cluster of ``per_node`` ranks per node
    linked at ``rate_gbit``, from the calibration file ``calibration``."""
    from ..sim import scaling
    from ..sim.timing import Costs
    costs = Costs.load(calibration)
    sizes = [p for p in sizes if p % per_node == 0]
    return scaling.predict(costs, ranks=sizes, rates_gbit=[rate_gbit], per_node=per_node, mb=mb, compute=compute,
                           methods=tuple(TIMED_SCHEMES.values()), steps=steps, stragglers=(1.0,),
                           progress=progress)
