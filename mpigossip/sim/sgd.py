"""SGD with each averaging scheme on ``p`` virtual ranks: a convex problem (L2-regularised
softmax regression) or a non-convex one (an MLP; :mod:`.problems`), the package's
topologies and kernels, no MPI.

Every virtual rank draws its own minibatches from one shared training set (the papers'
i.i.d. setting; ``skew`` draws part of each rank's batch from one class of its own instead)
and takes plain SGD steps; the schemes differ only in how the ranks' parameters meet:

* ``allreduce``: the gradients are averaged exactly, every rank holds the same model;
* ``sgp``: PushSum (:class:`~mpigossip.sim.mixing.PushSumSim`), gradient at ``z = x / w``,
  a round every ``tau`` steps, its messages ``delay`` rounds in flight (OSGP);
* ``agp``: AGP's mixing (:class:`~mpigossip.sim.mixing.AsyncPushSumSim`), gradient at
  ``z = x / w`` applied to ``z`` (``x += w * Δ``, as :class:`mpigossip.torch.AGP` does), each share combined ``d`` steps after it left, ``d`` drawn from ``delays``
  (the time model's schedule of AGP's messages);
* ``gossip-push`` / ``gossip-pull``: Jin et al.'s gossip every ``tau`` steps (pull: each rank
  averages with one uniformly drawn rank, itself included, all from the old values);
* ``easgd``: a center; every ``tau`` steps all workers read the center, each moves by
  ``alpha = beta / p`` toward it and the center by the sum of their moves (a synchronous
  round of the elastic exchange of :class:`mpigossip.ElasticAveraging`).

The model that is evaluated is the consensus model: the mean of the ranks' (de-biased)
parameters, or the center for ``easgd``.
"""

import numpy as np

from .. import topology as topo_mod
from ..core.checks import check_integer
from .mixing import AsyncPushSumSim, GossipPushSim, PushSumSim, consensus_error

#: The ranks' own models evaluated for ``rank_accuracy`` (evenly spaced, the first and last
#: included): at p = 1024 every one would cost 1024 evaluations each time.
RANKS_EVALUATED = 32

#: The averaging schemes :func:`run_sgd` simulates.
SCHEMES = ("allreduce", "sgp", "agp", "gossip-push", "gossip-pull", "easgd")


def pull_round(x, topology, step):
    """Gossip pull on every row at once: ``x_i = (x_i + x_t) / 2`` with ``t`` the row's
    out-peer at ``step`` of a bound ``topology``, all from the old values."""
    targets = np.array([topology.out_peers(i, step)[0] for i in range(len(x))], dtype=np.intp)
    x[:] = 0.5 * x + 0.5 * x[targets]


def elastic_round(x, center, beta):
    """One synchronous EASGD round: every worker reads the same center, moves by
    ``u_i = alpha (x_i - center)`` toward it (``alpha = beta / p``), and the center moves by
    the sum of the ``u_i``: ``sum(x) + center`` is unchanged (up to rounding)."""
    u = (beta / len(x)) * (x - center)
    x -= u
    center += u.sum(axis=0)


def _check(scheme, p, steps, lr, batch, tau, beta, delay, skew, delays):
    if scheme not in SCHEMES:
        raise ValueError(f"run_sgd: scheme must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    for name, value in (("p", p), ("steps", steps), ("batch", batch), ("tau", tau)):
        check_integer(value, name, 1, owner="run_sgd")
    check_integer(delay, "delay", 0, owner="run_sgd")
    if delay and scheme != "sgp":
        raise ValueError(f"run_sgd: delay is PushSum's (scheme 'sgp'), not {scheme!r}'s")
    if (delays is None) != (scheme != "agp"):
        raise ValueError("run_sgd: delays (the schedule of AGP's messages) is given with scheme 'agp' and only then")
    if scheme == "agp" and tau != 1:
        raise ValueError("run_sgd: AGP mixes every step (its schedule is in delays): tau must be 1")
    if not 0 <= skew <= 1:
        raise ValueError(f"run_sgd: skew must be in [0, 1], got {skew!r}")
    if not lr > 0:
        raise ValueError(f"run_sgd: lr must be > 0, got {lr!r}")
    if not 0 < beta <= 1:
        raise ValueError(f"run_sgd: beta must be in (0, 1], got {beta!r}")


def _batches(rng, problem, p, batch, skew, own):
    """``(p, batch)`` sample indices: uniform over the training set, or with ``skew`` the first
    ``round(skew * batch)`` of rank i's drawn from its own class (``own``: the training indices
    sorted by class, each class's start and count, and rank i's class)."""
    out = rng.integers(0, len(problem.y), (p, batch))
    k = int(round(skew * batch))
    if k:
        order, start, count, mine = own
        pick = (rng.random((p, k)) * count[mine][:, None]).astype(np.int64)
        out[:, :k] = order[start[mine][:, None] + np.minimum(pick, count[mine][:, None] - 1)]
    return out


def run_sgd(problem, scheme, p, *, steps, lr, batch=16, tau=1, beta=0.9, seed=0, topology=None,
            eval_every=None, delay=0, skew=0.0, delays=None):
    """Simulate ``steps`` SGD steps of ``scheme`` on ``p`` virtual ranks, all starting from the
    problem's ``initial(seed)`` (zero for softmax regression).

    Args:
        problem: a :class:`~.problems.SoftmaxRegression` or :class:`~.problems.MLP` (anything
            with ``size``, ``gradients``, ``loss``, ``accuracy``, ``y`` and optionally ``initial``).
        tau: steps between mixing rounds (gossip, EASGD, and SGP).
        delay: SGP's messages are added to their receivers this many rounds after they are sent.
        delays: AGP's (scheme ``agp``): the delays, in steps, each share's is drawn from.
        skew: the fraction of each rank's minibatch drawn from its own class (rank ``i``'s is
            class ``i % classes``; 0: i.i.d.): data that differs between ranks, where how well
            a scheme mixes shows in its accuracy.
        topology: the SGP graph (default ``ExponentialGraph()``).
        eval_every: evaluate the consensus model every this many steps (default ``steps // 20``).

    Returns:
        dict with ``steps`` (the evaluated step counts, from 0), ``loss`` and ``accuracy`` of
        the consensus model, ``rank_accuracy`` (the mean accuracy of the ranks' own models, of
        :data:`RANKS_EVALUATED` of them at most: what a rank holds without a final average; for
        ``easgd`` the workers') and ``consensus`` (root-mean-square distance of the ranks'
        models from their mean) at those steps.
    """
    _check(scheme, p, steps, lr, batch, tau, beta, delay, skew, delays)
    eval_every = eval_every or max(1, steps // 20)
    rng = np.random.default_rng(seed)
    initial = problem.initial(seed) if hasattr(problem, "initial") else np.zeros(problem.size)
    x = np.tile(initial, (p, 1))
    center = initial.copy()
    own = None
    if skew:
        count = np.bincount(problem.y)
        if (count == 0).any():
            raise ValueError("run_sgd: skew needs every class among the training labels")
        start = np.concatenate([[0], np.cumsum(count)[:-1]])
        own = (np.argsort(problem.y, kind="stable"), start, count, np.arange(p) % len(count))
    pushsum = (PushSumSim(x, topology or topo_mod.ExponentialGraph(), delay=delay, exact=False)
               if scheme == "sgp" else None)
    if scheme == "agp":
        pushsum = AsyncPushSumSim(x, delays=delays, seed=seed)
    push = GossipPushSim(x, seed=seed) if scheme == "gossip-push" else None
    pull = topo_mod.RandomPeers(peers=1, seed=seed, allow_self=True).bind(p) if scheme == "gossip-pull" else None
    if pushsum is not None:
        x = pushsum.x          # the simulators own their rows; SGD updates them in place
    if push is not None:
        x = push.x
    out = {"scheme": scheme, "p": p, "lr": lr, "tau": tau, "delay": delay, "skew": skew,
           "delays": None if delays is None else [int(d) for d in delays], "steps": [], "loss": [],
           "accuracy": [], "rank_accuracy": [], "consensus": []}
    sampled = np.unique(np.linspace(0, p - 1, min(p, RANKS_EVALUATED)).round().astype(int))

    def record(k):
        z = pushsum.debiased() if pushsum is not None else x
        model = center if scheme == "easgd" else z.mean(axis=0)
        out["steps"].append(k)
        out["loss"].append(problem.loss(model))
        out["accuracy"].append(problem.accuracy(model))
        out["rank_accuracy"].append(float(np.mean([problem.accuracy(z[i]) for i in sampled])))
        out["consensus"].append(consensus_error(z))

    record(0)
    for k in range(steps):
        batches = _batches(rng, problem, p, batch, skew, own)
        if scheme == "allreduce":
            x -= lr * problem.gradients(x[:1], batches.reshape(1, -1))   # the mean of p equal-size batches
            x[1:] = x[0]
        elif scheme == "agp":   # the package's AGP updates the de-biased model: x += w * (z_new - z)
            x -= lr * pushsum.w[:, None] * problem.gradients(pushsum.debiased(), batches)
            pushsum.step()
        elif pushsum is not None:
            x -= lr * problem.gradients(pushsum.debiased(), batches)
            if (k + 1) % tau == 0:
                pushsum.step()
        else:
            x -= lr * problem.gradients(x, batches)
            if (k + 1) % tau == 0:
                if push is not None:
                    push.step()
                elif pull is not None:
                    pull_round(x, pull, (k + 1) // tau - 1)
                else:
                    elastic_round(x, center, beta)
        if (k + 1) % eval_every == 0 or k + 1 == steps:
            record(k + 1)
    return out
