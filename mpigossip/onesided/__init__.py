"""The one-sided family, over MPI RMA windows: :mod:`.server`
(:class:`~mpigossip.ParameterServer`), :mod:`.elastic` (:class:`~mpigossip.ElasticAveraging`
and :class:`~mpigossip.AsyncSGD` workers), :mod:`.adpsgd` (:class:`~mpigossip.ADPSGD`),
:mod:`.rma` (windows and locks), and :mod:`.progress`: how their targets make progress across
nodes (a thread, a launcher setting or dedicated server ranks), chosen explicitly.
"""
