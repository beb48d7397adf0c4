"""failures.Message: a message's parts are combined only if each completed without error.

In process, with stand-in requests behaving as MPI's do after a failure: a request that
completed in error is inactive (persistent) or null afterwards, and a later ``MPI_Test`` of it
reports it complete. The salvage after a failure used to test again and took such a request
for arrived: an ``x`` added without its ``w`` (OSGP) or a slot MPI never wrote (AGP).
"""

import pytest
from mpi4py import MPI

from mpigossip import failures


class Request:
    """A stand-in request: ``outcomes`` are what successive ``Test`` calls do: True/False
    (complete or not) or an error class to raise; then complete (inactive) for ever."""

    def __init__(self, *outcomes):
        self.outcomes = list(outcomes)
        self.tests = 0

    def Test(self):
        self.tests += 1
        outcome = self.outcomes.pop(0) if self.outcomes else True
        if isinstance(outcome, bool):
            return outcome
        raise MPI.Exception(outcome)


def test_a_part_that_completed_in_error_is_never_taken_for_arrived():
    x = Request(True)                       # the share arrived
    w = Request(False, MPI.ERR_PROC_FAILED)  # its weight did not: the peer died
    message = failures.Message([x, w])
    assert message.test("step") is False
    with pytest.raises(failures.PeerFailure):
        message.test("step")
    assert message.failed
    assert not message.arrived()            # inactive now, it would test as complete
    assert not message.arrived()
    with pytest.raises(failures.PeerFailure):   # and the outcome is kept for later tests
        message.test("drain")


def test_revoked_before_completion_is_lost_and_completed_parts_are_not_tested_again():
    x = Request(True)
    w = Request(MPI.ERR_REVOKED)
    message = failures.Message([x, w])
    with pytest.raises(failures.PeerFailure) as info:
        message.test("step")
    assert info.value.error_class == MPI.ERR_REVOKED
    assert x.tests == 1 and not message.arrived() and x.tests == 1


def test_a_message_whose_parts_completed_arrived():
    message = failures.Message([Request(False, True), Request(True)])
    assert not message.test("step") and message.pending() == [0]
    assert message.arrived() and not message.failed and message.pending() == []


def test_salvage_after_a_failure_tested_elsewhere():
    """The failure is met on another message; this one's parts completed whole before: it is
    salvaged (arrived), and one still pending is not."""
    whole = failures.Message([Request(True), Request(True)])
    assert whole.test("step")
    pending = failures.Message([Request(True), Request(False, False)])
    assert not pending.test("step")
    assert whole.arrived() and not pending.arrived()


def test_other_errors_propagate():
    message = failures.Message([Request(MPI.ERR_TRUNCATE)])
    with pytest.raises(MPI.Exception):
        message.test("step")


def test_a_checkpoint_barrier_that_cannot_start_is_a_failure_not_an_error():
    """A second checkpoint before the algorithm meets a failure (AGP meets a kill some steps
    late; an outer method every H steps): the barrier's MPI_Ibarrier itself fails on a
    communicator with a failed peer. The checkpoint is then incomplete (not committed), as
    when the failure is met in the barrier's wait, instead of a raw MPI.Exception."""
    pytest.importorskip("torch")
    from mpigossip.train import checkpoint

    class Comm:
        def Ibarrier(self):
            raise MPI.Exception(MPI.ERR_PROC_FAILED)

    assert checkpoint._barrier(Comm(), 5.0, True) is False
