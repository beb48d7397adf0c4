"""mpigossip: decentralized and asynchronous averaging for distributed SGD, on MPI.

Communicators work on one flat contiguous buffer (numpy, cupy or torch):

* :class:`AllreduceAverager` - exact mean (AllReduce SGD);
* :class:`PushSum` - Stochastic Gradient Push, synchronous or overlapping (OSGP);
* :class:`Gossip` - gossiping SGD, pull (one-sided RMA) or push;
* :class:`ParameterServer` with :class:`ElasticAveraging` (EASGD) and :class:`AsyncSGD`
  workers - an asynchronous parameter server in passive-target RMA windows.
"""

__version__ = "0.1.0"

from . import buffers, kernels, topology  # noqa: E402
from .allreduce import AllreduceAverager  # noqa: E402
from .elastic import AsyncSGD, ElasticAveraging  # noqa: E402
from .gossip import Gossip  # noqa: E402
from .pushsum import PushSum  # noqa: E402
from .server import ParameterServer  # noqa: E402

__all__ = ["AllreduceAverager", "AsyncSGD", "ElasticAveraging", "Gossip", "ParameterServer",
           "PushSum", "buffers", "kernels", "topology", "__version__"]
