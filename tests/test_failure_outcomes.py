"""failures.Message: a message's parts are combined only if each completed without error.

In process, with stand-in requests behaving as MPI's do after a failure: a request that
completed in error is inactive (persistent) or null afterwards, and a later ``MPI_Test`` of it
reports it complete. The salvage after a failure used to test again and took such a request
for arrived: an ``x`` added without its ``w`` (OSGP) or a slot MPI never wrote (AGP).
"""

import pytest
from mpi4py import MPI

from mpigossip.resilience import failures


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
    assert not message.succeeded()            # inactive now, it would test as complete
    assert not message.succeeded()
    with pytest.raises(failures.PeerFailure):   # and the outcome is kept for later tests
        message.test("drain")


def test_revoked_before_completion_is_lost_and_completed_parts_are_not_tested_again():
    x = Request(True)
    w = Request(MPI.ERR_REVOKED)
    message = failures.Message([x, w])
    with pytest.raises(failures.PeerFailure) as info:
        message.test("step")
    assert info.value.error_class == MPI.ERR_REVOKED
    assert x.tests == 1 and not message.succeeded() and x.tests == 1


def test_a_message_whose_parts_completed_arrived():
    message = failures.Message([Request(False, True), Request(True)])
    assert not message.test("step") and message.pending() == [0]
    assert message.succeeded() and not message.failed and message.pending() == []


def test_salvage_after_a_failure_tested_elsewhere():
    """The failure is met on another message; this one's parts completed whole before: it is
    salvaged (arrived), and one still pending is not."""
    whole = failures.Message([Request(True), Request(True)])
    assert whole.test("step")
    pending = failures.Message([Request(True), Request(False, False)])
    assert not pending.test("step")
    assert whole.succeeded() and not pending.succeeded()


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


def test_pieces_under_the_eager_limit_cover_the_buffer_in_order():
    """A fault-tolerant path sends a buffer in pieces under Open MPI's TCP eager limit (a
    rendezvous with a survivor that had revoked hung recoveries across nodes): the pieces tile
    the buffer, in order, each at most the limit; a buffer under it stays one piece."""
    import numpy as np
    memory = np.arange(1000, dtype=np.float64)
    parts = failures.pieces([memory, MPI.DOUBLE], limit=808)   # 101 elements a piece
    assert [len(p[0]) for p in parts] == [101] * 9 + [91]
    assert all(p[1] is MPI.DOUBLE for p in parts)
    assert np.array_equal(np.concatenate([p[0] for p in parts]), memory)
    parts[3][0][0] = -1.0   # views, not copies: MPI writes the buffer itself
    assert memory[303] == -1.0
    assert failures.pieces([memory, MPI.DOUBLE], limit=8000) == [[memory, MPI.DOUBLE]]
    assert len(failures.pieces([memory[:1], MPI.DOUBLE], limit=1)) == 1   # never empty, never zero-sized


def test_the_piece_size_follows_the_eager_limit():
    assert failures.chunk_bytes({}) == 64 * 1024 - 4096                     # Open MPI's default limit
    assert failures.chunk_bytes({"OMPI_MCA_btl_tcp_eager_limit": str(4 << 20)}) == (4 << 20) - 4096
    assert failures.chunk_bytes({"OMPI_MCA_btl_tcp_eager_limit": "1000"}) == 4096
    assert failures.chunk_bytes({failures.CHUNK_ENV: "100000", "OMPI_MCA_btl_tcp_eager_limit": "8"}) == 100000
    with pytest.raises(ValueError, match="MPIGOSSIP_CHUNK_BYTES"):
        failures.chunk_bytes({failures.CHUNK_ENV: "4"})


def test_pieces_start_in_order():
    """The pieces of a message share a tag: MPI matches them in the order they start, which
    MPI_Startall leaves unspecified, so they start one by one (Message.start too)."""
    order = []

    class Persistent:
        def __init__(self, i):
            self.i = i

        def Start(self):
            order.append(self.i)

    failures.start([Persistent(i) for i in range(5)])
    failures.Message([Persistent(i) for i in range(5, 8)]).start()
    assert order == list(range(8))
