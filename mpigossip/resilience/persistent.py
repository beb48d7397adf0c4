"""Persistent requests as a request strategy, for a schedule run with ``on_failure="continue"``.

A schedule (the rings of :mod:`mpigossip.exact.ring`, the mixing step of
:mod:`mpigossip.decentralized.pipeline`, PushSum's overlap mode in
:mod:`mpigossip.decentralized.overlap`) asks its strategy for each message's request; :class:`PersistentRequests` makes a persistent one the first time a message with that
peer, tag and memory is asked for, and starts it again every later run (with Open MPI's ob1 a
non-persistent request to a dead peer may end the job: :mod:`mpigossip.resilience.failures`).
Its waits and tests turn a failed peer or a revoked communicator into
:class:`~mpigossip.resilience.failures.PeerFailure`; after one, :meth:`PersistentRequests.abandon`
keeps every request alive (never freed) and the next communicator starts afresh. What a schedule
salvages after a failure (the buffer as it was) is its owner's to say.
"""

from __future__ import annotations

from typing import Any

from . import failures


def address(array: Any) -> int:
    """Where ``array``'s first element lies (numpy, or an array with ``__cuda_array_interface__``)."""
    if hasattr(array, "__cuda_array_interface__"):
        return int(array.__cuda_array_interface__["data"][0])
    return int(array.__array_interface__["data"][0])


class PersistentRequests:
    """The persistent requests of one owner's schedules over its current communicator.

    ``owner``: its ``comm`` (the communicator a failure is met on) and ``timeout``. A message
    moves at most :attr:`limit` bytes (under the eager limit: :func:`~mpigossip.resilience.failures.
    chunk_bytes`), so that it completes without the receiver's progress.
    """

    persistent = True
    alarm: failures.Alarm | None = None   # (AlarmedRequests) the alarm every wait also tests

    def __init__(self, owner: Any) -> None:
        self.owner = owner
        self._made: dict[tuple, Any] = {}   # (kind, communicator, peer, tag, address, length) -> request

    @property
    def limit(self) -> int:
        """The most bytes one request may move."""
        return failures.chunk_bytes()

    def _request(self, kind: str, comm: Any, message: Any, peer: int, tag: int) -> Any:
        memory = message[0] if isinstance(message, (list, tuple)) else message   # an array, or [array, datatype]
        key = (kind, comm.py2f(), peer, tag, address(memory), memory.size)
        with failures.raised_as_failure(f"{self.owner._name} ({kind}, peer {peer})"):  # a revoked communicator
            request = self._made.get(key)                                             # fails these at once
            if request is None:
                make = comm.Send_init if kind == "send" else comm.Recv_init
                request = make(message, peer, tag)
                self._made[key] = request
            request.Start()
        return request

    def isend(self, comm: Any, message: Any, dest: int, tag: int) -> Any:
        """A started persistent send of ``message`` (an array, or ``[array, datatype]``) to ``dest``."""
        return self._request("send", comm, message, dest, tag)

    def irecv(self, comm: Any, message: Any, source: int, tag: int) -> Any:
        """A started persistent receive into ``message`` from ``source``."""
        return self._request("recv", comm, message, source, tag)

    def message(self, requests: list[Any]) -> failures.Message:
        """The (started) requests of one message, each one's outcome kept (a salvage after a
        failure adds only a message whose every request completed without error)."""
        return failures.Message(requests)

    def watch(self, op: str) -> None:
        """At a step boundary (see :class:`AlarmedRequests`)."""

    def test(self, requests: list[Any] | failures.Message, op: str) -> bool:
        """Whether every request has completed; raises PeerFailure if one completed in error."""
        message = requests if isinstance(requests, failures.Message) else failures.Message(requests)
        return message.test(f"{self.owner._name}.{op}")

    def wait(self, requests: list[Any] | failures.Message, op: str, peer: Any) -> None:
        """Complete ``requests`` under the owner's deadline; raises PeerFailure as :func:`failures.wait`."""
        failures.wait(requests, comm=self.owner.comm, timeout=self.owner.timeout, op=f"{self.owner._name}.{op}",
                      peer=peer, alarm=self.alarm)

    def abandon(self) -> None:
        """The communicator failed: keep its requests alive (never freed) and start afresh on
        the next one."""
        failures.keep(*self._made.values())
        self._made = {}

    def free(self) -> None:
        """Free the requests (no failure was met on this communicator)."""
        for request in self._made.values():
            request.Free()
        self._made = {}


class AlarmedRequests(PersistentRequests):
    """:class:`PersistentRequests` with an alarm (:class:`~mpigossip.resilience.failures.Alarm`,
    on a duplicate of the owner's communicator: collective to make): every :meth:`watch` and
    every wait raises PeerFailure once any rank failed or a survivor sounded the alarm. For a
    schedule whose ranks need not meet the dead rank's messages for steps (overlap mode), so
    that every survivor enters the recovery within a step; :meth:`quiesce` then lets them
    exchange what they had in flight to each other."""

    alarm: failures.Alarm

    def __init__(self, owner: Any) -> None:
        super().__init__(owner)
        self.alarm = failures.Alarm(owner.comm, owner._name)

    def watch(self, op: str) -> None:
        self.alarm.watch(f"{self.owner._name}.{op}")

    def quiesce(self, step: int, share: Any, receive: Any, op: str) -> None:
        """:meth:`Alarm.quiesce <mpigossip.resilience.failures.Alarm.quiesce>` under the owner's deadline."""
        self.alarm.quiesce(step, share, receive, timeout=self.owner.timeout, op=op)

    def abandon(self) -> None:
        super().abandon()
        self.alarm.keep()

    def free(self) -> None:
        super().free()
        self.alarm.free()
