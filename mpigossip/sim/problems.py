"""The problems the accuracy simulator trains (:func:`mpigossip.sim.sgd.run_sgd`): each holds
its data and gives, for a ``(p, size)`` array of the ranks' parameters, their minibatch
gradients in one vectorised pass, and at one parameter vector the loss and test accuracy.

* :class:`SoftmaxRegression`: convex. On i.i.d. data sparse mixing costs few steps, which
  flatters the sparsest mixer.
* :class:`MLP`: one hidden layer, non-convex (its hidden units can be swapped): ranks that
  drift apart may settle in different basins, and the mean of two models from different
  basins is not a model between them. Where mixing matters, it shows here first.
"""

import numpy as np


def _augment(x):
    x = np.asarray(x, dtype=np.float64).reshape(len(x), -1)
    return np.hstack([x, np.ones((len(x), 1))])  # a bias column


def _labels(x, y, classes, owner):
    y = np.asarray(y, dtype=np.int64)
    if len(x) != len(y) or len(y) == 0:
        raise ValueError(f"{owner}: x and y must be non-empty and of the same length")
    if classes < 2 or y.min() < 0 or y.max() >= classes:
        raise ValueError(f"{owner}: labels must lie in [0, {classes})")
    return y


def _softmax_residual(logits, y):
    """``softmax(logits) - onehot(y)`` over the last axis of ``(p, B, classes)`` logits."""
    prob = np.exp(logits - logits.max(axis=2, keepdims=True))
    prob /= prob.sum(axis=2, keepdims=True)
    rows, cols = np.indices(y.shape)
    prob[rows, cols, y] -= 1.0
    return prob


def _nll(logits, y):
    top = logits.max(axis=1, keepdims=True)
    logz = top[:, 0] + np.log(np.exp(logits - top).sum(axis=1))
    return float(np.mean(logz - logits[np.arange(len(y)), y]))


class SoftmaxRegression:
    """Multinomial logistic regression with an L2 penalty: a convex objective. Every rank
    starts at zero.

    Args:
        x: ``(N, d)`` training inputs; y: ``(N,)`` integer labels in ``[0, classes)``.
        x_test, y_test: held-out data for the accuracy (default: the training data).
        l2: weight of ``l2 / 2 * ||W||^2``.
    """

    def __init__(self, x, y, classes, *, x_test=None, y_test=None, l2=1e-4):
        self.x = _augment(x)
        self.y = _labels(self.x, y, classes, "SoftmaxRegression")
        self.x_test = self.x if x_test is None else _augment(x_test)
        self.y_test = self.y if y_test is None else np.asarray(y_test, dtype=np.int64)
        self.classes, self.l2 = int(classes), float(l2)
        self.shape = (self.x.shape[1], self.classes)
        self.size = self.shape[0] * self.shape[1]
        self.name = "softmax regression"

    def initial(self, seed):
        """The parameters every rank starts from: zero (the objective is convex)."""
        return np.zeros(self.size)

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
        return float(_nll(self.x @ w, self.y) + 0.5 * self.l2 * np.sum(w * w))

    def accuracy(self, params):
        """Test accuracy at one parameter vector."""
        return float(np.mean(np.argmax(self.x_test @ params.reshape(self.shape), axis=1) == self.y_test))


class MLP:
    """One hidden layer of ``hidden`` tanh units and a softmax output, with an L2 penalty: a
    non-convex objective. Every rank starts from the same random parameters
    (:meth:`initial`: zero would leave the hidden units alike forever).

    Args:
        x: ``(N, d)`` training inputs; y: ``(N,)`` integer labels in ``[0, classes)``.
        hidden: hidden units (default 32).
        x_test, y_test: held-out data for the accuracy (default: the training data).
        l2: weight of ``l2 / 2 * ||params||^2``.
    """

    def __init__(self, x, y, classes, *, hidden=32, x_test=None, y_test=None, l2=1e-4):
        self.x = _augment(x)
        self.y = _labels(self.x, y, classes, "MLP")
        if not isinstance(hidden, int) or hidden < 1:
            raise ValueError(f"MLP: hidden must be an integer >= 1, got {hidden!r}")
        self.x_test = self.x if x_test is None else _augment(x_test)
        self.y_test = self.y if y_test is None else np.asarray(y_test, dtype=np.int64)
        self.classes, self.hidden, self.l2 = int(classes), hidden, float(l2)
        d = self.x.shape[1]
        self._first = (d, hidden)
        self._second = (hidden + 1, self.classes)   # (the hidden layer's bias row last)
        self.size = d * hidden + (hidden + 1) * self.classes
        self.name = f"an MLP ({hidden} tanh units)"

    def initial(self, seed):
        """Random parameters, the same on every rank (scaled by fan-in)."""
        rng = np.random.default_rng(seed)
        w1 = rng.standard_normal(self._first) / np.sqrt(self._first[0])
        w2 = rng.standard_normal(self._second) / np.sqrt(self._second[0])
        return np.concatenate([w1.ravel(), w2.ravel()])

    def _split(self, params):
        n = self._first[0] * self._first[1]
        return params[:, :n].reshape(len(params), *self._first), params[:, n:].reshape(len(params), *self._second)

    def _forward(self, w1, w2, xb):
        hid = np.tanh(np.matmul(xb, w1))                                    # (p, B, hidden)
        with_bias = np.concatenate([hid, np.ones((*hid.shape[:2], 1))], axis=2)
        return hid, with_bias, np.matmul(with_bias, w2)                     # logits (p, B, classes)

    def gradients(self, params, batches):
        """Per-rank minibatch gradients: ``params`` ``(p, size)``, ``batches`` ``(p, B)`` indices."""
        w1, w2 = self._split(params)
        xb = self.x[batches]
        hid, with_bias, logits = self._forward(w1, w2, xb)
        residual = _softmax_residual(logits, self.y[batches]) / batches.shape[1]
        g2 = np.matmul(with_bias.transpose(0, 2, 1), residual) + self.l2 * w2
        back = np.matmul(residual, w2[:, :self.hidden, :].transpose(0, 2, 1)) * (1.0 - hid * hid)
        g1 = np.matmul(xb.transpose(0, 2, 1), back) + self.l2 * w1
        return np.concatenate([g1.reshape(len(params), -1), g2.reshape(len(params), -1)], axis=1)

    def loss(self, params):
        """The full training objective at one parameter vector."""
        w1, w2 = self._split(params[None, :])
        logits = self._forward(w1, w2, self.x[None])[2][0]
        return _nll(logits, self.y) + 0.5 * self.l2 * float(params @ params)

    def accuracy(self, params):
        """Test accuracy at one parameter vector."""
        w1, w2 = self._split(params[None, :])
        return float(np.mean(np.argmax(self._forward(w1, w2, self.x_test[None])[2][0], axis=1) == self.y_test))
