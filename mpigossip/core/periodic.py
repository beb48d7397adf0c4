"""Every k steps: one composable wrapper that makes any averaging object communicate on
every ``k``-th step only (EASGD's and gossip's ``tau``, local SGD's averaging period)."""

from __future__ import annotations

import warnings
from typing import Any

from .base import Steps
from .checks import check_integer


class Every(Steps):
    """Run ``inner``'s step on every ``k``-th call of :meth:`step`, nothing on the others.

    Args:
        inner: any object with the step interface (:class:`~mpigossip.core.base.Steps`): a
            communicator or a parameter-server worker.
        k: the period in steps (an integer >= 1; 1 forwards every step). Every rank must
            pass the same ``k`` for a collective ``inner``.

    ``steps`` counts calls, ``exchanges`` the steps that communicated (``inner.steps``).
    ``start()``/``finish()`` run ``inner``'s pair on a communicating step and nothing
    otherwise; ``drain()``, ``free()`` and ``in_flight`` are ``inner``'s; ``state_dict()``
    holds both. Any other attribute is read from ``inner``. Purely local: no collective.
    """

    _name = "Every"
    _renamed = {"calls": "steps", "rounds": "exchanges"}  # the names of the classes' old ``tau``
    _state_keys = ("inner",)

    def __init__(self, inner: Any, k: int) -> None:
        if not isinstance(inner, Steps):
            raise TypeError(f"Every: inner must be an averaging object (a communicator or a worker), got {inner!r}")
        check_integer(k, "k", 1, owner="Every")
        self.inner: Any = inner
        self.k = k
        self.steps = 0
        self.exchanged = False  # whether the last step ran inner's
        self._inner_started = False

    @property
    def exchanges(self) -> int:
        """Steps that communicated."""
        return self.inner.steps

    @exchanges.setter
    def exchanges(self, value: int) -> None:
        self.inner.steps = int(value)

    def _due(self):
        return (self.steps + 1) % self.k == 0

    def step(self) -> None:
        """Count a step; on every ``k``-th, run ``inner.step()`` (then ``exchanged`` is True
        until the next step)."""
        self._check_open()
        self.exchanged = self._due()
        self.steps += 1
        if self.exchanged:
            self.inner.step()

    def start(self) -> None:
        self._check_open()
        if self._inner_started:
            raise RuntimeError("Every.start(): call finish() before the next start()")
        self.exchanged = self._due()
        if self.exchanged:
            self.inner.start()
            self._inner_started = True

    def finish(self) -> None:
        self._check_open()
        if self._inner_started:
            self.inner.finish()
            self._inner_started = False
        self.steps += 1

    def drain(self) -> None:
        self.inner.drain()

    @property
    def in_flight(self) -> bool:
        return self._inner_started or self.inner.in_flight

    @property
    def closed(self) -> bool:
        return self.inner.closed

    def _check_open(self):
        self.inner._check_open()

    def _state(self):
        return {"inner": self.inner.state_dict()}

    def _load_state(self, state):
        self.inner.load_state_dict(state["inner"])

    def free(self) -> None:
        self.inner.free()

    def __getattr__(self, name):
        if name == "inner":  # not yet set: construction failed
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __repr__(self):
        return f"<Every k={self.k} steps={self.steps} {self.inner!r}>"


def new_with_tau(cls, base, args, kwargs, tau):
    """``__new__`` of a class whose ``tau=`` is deprecated: ``tau=k`` > 1 builds the object
    without it and returns ``Every(obj, k)`` (with a ``DeprecationWarning``); otherwise a
    bare instance for the usual ``__init__`` (which validates ``tau``)."""
    if isinstance(tau, int) and not isinstance(tau, bool) and tau > 1:
        warnings.warn(f"{cls.__name__}(tau={tau}) is deprecated: use mpigossip.Every({cls.__name__}(...), {tau})",
                      DeprecationWarning, stacklevel=3)
        inner = base.__new__(cls)
        inner.__init__(*args, **kwargs)
        return Every(inner, tau)
    return base.__new__(cls)
