"""The default request strategy of a schedule of messages (the rings of
:mod:`mpigossip.exact.ring`, the mixing step of :mod:`mpigossip.decentralized.pipeline`): plain
``Isend``/``Irecv``. With ``on_failure="continue"`` a schedule is given
:class:`mpigossip.resilience.persistent.PersistentRequests` instead, with the same methods."""

from mpi4py import MPI


class Immediate:
    """The default request strategy: ``Isend``/``Irecv``, each made for one message, waited
    under the owner's deadline (its ``_wait``). ``limit``: the most bytes one request may move
    (None: no limit); ``persistent``: whether a request is kept and started again (then a
    schedule keeps one tag per kind, and its memory in a pool)."""

    limit = None
    persistent = False

    def __init__(self, owner):
        self.owner = owner

    def isend(self, comm, array, dest, tag):
        return comm.Isend(array, dest=dest, tag=tag)

    def irecv(self, comm, array, source, tag):
        return comm.Irecv(array, source=source, tag=tag)

    def message(self, requests):
        """The requests of one message as :meth:`test` and :meth:`wait` take them (a list here)."""
        return requests

    def watch(self, op):
        """At a step boundary: nothing to watch here (a strategy that meets failures raises
        if one is known)."""

    def test(self, requests, op):
        """Whether every request has completed."""
        return MPI.Request.Testall(requests)

    def wait(self, requests, op, peer):
        """Complete ``requests``; ``op`` names the owner's call (e.g. "step (step 5)"), ``peer``
        whom it waits for (a callable of the pending indices, or a string)."""
        self.owner._wait(requests, op, peer=peer)
