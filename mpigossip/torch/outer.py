"""Local SGD, SlowMo and DiLoCo: an outer optimizer over a parameter-averaging wrapper."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..core import kernels
from ..core.registry import INNER_MIXING_FAILURE, OPTION_DEFAULTS, OUTER_BASES
from ..exact import outer as outer_mod
from ..exact.allreduce import AllreduceAverager
from .base import _tensors

if TYPE_CHECKING:
    from collections.abc import Mapping

    from mpi4py import MPI


class _Outer:
    """Every ``inner_steps`` steps, the ``base`` wrapper averages the parameters (AllReduce,
    SGP, D-PSGD or gossip push, hierarchical too) and an outer optimizer moves the anchor
    (the model at the previous outer step) by ``anchor - averaged`` (:mod:`mpigossip.exact.outer`,
    one fused kernel per parameter group); between outer steps nothing is sent.

    With ``on_failure="continue"`` (a base option) the survivors of a failed rank go on: the
    base meets the failure at its next average and recovers (:mod:`mpigossip.resilience.failures`); the
    outer state (anchor, momentum) is each rank's own; after each average the survivors agree
    whether a rank failed in it, so that all recover at the same step. Not with
    ``inner_mixing`` over gossip.

    Same contract as every wrapper: build it before the optimizer, call :meth:`step` after
    every ``optimizer.step()`` (also when a mixed-precision scaler skipped it: the count
    keeps the ranks' outer steps together). Everything else (consensus model, evaluation,
    ``free()``) is the base wrapper's. With SGP as the base the outer update is applied to
    the numerators as SGP applies any update (``x += Δ``), and the parameters are then
    ``x / w`` again.

    Args:
        model: the torch model.
        comm: communicator (keyword-only).
        base: the averaging wrapper's name (:data:`mpigossip.core.registry.OUTER_BASES`).
        inner_steps: local steps between outer steps.
        outer_lr, outer_momentum: the outer optimizer's (``None``: the method's defaults,
            :data:`mpigossip.exact.outer.METHODS`).
        warmup: steps averaging every step first (post-local SGD).
        inner_mixing: the base also mixes at every step, and an outer step first takes the
            exact mean of the parameters (AllReduce) before the outer update: SlowMo's own
            setting (Wang et al.: SGP gossiping every step, an exact average every ``inner_steps``).
            Default False: nothing is sent between outer steps.
        timeout: seconds any wait may take.
        **options: the base wrapper's options (e.g. ``topology``, ``hierarchical``).
    """

    name = method = "?"

    def __init__(self, model: torch.nn.Module, *, comm: MPI.Intracomm, base: str = OPTION_DEFAULTS["base"],
                 inner_steps: int = OPTION_DEFAULTS["inner_steps"], outer_lr: float | None = None,
                 outer_momentum: float | None = None, warmup: int = 0, inner_mixing: bool = False,
                 timeout: float | None = None, **options: Any) -> None:
        from . import make  # the registry of wrappers (this module is one of them)
        error, chosen = None, None
        try:
            if base not in OUTER_BASES:
                raise ValueError(f"{self.name}: base must be one of {', '.join(OUTER_BASES)} (a parameter-averaging "
                                 f"algorithm), got {base!r}")
            chosen = outer_mod.settings(self.method, inner_steps, outer_lr, outer_momentum, None, warmup)
            if not isinstance(inner_mixing, bool):
                raise ValueError(f"{self.name}: inner_mixing must be True or False, got {inner_mixing!r}")
            if inner_mixing and base != "allreduce-params" and options.get("on_failure") == "continue":
                raise ValueError(f"{self.name}: on_failure='continue': {INNER_MIXING_FAILURE}")
            chosen = chosen + (inner_mixing,)
        except ValueError as exc:
            error = str(exc)
        self.base = make(base if base in OUTER_BASES else "allreduce-params", model, comm=comm, timeout=timeout,
                         **options)
        try:
            outer_mod.agree(self.base.comm, (error, chosen), self.base.timeout,
                            f"mpigossip.torch.{type(self).__name__}")
        except ValueError:
            self.base.free()
            raise
        assert chosen is not None   # else agree() raised
        _, self.inner_steps, self.lr, self.momentum, self.nesterov, self.warmup, self.inner_mixing = chosen
        if options.get("on_failure") == "continue":
            # the base steps every inner_steps: without agreeing, a survivor whose average completed
            # would meet the failure one outer period after the others, past collectives in between
            self.base.agree_on_failures()
        self._exact = []  # inner_mixing: the exact mean of each group at an outer step
        if self.inner_mixing and base != "allreduce-params":
            # in the model's own dtype: the exact mean stays exact (a format would snap it to its grid)
            self._exact = [AllreduceAverager(z, comm=self.base.comm, timeout=self.base.timeout)
                           for z in self.base.flat.arrays]
        with self.base._ordered():
            self.anchors = [a.copy() for a in self.base.flat.arrays]
            self.momenta = [a.copy() for a in self.base.flat.arrays]
            for m in self.momenta:
                m[...] = 0
        self.steps = self.exchanges = 0
        self.exchanged = False  # whether the last step averaged

    def __getattr__(self, name):
        if name == "base":  # not yet set: construction failed
            raise AttributeError(name)
        return getattr(self.base, name)

    def step(self) -> None:
        """Call once per iteration, after ``optimizer.step()`` (``exchanged`` then says whether
        it averaged)."""
        self.base._check_open()
        self.steps += 1
        outer = self.exchanged = outer_mod.averages_at(self.steps, self.inner_steps, self.warmup)
        if self.inner_mixing or outer:
            self.base.step()
        if not outer:
            return
        with self.base._ordered():
            for avg in self._exact:  # the base only mixed: the outer step needs the exact mean
                avg.average()
            plain = (self.lr == 1.0 and self.momentum == 0.0) or self.steps <= self.warmup
            for z, a, m in zip(self.base.flat.arrays, self.anchors, self.momenta):
                outer_mod.update(a, z, m, lr=self.lr, mu=self.momentum, nesterov=self.nesterov, plain=plain)
            if self._exact or not plain:
                self._sync_numerators()
        self.exchanges += 1

    def _sync_numerators(self):
        """SGP as the base: the numerators absorb the parameters' change as SGP applies any
        update (``x += Δ``), and the parameters are ``x / w`` again (exactly what they were
        when ``w == 1``, as on a regular graph)."""
        if hasattr(self.base, "numerators"):
            self.base._apply_update()
            for ps, z in zip(self.base.comms, self.base.flat.arrays):
                kernels.debias(z, ps.buffer.array, ps.weight)

    def free(self) -> None:
        """Free the exact averagers (inner_mixing) and the base wrapper (collective)."""
        for avg in self._exact:
            avg.free()
        self._exact = []
        self.base.free()

    def state_dict(self) -> dict[str, Any]:
        """``{"algorithm", "steps", "exchanges", "base", "anchors", "momenta"}``: the base
        wrapper's whole state under ``"base"``, and the outer state: a resumed run continues
        exactly."""
        with self.base._ordered():
            self._sync_numerators()  # the local steps since the last outer step are in the parameters
        base = self.base.state_dict()
        with self.base._ordered():
            host = [[np.array(a if isinstance(a, np.ndarray) else a.get()) for a in arrays]
                    for arrays in (self.anchors, self.momenta)]
        return {"algorithm": self.name, "steps": self.steps, "exchanges": self.exchanges, "base": base,
                "anchors": _tensors(host[0]), "momenta": _tensors(host[1])}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("algorithm") != self.name:
            raise ValueError(f"checkpoint is for {state.get('algorithm')!r}, not {self.name!r}")
        missing = [k for k in ("steps", "exchanges", "base", "anchors", "momenta") if k not in state]
        if missing:
            raise ValueError(f"{self.name}: the state lacks {', '.join(missing)}")
        self.base.load_state_dict(state["base"])  # refuses another base algorithm by name
        with self.base._ordered():
            for mine, saved in ((self.anchors, state["anchors"]), (self.momenta, state["momenta"])):
                if len(saved) != len(mine):
                    raise ValueError(f"{self.name}: the state has {len(saved)} parameter groups, "
                                     f"this model {len(mine)}")
                for array, value in zip(mine, saved):
                    value = value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
                    if value.shape != array.shape:
                        raise ValueError(f"{self.name}: a saved group has shape {value.shape}, expected {array.shape}")
                    if isinstance(array, np.ndarray):
                        array[...] = value
                    else:
                        array.set(np.ascontiguousarray(value, dtype=array.dtype))
        self.steps, self.exchanges = int(state["steps"]), int(state["exchanges"])

    def __repr__(self):
        return (f"<mpigossip.torch.{type(self).__name__} H={self.inner_steps}"
                f"{' inner_mixing' if self.inner_mixing else ''} lr={self.lr:g} "
                f"momentum={self.momentum:g} steps={self.steps} base={self.base!r}>")


class LocalSGD(_Outer):
    """Local SGD (``"localsgd"``): plain averaging every ``inner_steps`` steps (post-local SGD
    with ``warmup``)."""

    name = method = "localsgd"


class SlowMo(_Outer):
    """SlowMo (``"slowmo"``, Wang et al. 2020): slow momentum on the averaged displacement."""

    name = method = "slowmo"


class DiLoCo(_Outer):
    """DiLoCo (``"diloco"``, Douillard et al. 2023): outer Nesterov momentum (lr 0.7, 0.9)."""

    name = method = "diloco"
