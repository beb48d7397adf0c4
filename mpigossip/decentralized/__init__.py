"""The gossip family: each rank averages with a few peers a step, over two-sided messages.

* :mod:`.pushsum`: :class:`~mpigossip.PushSum` (Stochastic Gradient Push; overlapped as
  OSGP), over :mod:`.pushsum_base` and the chunked, pipelined exchange of :mod:`.pipeline`;
* :mod:`.agp`: :class:`~mpigossip.AsyncPushSum` (Asynchronous Gradient Push: no rank
  waits), with ranks that leave (:mod:`.agp_leave`);
* :mod:`.dpsgd`: :class:`~mpigossip.DPSGD`; :mod:`.gossip`: :class:`~mpigossip.Gossip`
  (pull over one-sided windows, push over messages).

Who talks to whom comes from :mod:`mpigossip.topology`; what happens when a peer fails, from
:mod:`mpigossip.resilience`.
"""
