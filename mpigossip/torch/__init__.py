"""torch adapter (``mpigossip.torch``): a model's parameters in flat buffers, and one wrapper per algorithm.

:class:`FlatParameters` moves a model's parameters into one contiguous buffer per
(device, dtype) group and makes each parameter a view of it, so one message carries a
whole group. Every wrapper has the same contract::

    algo = mpigossip.torch.SGP(model, comm=comm)
    for batch in data:
        loss = criterion(model(inputs), targets)
        optimizer.zero_grad(); loss.backward(); optimizer.step()
        algo.step()

Create the wrapper before the optimizer: flattening re-points ``param.data`` (the
``Parameter`` objects the optimizer holds stay the same, so either order works, but an
optimizer that cached tensors of its own, e.g. fused state, must be built afterwards).
Wrappers work with any torch optimizer; they see only the parameters. Every wrapper takes
``timeout=`` (seconds any of its waits may take, default ``$MPIGOSSIP_TIMEOUT`` or 300).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..core.registry import ALGORITHMS, HIERARCHICAL, OPTIONS, OUTER, options_of
from .allreduce import AllReduce
from .base import BROADCAST, _Wrapper  # noqa: F401 - _Wrapper: for subclasses outside the package
from .decentralized import ADPSGD, DPSGD
from .flat import FlatParameters, broadcast_buffers, broadcast_parameters
from .gossip import GossipPull, GossipPush
from .gradients import GradientAllReduce
from .outer import DiLoCo, LocalSGD, SlowMo
from .server import ASGD, EASGD
from .sgp import AGP, OSGP, SGP

if TYPE_CHECKING:
    import torch
    from mpi4py import MPI

__all__ = ["ALGORITHMS", "HIERARCHICAL", "OPTIONS", "OUTER", "ADPSGD", "AGP", "AllReduce", "ASGD", "DiLoCo", "DPSGD",
           "EASGD", "FlatParameters", "GossipPull", "GossipPush", "GradientAllReduce", "LocalSGD", "OSGP", "SGP",
           "SlowMo", "broadcast_buffers", "broadcast_parameters", "make", "options_of"]


_CLASSES = {"allreduce": GradientAllReduce, "allreduce-params": AllReduce, "easgd": EASGD, "asgd": ASGD,
            "gossip-pull": GossipPull, "gossip-push": GossipPush, "sgp": SGP, "osgp": OSGP, "agp": AGP, "dpsgd": DPSGD,
            "adpsgd": ADPSGD, "localsgd": LocalSGD, "slowmo": SlowMo, "diloco": DiLoCo}


def make(name: str, model: torch.nn.Module, *, comm: MPI.Intracomm, broadcast: bool | None = None,
         **options: Any) -> _Wrapper:
    """Build a wrapper by algorithm name (one of :data:`ALGORITHMS`) with its options
    (:data:`OPTIONS`, and ``timeout``, which every wrapper takes).

    ``broadcast=False`` (the same on every rank) keeps each rank's own parameters and buffers
    instead of starting every rank from rank 0's: for a run whose state every rank loads next
    (a resume, a heal), which saves sending the model from rank 0 to all. The default (None) is
    True, or what the ``make`` building this one chose (an outer method's base).

    Raises:
        ValueError: unknown algorithm; ``broadcast`` not the same on every rank.
        TypeError: an option that algorithm does not take (misspelled, or another algorithm's),
            naming it and the options it does take.
    """
    if name not in _CLASSES:
        raise ValueError(f"unknown algorithm {name!r}; choose from {', '.join(ALGORITHMS)}")
    accepted = options_of(name, options.get("base")) + ("timeout",)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise TypeError(f"make({name!r}): unexpected option{'s' if len(unknown) > 1 else ''} "
                        f"{', '.join(unknown)}; {name} takes {', '.join(accepted)}")
    if broadcast is None:
        broadcast = BROADCAST.get()
    if not isinstance(broadcast, bool):
        raise TypeError(f"make({name!r}): broadcast must be True or False, got {broadcast!r}")
    token = BROADCAST.set(broadcast)
    try:
        return _CLASSES[name](model, comm=comm, **options)
    finally:
        BROADCAST.reset(token)
