"""SGD with each averaging scheme on ``p`` virtual ranks: a convex problem (L2-regularised
softmax regression), the package's topologies and kernels, no MPI.

Every virtual rank draws its own minibatches from one shared training set (the papers'
i.i.d. setting; ``skew`` draws part of each rank's batch from one class of its own instead)
and takes plain SGD steps; the schemes differ only in how the ranks' parameters meet:

* ``allreduce``: the gradients are averaged exactly, every rank holds the same model;
* ``sgp``: PushSum (:class:`~mpigossip.sim.mixing.PushSumSim`), gradient at ``z = x / w``,
  a round every ``tau`` steps (a method that cannot keep up with its link mixes less often:
  the time model's models moved per step), its messages ``delay`` rounds in flight (OSGP);
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
from .._checks import check_integer
from .mixing import GossipPushSim, PushSumSim, consensus_error

#: The ranks' own models evaluated for ``rank_accuracy`` (evenly spaced, the first and last
#: included): at p = 1024 every one would cost 1024 evaluations each time.
RANKS_EVALUATED = 32

#: The averaging schemes :func:`run_sgd` simulates.
SCHEMES = ("allreduce", "sgp", "gossip-push", "gossip-pull", "easgd")


class SoftmaxRegression:
    """Multinomial logistic regression with an L2 penalty: a convex objective.

    Args:
        x: ``(N, d)`` training inputs; y: ``(N,)`` integer labels in ``[0, classes)``.
        x_test, y_test: held-out data for the accuracy (default: the training data).
        l2: weight of ``l2 / 2 * ||W||^2``.
    """

    def __init__(self, x, y, classes, *, x_test=None, y_test=None, l2=1e-4):
        self.x = self._augment(x)
        self.y = np.asarray(y, dtype=np.int64)
        if len(self.x) != len(self.y) or len(self.y) == 0:
            raise ValueError("SoftmaxRegression: x and y must be non-empty and of the same length")
        if classes < 2 or self.y.min() < 0 or self.y.max() >= classes:
            raise ValueError(f"SoftmaxRegression: labels must lie in [0, {classes})")
        self.x_test = self.x if x_test is None else self._augment(x_test)
        self.y_test = self.y if y_test is None else np.asarray(y_test, dtype=np.int64)
        self.classes, self.l2 = int(classes), float(l2)
        self.shape = (self.x.shape[1], self.classes)
        self.size = self.shape[0] * self.shape[1]

    @staticmethod
    def _augment(x):
        x = np.asarray(x, dtype=np.float64).reshape(len(x), -1)
        return np.hstack([x, np.ones((len(x), 1))])  # a bias column

    def gradients(self, params, batches):
        """Per-rank minibatch gradients: ``params`` ``(p, size)``, ``batches`` ``(p, B)`` indices."""
        w = params.reshape(len(params), *self.shape)
        xb = self.x[batches]                                    # (p, B, d)
        logits = np.matmul(xb, w)                               # (p, B, classes)
        prob = np.exp(logits - logits.max(axis=2, keepdims=True))
        prob /= prob.sum(axis=2, keepdims=True)
        rows, cols = np.indices(batches.shape)
        prob[rows, cols, self.y[batches]] -= 1.0
        grad = np.matmul(xb.transpose(0, 2, 1), prob) / batches.shape[1] + self.l2 * w
        return grad.reshape(len(params), self.size)

    def loss(self, params):
        """The full training objective at one parameter vector."""
        w = params.reshape(self.shape)
        logits = self.x @ w
        top = logits.max(axis=1, keepdims=True)
        logz = top[:, 0] + np.log(np.exp(logits - top).sum(axis=1))
        nll = np.mean(logz - logits[np.arange(len(self.y)), self.y])
        return float(nll + 0.5 * self.l2 * np.sum(w * w))

    def accuracy(self, params):
        """Test accuracy at one parameter vector."""
        return float(np.mean(np.argmax(self.x_test @ params.reshape(self.shape), axis=1) == self.y_test))


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


def _check(scheme, p, steps, lr, batch, tau, beta, delay, skew):
    if scheme not in SCHEMES:
        raise ValueError(f"run_sgd: scheme must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    for name, value in (("p", p), ("steps", steps), ("batch", batch), ("tau", tau)):
        check_integer(value, name, 1, owner="run_sgd")
    check_integer(delay, "delay", 0, owner="run_sgd")
    if delay and scheme != "sgp":
        raise ValueError(f"run_sgd: delay is PushSum's (scheme 'sgp'), not {scheme!r}'s")
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
            eval_every=None, delay=0, skew=0.0):
    """Simulate ``steps`` SGD steps of ``scheme`` on ``p`` virtual ranks, all starting at zero.

    Args:
        problem: a :class:`SoftmaxRegression` (anything with ``size``, ``gradients``, ``loss``,
            ``accuracy`` and ``y``).
        tau: steps between mixing rounds (gossip, EASGD, and SGP).
        delay: SGP's messages are added to their receivers this many rounds after they are sent.
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
    _check(scheme, p, steps, lr, batch, tau, beta, delay, skew)
    eval_every = eval_every or max(1, steps // 20)
    rng = np.random.default_rng(seed)
    x = np.zeros((p, problem.size))
    center = np.zeros(problem.size)
    own = None
    if skew:
        count = np.bincount(problem.y)
        if (count == 0).any():
            raise ValueError("run_sgd: skew needs every class among the training labels")
        start = np.concatenate([[0], np.cumsum(count)[:-1]])
        own = (np.argsort(problem.y, kind="stable"), start, count, np.arange(p) % len(count))
    pushsum = (PushSumSim(x, topology or topo_mod.ExponentialGraph(), delay=delay, exact=False)
               if scheme == "sgp" else None)
    push = GossipPushSim(x, seed=seed) if scheme == "gossip-push" else None
    pull = topo_mod.RandomPeers(peers=1, seed=seed, allow_self=True).bind(p) if scheme == "gossip-pull" else None
    if pushsum is not None:
        x = pushsum.x          # the simulators own their rows; SGD updates them in place
    if push is not None:
        x = push.x
    out = {"scheme": scheme, "p": p, "lr": lr, "tau": tau, "delay": delay, "skew": skew, "steps": [], "loss": [],
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
