"""What a recovery salvages from PushSum's overlap mode (OSGP) when a peer fails.

The schedule is :class:`mpigossip.decentralized.overlap.Overlap`, run with ``on_failure="continue"``
on :class:`~mpigossip.resilience.persistent.AlarmedRequests`. What is in flight when a peer fails
is lost with it: the shares this rank split off and sent to the dead rank (its ``(x, w)`` no
longer hold them) and those the dead rank sent it and it had not yet added; both are in the
weight the recovery reports lost (:meth:`mpigossip.PushSum._lost_mass`). What survivors had in
flight to each other is not: every survivor first adds what arrived whole (:func:`salvage`), then
they agree on how many messages each sent every other and exchange the rest (:func:`quiesce`)
on the communicator that failed, still open between live ranks, before it is revoked.
"""

from typing import Any

from ..core import deadline
from . import failures


def salvage(overlap: Any) -> None:
    """Add the messages that had arrived whole before the failure (the rest is lost)."""
    overlap.add([msg for msg in overlap.pending if msg.message.succeeded()])


def quiesce(overlap: Any, step: int, op: str) -> None:
    """After a failure, before the communicator is revoked (every survivor calls it): sound the
    alarm, agree with the other survivors on who they are and how many messages each sent every
    other over this communicator, then receive and add what survivors sent this rank and
    complete what it sent them. A further failure meanwhile loses what the newly dead had in
    flight too."""
    share = {"first": overlap.first_step, "sent": dict(overlap.sent)}
    overlap.requests.quiesce(step, share, lambda shared, gone: _from_survivors(overlap, shared, gone, op), op)


def _from_survivors(overlap, shared, gone, op):
    """Post the receives of what each survivor sent this rank and no receive awaits yet (it is
    ahead), then receive and add them all; complete this rank's sends to survivors."""
    o = overlap.owner
    me = o.rank
    # from the dead: lost; from a survivor, a receive for a share it never sent (it met the
    # failure first): dropped (its request stays posted on the communicator that failed)
    overlap.pending = [m for m in overlap.pending
                       if m.src not in gone and m.ordinal < shared[m.src]["sent"].get(me, 0)]
    for src, info in shared.items():
        if src == me:
            continue
        # src's j-th message here went at the j-th step from first_step at which this rank was its
        # out-peer; the receives posted so far are the first `posted` of them
        count, last = overlap.posted.get(src, 0), overlap.last_posted.get(src)
        step = info["first"] if last is None else last + 1
        while count < info["sent"].get(me, 0):
            if me in o.topology.mixing_weights(src, step)[1]:
                overlap.post(step, src)   # (its requests' failures raised as PeerFailure)
                count += 1
            step += 1
    sends = failures.Message([r for sent in overlap.sends for dst, reqs in sent.to.items() if dst not in gone
                              for r in reqs])

    def progress():
        overlap.add([m for m in overlap.pending if m.message.test(op)])
        return sends.test(op) and not overlap.pending

    deadline.wait_until(progress, comm=o.comm, timeout=o.timeout, op=f"{op} (the survivors' messages)",
                        peer=lambda: sorted({m.src for m in overlap.pending}))
    overlap.sends = []
