"""SGD with each averaging scheme on ``p`` virtual ranks: a convex problem (L2-regularised
softmax regression), the package's topologies and kernels, no MPI.

Every virtual rank draws its own minibatches from one shared training set (the papers'
i.i.d. setting) and takes plain SGD steps; the schemes differ only in how the ranks'
parameters meet:

* ``allreduce``: the gradients are averaged exactly, every rank holds the same model;
* ``sgp``: PushSum (:class:`~mpigossip.sim.mixing.PushSumSim`), gradient at ``z = x / w``;
* ``gossip-push`` / ``gossip-pull``: Jin et al.'s gossip every ``tau`` steps (pull: each rank
  averages with one uniformly drawn rank, itself included, all from the old values);
* ``easgd``: a center; every ``tau`` steps all workers read the center, each moves by
  ``alpha = beta / p`` toward it and the center by the sum of their moves (a synchronous
  round of the elastic exchange of :class:`mpigossip.ElasticAveraging`).

The model that is evaluated is the consensus model: the mean of the ranks' (de-biased)
parameters, or the center for ``easgd``.
"""

import numpy as np

from .. import kernels
from .._checks import check_integer
from .. import topology as topo_mod
from .mixing import GossipPushSim, PushSumSim, consensus_error

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
        logits = np.einsum("pbd,pdc->pbc", xb, w)
        prob = np.exp(logits - logits.max(axis=2, keepdims=True))
        prob /= prob.sum(axis=2, keepdims=True)
        rows, cols = np.indices(batches.shape)
        prob[rows, cols, self.y[batches]] -= 1.0
        grad = np.einsum("pbd,pbc->pdc", xb, prob) / batches.shape[1] + self.l2 * w
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
    old = x.copy()
    for i in range(len(x)):
        (t,) = topology.out_peers(i, step)
        kernels.weighted_sum(x[i], old[i], 0.5, [old[t]], [0.5])


def elastic_round(x, center, beta):
    """One synchronous EASGD round: every worker reads the same center, moves by
    ``u_i = alpha (x_i - center)`` toward it (``alpha = beta / p``), and the center moves by
    the sum of the ``u_i``: ``sum(x) + center`` is unchanged."""
    alpha = beta / len(x)
    read = center.copy()
    for i in range(len(x)):
        u = read.copy()
        kernels.elastic(x[i], u, alpha)       # u = alpha (x_i - center), x_i -= u
        center += u


def _check(scheme, p, steps, lr, batch, tau, beta):
    if scheme not in SCHEMES:
        raise ValueError(f"run_sgd: scheme must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    for name, value in (("p", p), ("steps", steps), ("batch", batch), ("tau", tau)):
        check_integer(value, name, 1, owner="run_sgd")
    if not lr > 0:
        raise ValueError(f"run_sgd: lr must be > 0, got {lr!r}")
    if not 0 < beta <= 1:
        raise ValueError(f"run_sgd: beta must be in (0, 1], got {beta!r}")


def run_sgd(problem, scheme, p, *, steps, lr, batch=16, tau=1, beta=0.9, seed=0, topology=None,
            eval_every=None):
    """Simulate ``steps`` SGD steps of ``scheme`` on ``p`` virtual ranks, all starting at zero.

    Args:
        problem: a :class:`SoftmaxRegression` (anything with ``size``, ``gradients``, ``loss``,
            ``accuracy`` and ``y``).
        topology: the SGP graph (default ``ExponentialGraph()``).
        eval_every: evaluate the consensus model every this many steps (default ``steps // 20``).

    Returns:
        dict with ``steps`` (the evaluated step counts, from 0), ``loss`` and ``accuracy`` of
        the consensus model and ``consensus`` (root-mean-square distance of the ranks'
        models from their mean) at those steps.
    """
    _check(scheme, p, steps, lr, batch, tau, beta)
    eval_every = eval_every or max(1, steps // 20)
    rng = np.random.default_rng(seed)
    x = np.zeros((p, problem.size))
    center = np.zeros(problem.size)
    pushsum = PushSumSim(x, topology or topo_mod.ExponentialGraph()) if scheme == "sgp" else None
    push = GossipPushSim(x, seed=seed) if scheme == "gossip-push" else None
    pull = topo_mod.RandomPeers(peers=1, seed=seed, allow_self=True).bind(p) if scheme == "gossip-pull" else None
    if pushsum is not None:
        x = pushsum.x          # the simulators own their rows; SGD updates them in place
    if push is not None:
        x = push.x
    out = {"scheme": scheme, "p": p, "lr": lr, "steps": [], "loss": [], "accuracy": [], "consensus": []}

    def record(k):
        z = pushsum.debiased() if pushsum is not None else x
        model = center if scheme == "easgd" else z.mean(axis=0)
        out["steps"].append(k)
        out["loss"].append(problem.loss(model))
        out["accuracy"].append(problem.accuracy(model))
        out["consensus"].append(consensus_error(z))

    record(0)
    for k in range(steps):
        batches = rng.integers(0, len(problem.y), (p, batch))
        if scheme == "allreduce":
            x -= lr * problem.gradients(x[:1], batches.reshape(1, -1))   # the mean of p equal-size batches
            x[1:] = x[0]
        elif pushsum is not None:
            x -= lr * problem.gradients(pushsum.debiased(), batches)
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
