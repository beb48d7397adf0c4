"""Outer optimizers over any averaging object: local SGD, post-local SGD, SlowMo, DiLoCo.

Every rank trains its own copy for ``inner_steps`` steps; then the averaging object averages
the model (AllReduce: the exact mean; PushSum/SGP, gossip, D-PSGD, hierarchical: a mixing
step, so the ranks' anchors differ, as in NoLoCo's gossip outer step), and an outer optimizer
moves the anchor, the model at the previous outer step, by the pseudo-gradient
``anchor - averaged model`` (one fused kernel, :func:`mpigossip.core.kernels.outer`):

* plain averaging (``lr=1, momentum=0``): local SGD; with ``warmup`` steps of averaging at
  every step first, post-local SGD (Lin et al. 2020);
* SlowMo (Wang et al. 2020): slow momentum ``momentum`` and outer learning rate ``lr``;
* DiLoCo (Douillard et al. 2023): outer Nesterov momentum (``nesterov=True``, typically
  ``lr=0.7, momentum=0.9``).

The outer step overwrites the model with the new anchor. With a PushSum averager (which
carries a weight ``w``) the model is ``x / w``: the pseudo-gradient uses it and ``x`` is set
to ``w * anchor``, so the weights, and PushSum's Σw, are untouched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..core import buffers, deadline, kernels
from ..core.base import Steps
from ..core.checks import check_integer

if TYPE_CHECKING:
    from ..core.hints import Buffer

#: The outer methods by name: (lr, momentum, nesterov) defaults.
METHODS = {"localsgd": (1.0, 0.0, False), "slowmo": (1.0, 0.5, False), "diloco": (0.7, 0.9, True)}


def _number(value, name, low, high=None):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value) \
            or value < low or (high is not None and value >= high):
        bound = f">= {low}" + ("" if high is None else f" and < {high}")
        raise ValueError(f"Outer: {name} must be a number {bound}, got {value!r}")
    return float(value)


def settings(method="localsgd", inner_steps=1, lr=None, momentum=None, nesterov=None, warmup=0):
    """``(method, inner_steps, lr, momentum, nesterov, warmup)`` checked, ``None`` replaced by
    the method's default (:data:`METHODS`); ``ValueError`` naming the bad one."""
    if method not in METHODS:
        raise ValueError(f"Outer: method must be one of {sorted(METHODS)}, got {method!r}")
    check_integer(inner_steps, "inner_steps", 1, owner="Outer")
    check_integer(warmup, "warmup", 0, owner="Outer")
    d_lr, d_mu, d_nesterov = METHODS[method]
    lr = _number(d_lr if lr is None else lr, "lr", 0.0)
    if lr == 0.0:
        raise ValueError("Outer: lr must be > 0, got 0")
    momentum = _number(d_mu if momentum is None else momentum, "momentum", 0.0, 1.0)
    return method, int(inner_steps), lr, momentum, bool(d_nesterov if nesterov is None else nesterov), int(warmup)


def averages_at(step, inner_steps, warmup):
    """Whether step number ``step`` (1 for the first) is an outer step: every step of the
    warm-up, then every ``inner_steps``-th."""
    return step <= warmup or (step - warmup) % inner_steps == 0


def update(anchor, x, momentum, *, lr, mu, nesterov, plain, w=1.0):
    """The outer step on one buffer just averaged (the model is ``x / w``): with ``plain``
    (local SGD, or a warm-up step) the anchor becomes the model exactly; otherwise one fused
    kernel (:func:`mpigossip.core.kernels.outer`) moves the anchor and writes ``x = w * anchor``."""
    if not plain:
        kernels.outer(anchor, x, momentum, lr, mu, nesterov=nesterov, w=w)
    elif w == 1.0:
        anchor[...] = x
    else:
        kernels.debias(anchor, x, w)


def agree(comm, values, timeout, owner):
    """Raise the same ``ValueError`` on every rank of ``comm`` unless every rank passed the same
    ``values`` (``(error or None, settings)``)."""
    infos = deadline.allgather(comm, values, timeout=timeout, op=owner)
    errors = sorted({e for e, _ in infos if e})
    if errors:
        raise ValueError("; ".join(errors))
    if len({i for _, i in infos}) > 1:
        raise ValueError(f"{owner}: (method, inner_steps, lr, momentum, nesterov, warmup) differ across ranks: "
                         + ", ".join(f"rank {r}: {i}" for r, (_, i) in enumerate(infos)))


class Outer(Steps):
    """Every ``inner_steps`` steps, average with ``averager`` and take an outer optimizer step.

    Call :meth:`step` after every ``optimizer.step()`` (or after a step a mixed-precision
    scaler skipped: the count, not the update, keeps the ranks together).

    Args:
        x: the model's flat buffer (numpy/cupy/torch), the one ``averager`` averages in place.
        averager: any averaging object over ``x`` (a communicator, ``Hierarchical``...); its
            ``step()`` runs at each outer step (and every step of the warm-up).
        inner_steps: local steps between outer steps (H >= 1; 1 averages every step).
        method: ``"localsgd"``, ``"slowmo"`` or ``"diloco"``: the defaults of ``lr``,
            ``momentum`` and ``nesterov`` (see :data:`METHODS`).
        lr: outer learning rate (> 0).
        momentum: outer momentum in [0, 1).
        nesterov: Nesterov outer momentum.
        warmup: steps that average at every step before the local phase (post-local SGD).

    ``steps`` counts calls, ``exchanges`` the outer steps. ``state_dict()`` holds the anchor
    and the momentum (as arrays of the buffer's module) and the averager's state: a resumed
    run continues exactly.
    """

    _name = "Outer"
    _counters = ("steps", "exchanges")
    _state_keys = ("anchor", "momentum", "inner")

    def __init__(self, x: Buffer, averager: Any, *, inner_steps: int, method: str = "localsgd", lr: float | None = None,
                 momentum: float | None = None, nesterov: bool | None = None, warmup: int = 0) -> None:
        if not isinstance(averager, Steps):
            raise TypeError(f"Outer: averager must be an averaging object (a communicator), got {averager!r}")
        error, chosen = None, None
        try:
            chosen = settings(method, inner_steps, lr, momentum, nesterov, warmup)
        except ValueError as exc:
            error = str(exc)
        comm = getattr(averager, "comm", None)
        if comm is not None:  # the same error, and the same schedule, on every rank
            agree(comm, (error, chosen), getattr(averager, "timeout", deadline.default_timeout()), "Outer")
        elif error:
            raise ValueError(error)
        assert chosen is not None   # else agree() raised
        self.method, self.inner_steps, self.lr, self.momentum, self.nesterov, self.warmup = chosen
        self.averager: Any = averager
        self.buffer = buffers.as_buffer(x, name="x")
        self._anchor = buffers.scratch(self.buffer).array
        self._momentum = buffers.scratch(self.buffer).array
        self._momentum[...] = 0
        self.buffer.acquire()  # the starting model, x / w, is the first anchor
        update(self._anchor, self.buffer.array, None, lr=1.0, mu=0.0, nesterov=False, plain=True,
               w=float(getattr(averager, "weight", 1.0)))
        self.buffer.release()
        self.steps = self.exchanges = 0
        self.exchanged = False  # whether the last step averaged

    @property
    def plain(self) -> bool:
        """Whether the outer step is plain averaging (the anchor becomes the average, exactly)."""
        return self.lr == 1.0 and self.momentum == 0.0

    def due(self) -> bool:
        """Whether the next :meth:`step` averages."""
        return averages_at(self.steps + 1, self.inner_steps, self.warmup)

    def step(self) -> None:
        """Count a local step; on an outer step, average and update the anchor (then
        ``exchanged`` is True until the next step)."""
        self._check_open()
        self.exchanged = self.due()
        self.steps += 1
        if not self.exchanged:
            return
        self.averager.step()
        self.buffer.acquire()
        update(self._anchor, self.buffer.array, self._momentum, lr=self.lr, mu=self.momentum, nesterov=self.nesterov,
               plain=self.plain or self.steps <= self.warmup,
               w=float(getattr(self.averager, "weight", 1.0)))  # PushSum: the model is x / w
        self.buffer.release()
        self.exchanges += 1

    def drain(self) -> None:
        self.averager.drain()

    @property
    def in_flight(self) -> bool:
        return self.averager.in_flight

    @property
    def closed(self) -> bool:
        return self.averager.closed

    def _check_open(self):
        self.averager._check_open()

    def _state(self):
        self.buffer.synchronize()
        return {"anchor": self._anchor.copy(), "momentum": self._momentum.copy(),
                "inner": self.averager.state_dict()}

    def _load_state(self, state):
        for key, mine in (("anchor", self._anchor), ("momentum", self._momentum)):
            value = state[key]
            if getattr(value, "shape", None) != mine.shape:
                raise ValueError(f"Outer.load_state_dict: {key} has shape {getattr(value, 'shape', None)}, "
                                 f"expected {mine.shape}")
            mine[...] = value
        self.averager.load_state_dict(state["inner"])

    def free(self) -> None:
        self.averager.free()

    def __repr__(self):
        return (f"<Outer {self.method} H={self.inner_steps} lr={self.lr:g} momentum={self.momentum:g}"
                f"{' nesterov' if self.nesterov else ''} warmup={self.warmup} steps={self.steps} "
                f"{self.averager!r}>")
