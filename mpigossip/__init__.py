"""mpigossip: decentralized and asynchronous averaging for distributed SGD, on MPI.

Communicators work on one flat contiguous buffer (numpy, cupy or torch):

* :class:`AllreduceAverager` - exact mean (AllReduce SGD);
* :class:`PushSum` - Stochastic Gradient Push, synchronous or overlapping (OSGP);
* :class:`AsyncPushSum` - Asynchronous Gradient Push (no rank waits; also spelt
  ``PushSum(..., max_delay=None)``);
* :class:`Gossip` - gossiping SGD, pull (one-sided RMA) or push;
* :class:`ParameterServer` with :class:`ElasticAveraging` (EASGD) and :class:`AsyncSGD`
  workers - an asynchronous parameter server in passive-target RMA windows;
* :class:`DPSGD` - D-PSGD's synchronous neighbour averaging (doubly stochastic);
* :class:`ADPSGD` - AD-PSGD's asynchronous atomic pairwise averaging in RMA windows;
* :class:`NodeMean` and :class:`Hierarchical` - the exact mean in a node's shared memory,
  then any of the above between nodes;
* :class:`Every` - any of them on every k-th step only.

Every one meets one interface (``mpigossip.core.base.Steps``): ``step()``, the pair
``start()``/``finish()``, ``drain()``, the counter ``steps``, ``state_dict()`` and
``load_state_dict()``, ``free()`` and ``with``.

Importing the package does not initialise MPI: the communicators (and ``mpi4py.MPI``)
are loaded on first use, so the launcher and the MPI-free commands never start MPI.
"""

import importlib

__version__ = "0.1.0"

from . import topology  # noqa: E402  (neither imports MPI)
from .core import kernels  # noqa: E402

#: Public name -> the module that defines it (loaded on first use).
_LAZY = {"AllreduceAverager": "exact.allreduce", "AsyncPushSum": "decentralized.agp", "AsyncSGD": "onesided.elastic",
         "ElasticAveraging": "onesided.elastic", "Gossip": "decentralized.gossip", "ParameterServer": "onesided.server",
         "PushSum": "decentralized.pushsum", "DPSGD": "decentralized.dpsgd", "ADPSGD": "onesided.adpsgd",
         "NodeMean": "exact.node", "Hierarchical": "exact.hierarchical", "Every": "core.periodic",
         "Outer": "exact.outer", "Join": "resilience.membership"}
#: Modules users reach from the top (``mpigossip.buffers``, ``from mpigossip import failures``).
_MODULES = {"buffers": "core.buffers", "wire": "core.wire", "deadline": "core.deadline",
            "failures": "resilience.failures"}

__all__ = ["ADPSGD", "AllreduceAverager", "AsyncPushSum", "AsyncSGD", "DPSGD", "ElasticAveraging", "Every", "Gossip",
           "Hierarchical", "Join", "NodeMean", "Outer", "ParameterServer", "PushSum", "buffers", "deadline",
           "failures", "kernels", "topology", "wire", "__version__"]


def __getattr__(name):
    if name in _MODULES:
        value = importlib.import_module(f".{_MODULES[name]}", __name__)
    elif name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | set(_MODULES))
