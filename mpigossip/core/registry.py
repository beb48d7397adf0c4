"""The algorithms by name and the options of their torch wrappers.

Plain data, no imports: the command line checks its flags against it before torch or
MPI are loaded.
"""

from __future__ import annotations

from typing import Any

#: Every algorithm, in the order tables list them.
ALGORITHMS = ("allreduce", "allreduce-params", "easgd", "asgd", "gossip-pull", "gossip-push", "sgp", "osgp", "agp",
              "dpsgd", "adpsgd", "localsgd", "slowmo", "diloco")

#: The outer optimizers (:mod:`mpigossip.exact.outer`) and the parameter-averaging algorithms they run over.
OUTER = ("localsgd", "slowmo", "diloco")
OUTER_BASES = ("allreduce-params", "sgp", "dpsgd", "gossip-push")

#: The options each algorithm's wrapper takes (besides ``comm`` and ``timeout``).
_HIERARCHICAL = ("hierarchical", "node_size")
OPTIONS: dict[str, tuple[str, ...]] = {"allreduce": ("bucket_mb", "wire", "on_failure"), "allreduce-params": ("on_failure",) + _HIERARCHICAL,
           "easgd": ("beta", "tau", "servers"),
           "asgd": ("servers",), "gossip-pull": ("tau", "seed"), "gossip-push": ("tau", "seed", "wire", "on_failure") + _HIERARCHICAL,
           "sgp": ("topology", "peers", "wire", "on_failure") + _HIERARCHICAL, "osgp": ("topology", "peers", "max_delay", "wire", "on_failure"),
           "agp": ("topology", "peers", "on_failure"),
           "dpsgd": ("topology", "wire", "on_failure") + _HIERARCHICAL, "adpsgd": ("seed",),
           **{a: ("base", "inner_steps", "outer_lr", "outer_momentum", "warmup", "inner_mixing") for a in OUTER}}


def options_of(algorithm: str, base: str | None = None) -> tuple[str, ...]:
    """The options a wrapper takes: its own, and for an outer optimizer its base's too."""
    if algorithm in OUTER:
        base = base or OPTION_DEFAULTS["base"]
        return OPTIONS[algorithm] + (OPTIONS[base] if base in OUTER_BASES else ())
    return OPTIONS[algorithm]

#: The one default of each option shared by several layers (the communicator, its torch
#: wrapper and the command line all read it here): every method communicates every step
#: (``tau``), OSGP's messages may arrive one step late (``max_delay``), the EASGD center's
#: moving rate ``beta`` (each of P workers moves by beta / P), one server rank, one out-peer;
#: outer optimizers average the parameters by AllReduce every 32 steps (DiLoCo's outer Nesterov
#: momentum over inner momentum SGD diverged on digits at 4 and 8: docs/RESULTS.md).
OPTION_DEFAULTS: dict[str, Any] = {"tau": 1, "max_delay": 1, "beta": 0.9, "servers": 1, "peers": 1, "seed": 0,
                   "base": "allreduce-params", "inner_steps": 32, "wire": None,
                   "inner_mixing": False, "on_failure": "abort"}

#: The compressed wire formats (:mod:`mpigossip.core.wire`) and the algorithms whose messages can
#: travel in them (``wire=``, ``--wire``); an outer optimizer's through its base. Not the
#: parameters' AllReduce (:data:`PARAMS_WIRE_REFUSED`).
WIRE_FORMATS = ("bf16", "fp16", "int8")
WIRE = ("allreduce", "gossip-push", "sgp", "osgp", "dpsgd")
#: Why ``allreduce-params`` (and the outer optimizers over it) take no wire format.
PARAMS_WIRE_REFUSED = ("a compressed mean of the parameters snaps the model to the format's grid at every average, "
                       "with no rounding error kept (measured on Fashion-MNIST over 5 seeds: -0.3 points with bf16 "
                       "or fp16, -0.9 with int8; docs/RESULTS.md): compress the gradients (allreduce) or use sgp")

#: The algorithms that take ``hierarchical=True`` (``--hierarchical``).
HIERARCHICAL = tuple(a for a in ALGORITHMS if "hierarchical" in OPTIONS[a])

#: The default ``--topology`` of the algorithms that take one.
DEFAULT_TOPOLOGY = {"sgp": "exponential", "osgp": "exponential", "agp": "exponential", "dpsgd": "undirected-ring"}

#: The algorithms whose survivors go on when a rank fails (``on_failure="continue"``,
#: ``--on-failure continue``; :mod:`mpigossip.resilience.failures`), and why the others cannot yet.
FAULT_TOLERANT = ("allreduce", "allreduce-params", "sgp", "osgp", "agp", "dpsgd", "gossip-push") + OUTER  # outer: no inner mixing
#: Algorithms over one-sided windows: Open MPI's ULFM does not cover them.
ONE_SIDED = ("easgd", "asgd", "gossip-pull", "adpsgd")
ONE_SIDED_FAILURE = ("its messages go through one-sided MPI windows, which Open MPI's fault tolerance (ULFM) does "
                     "not cover: rely on the checkpoint and Slurm's requeue instead (--checkpoint-every; jobs/)")
NOT_YET_FAILURE = ("the survivors go on for allreduce, allreduce-params, sgp, osgp, agp, dpsgd and gossip-push, and "
                   "the outer methods over them, only so far (steps on persistent requests; docs/API.md, 'A rank "
                   "dies'); the others end the job, as with --on-failure abort")
#: Why an outer method with ``inner_mixing`` does not survive failures yet.
INNER_MIXING_FAILURE = ("inner_mixing's exact mean at the outer steps (an AllReduce beside the base's gossip) does not "
                        "survive failures yet: use inner_mixing=False (the default), or base='allreduce-params'")
