"""Stochastic Gradient Push, synchronous and overlapping (Assran et al.)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .. import topology as topo_mod
from ..core import kernels
from ..core.registry import OPTION_DEFAULTS
from ..decentralized.pushsum import PushSum
from .base import _Wrapper

if TYPE_CHECKING:
    from collections.abc import Mapping

    from mpi4py import MPI

    from ..topology import Topology


class SGP(_Wrapper):
    """Stochastic Gradient Push (Algorithm 1 of Assran et al.).

    The model's parameters hold the de-biased ``z = x / w``; the numerator ``x`` lives in
    the wrapper. After ``optimizer.step()`` turned ``z`` into ``z + Δ``, :meth:`step`
    applies the same update to the numerator, ``x += Δ`` (so the gradient taken at ``z``
    is applied to ``x``, with any optimizer), mixes ``(x, w)`` with PushSum, and writes the
    new ``z = x / w`` back into the parameters in the same fused pass.

    With ``hierarchical=True`` the numerators are averaged exactly inside each node (shared
    memory) and PushSum runs between nodes on the topology over nodes (``node_size`` as
    :class:`mpigossip.NodeMean`); ``z`` is then written in a separate pass.

    With ``on_failure="continue"`` (launched with ULFM: :mod:`mpigossip.resilience.failures`) the
    survivors of a failed rank go on: each group's PushSum recovers in its step, then the
    wrapper's own communicator (consensus, evaluation) shrinks to the survivors too, at the
    step where every group has recorded the failure; ``failures`` lists them.
    """

    name = "sgp"
    max_delay: int | None = 0
    overlap = False

    def __init__(self, model: torch.nn.Module, *, comm: MPI.Intracomm, topology: Topology | None = None,
                 peers: int = OPTION_DEFAULTS["peers"], hierarchical: bool = False, node_size: int | None = None,
                 wire: str | None = None, on_failure: str = "abort", timeout: float | None = None) -> None:
        self._check_on_failure(on_failure, hierarchical and "needs the flat SGP, not hierarchical")
        self.wire = wire
        self.topology = topology if topology is not None else topo_mod.ExponentialGraph(peers=peers)
        self.hierarchical, self.node_size = bool(hierarchical), node_size
        if self.hierarchical and self.overlap:
            raise ValueError("hierarchical averaging is synchronous: use SGP, not OSGP")
        self.numerators: list[Any] = []
        super().__init__(model, comm=comm, timeout=timeout)

    def _make(self, array):
        if self.hierarchical:  # the numerator lives in the node's shared window (host groups)
            h = self._hierarchical(array.copy(), PushSum, rehome=False, topology=self.topology, wire=self.wire)
            self.numerators.append(h.array)
            return h
        x = array.copy()
        self.numerators.append(x)
        # Synchronous: the combine writes z in the same pass. Overlap: z is written after start().
        extra = {} if self.on_failure == "abort" else {"on_failure": self.on_failure}
        return PushSum(x, comm=self.comm, topology=self.topology, z=None if self.overlap else array,
                       max_delay=self.max_delay, timeout=self.timeout, wire=self.wire, **extra)

    def _apply_update(self):
        for ps, z in zip(self.comms, self.flat.arrays):
            # x += z_new - x / w, i.e. x = (1 - 1/w) x + z_new  (exactly z_new when w == 1)
            kernels.weighted_sum(ps.buffer.array, ps.buffer.array, 1.0 - 1.0 / ps.weight, [z], [1.0])

    def _step(self):
        self._apply_update()
        for ps, z in zip(self.comms, self.flat.arrays):
            ps.step()  # z written by the fused combine, except through a node's shared memory
            if self.hierarchical:
                kernels.debias(z, ps.buffer.array, ps.weight)

    @property
    def weights(self) -> list[float]:
        return [ps.weight for ps in self.comms]

    # ------------------------------------------------------------------ uneven shards
    def join(self) -> None:
        """Collective, every rank at the same step: from now on a rank may :meth:`leave`
        (``with mpigossip.Join(algo):``; see :class:`mpigossip.PushSum`)."""
        self._check_open()
        if self.hierarchical:
            raise ValueError(f"{self.name}: ranks cannot leave a hierarchical run (a node's shared window)")
        for ps in self.comms:
            ps.join()

    def leave(self) -> None:
        """Out of data: every parameter group asks to leave at the next step, and this rank
        steps (no update) until its groups have handed their mass to the others. The model
        keeps the parameters it had; the wrapper can no longer step or average."""
        self._check_open()
        for ps in self.comms:
            ps.ask_leave()
        while not all(ps.left for ps in self.comms):
            self.step()

    @property
    def left(self) -> bool:
        """Whether this rank has left (:meth:`leave`)."""
        return bool(self.comms) and all(getattr(ps, "left", False) for ps in self.comms)

    def _check_open(self):
        super()._check_open()
        if self.left:
            raise RuntimeError(f"mpigossip.torch.{type(self).__name__} ({self.name}): this rank has left (leave())")

    def state_dict(self) -> dict[str, Any]:
        self.drain()
        state = super().state_dict()
        # torch tensors, not numpy arrays: checkpoints load with torch.load(weights_only=True)
        state["numerators"] = [torch.from_numpy(np.array(x if isinstance(x, np.ndarray) else x.get()))
                               for x in self.numerators]
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)  # steps and weights
        for ps, x in zip(self.comms, state["numerators"]):
            _copy_in(ps.buffer.array, x)
        with self._ordered():
            for z, ps in zip(self.flat.arrays, self.comms):
                kernels.debias(z, ps.buffer.array, ps.weight)


class OSGP(SGP):
    """Overlap SGP: this step's share is sent while the next forward/backward runs;
    arrivals are added at the next step, at most ``max_delay`` steps late."""

    name = "osgp"
    overlap = True

    def __init__(self, model: torch.nn.Module, *, comm: MPI.Intracomm, topology: Topology | None = None,
                 peers: int = OPTION_DEFAULTS["peers"], max_delay: int | None = OPTION_DEFAULTS["max_delay"],
                 wire: str | None = None, on_failure: str = "abort", timeout: float | None = None) -> None:
        self.max_delay = max_delay
        super().__init__(model, comm=comm, topology=topology, peers=peers, wire=wire, on_failure=on_failure,
                         timeout=timeout)

    def _group_failures(self):
        """Overlap mode survives failures with one parameter group, on its own. A survivor may
        meet the failure outside :meth:`step` (in :meth:`drain`, before a checkpoint or an
        evaluation, while the others met it in a step): the wrapper's own communicator then
        shrinks right after the group's recovery, so that every survivor's collectives come in
        the same order (the group's shrink, the wrapper's, then the drain over the survivors)."""
        groups = self._tolerant_groups()
        if len(groups) > 1 or self._agreeing:
            raise ValueError(f"{self.name}: on_failure='continue' in overlap mode recovers one parameter group on "
                             f"its own: this model has {len(groups)} (one per dtype and device)"
                             + (", and an outer method steps it now and then" if self._agreeing else "")
                             + "; use SGP")
        super()._group_failures()
        for c in groups:
            c._on_recovered = self._follow_failures

    def _step(self):
        self._apply_update()
        for ps, z in zip(self.comms, self.flat.arrays):
            if ps.started:
                ps.finish()     # add what arrived
            ps.start()          # split the share off and send it; x / w is unchanged
            if not ps.left:     # (leaving: z keeps the model it had)
                kernels.debias(z, ps.buffer.array, ps.weight)

    def drain(self) -> None:
        with self._ordered():
            for ps, z in zip(self.comms, self.flat.arrays):
                if ps.started:
                    ps.finish()
                ps.drain()
                kernels.debias(z, ps.buffer.array, ps.weight)


class AGP(OSGP):
    """Asynchronous Gradient Push (Assran & Rabbat): OSGP without a bound on the delay, so no
    rank ever waits for another in :meth:`step` (a straggler slows only itself); shares for
    an out-peer whose link is busy accumulate (:class:`mpigossip.decentralized.agp.AsyncPushSum`).
    :meth:`drain` (collective; run by ``state_dict()`` and ``free()``) receives every share in
    flight, so the mass is exact afterwards even if the ranks ran different numbers of steps.

    The update is applied to the de-biased model: ``x = w * z_new`` (``x += w * Δ``), not
    SGP's ``x += Δ``. Without lockstep a rank may step while nothing arrives (its peers wait
    in a collective, or have finished): it keeps pushing half its mass, its weight ``w``
    halves each step, and SGP's update would move ``z = x / w`` by ``Δ / w``, a step size
    doubling every step (one rank 3x slow ruined training: docs/API.md). Scaled by ``w``, such
    a rank runs plain SGD on its model, and the consensus moves by the ``w``-weighted mean
    of the updates."""

    name = "agp"

    def __init__(self, model: torch.nn.Module, *, comm: MPI.Intracomm, topology: Topology | None = None,
                 peers: int = OPTION_DEFAULTS["peers"], on_failure: str = "abort",
                 timeout: float | None = None) -> None:
        super().__init__(model, comm=comm, topology=topology, peers=peers, max_delay=None, on_failure=on_failure,
                         timeout=timeout)

    def _apply_update(self):
        for ps, z in zip(self.comms, self.flat.arrays):
            kernels.weighted_sum(ps.buffer.array, z, ps.weight)  # x = w * z_new

    def join(self) -> None:
        """Collective (the ranks need not be at the same step): from now on a rank may
        :meth:`leave` (see :class:`mpigossip.AsyncPushSum`)."""
        self._check_open()
        for ps in self.comms:
            ps.join()

    def leave(self) -> None:
        """Out of data: each parameter group gives its mass away and waits for the others'
        next ``drain()`` (an evaluation, a checkpoint, ``free()``), where it drops out. The
        model keeps the parameters it had."""
        self._check_open()
        with self._ordered():
            self._apply_update()
            for ps in self.comms:
                if ps.started:
                    ps.finish()
                ps.leave()


def _copy_in(array, host):
    """Copy a host array (or CPU tensor) into a numpy or cupy array."""
    if isinstance(host, torch.Tensor):
        host = host.numpy()
    if isinstance(array, np.ndarray):
        array[...] = host
    else:
        array.set(np.ascontiguousarray(host, dtype=array.dtype))
