"""A simulator of many virtual ranks in one process, without MPI: a user of the package's
topologies and kernels, beside the communicators (which do not know it exists).

* :mod:`.mixing`: PushSum and gossip-push rounds on a ``(p, n)`` array, bit for bit what
  real ranks compute; consensus error curves to p = 1024.
* :mod:`.sgd`: SGD on a convex or a non-convex problem (:mod:`.problems`) with each averaging scheme (AllReduce, SGP, gossip
  push/pull, EASGD with a center), to see how error and accuracy scale with p.
* :mod:`.timing` (on :mod:`.events`, :mod:`.cluster` and :mod:`.methods`): the time model,
  each method's steps as events on a cluster of links and cores with measured costs;
  :mod:`.validation` against the P4 benchmark, :mod:`.scaling` predictions at scale.
"""

from .mixing import AsyncPushSumSim, GossipPushSim, PushSumSim, consensus_curve, consensus_error
from .problems import MLP, SoftmaxRegression
from .sgd import SCHEMES, elastic_round, pull_round, run_sgd
from .timing import Costs, Workload, simulate

__all__ = ["PushSumSim", "AsyncPushSumSim", "GossipPushSim", "consensus_error", "consensus_curve", "SoftmaxRegression", "MLP", "run_sgd",
           "SCHEMES", "elastic_round", "pull_round", "Costs", "Workload", "simulate"]
