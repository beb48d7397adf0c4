"""The exact averagers: every rank ends a step with the same mean.

* :mod:`.allreduce`: :class:`~mpigossip.AllreduceAverager` (AllReduce SGD), and how it moves
  bytes: MPI's own allreduce, a ring over ``Isend``/``Irecv`` (:mod:`.ring`), the node-aware
  ring, compressed formats (:mod:`.wire_allreduce`);
* :mod:`.node` and :mod:`.hierarchical`: the mean in a node's shared memory, then any
  communicator between nodes;
* :mod:`.outer`: outer optimizers (local SGD, SlowMo, DiLoCo) over any averaging
  communicator.
"""
