"""The end of a heal (``train --on-failure replace``, #45): the replacement's record closed from
every rank's part, and the heal beside training of an asynchronous method.

- :func:`close_record`: the record (the first survivor's, the newcomers' hosts, whether each
  newcomer's parameters are its donor's, the slowest rank's parts) put in the failure it
  replaces, and the one line printed;
- :class:`Healing`: AGP's heal beside training (:func:`mpigossip.train.handover.heal_run`): the
  donor's sends under way while it trains, then the record gathered without a blocking
  collective;
- :func:`digest`: a hash of a model's parameters (a newcomer's against its donor's).
"""

import hashlib
import pickle
import socket
import time

import numpy as np
from mpi4py import MPI

from ..core import deadline
from ..resilience import failures

OP = "train (--on-failure replace)"


def close_record(run, failure, gathered, plan, first, *, idle=None):
    """The replacement's record from every rank's ``(record, host, digest)``: the first
    survivor's (a newcomer, and rank 0 too when rank 0 died, timed nothing), where each newcomer
    runs, whether each newcomer's parameters are its donor's bit for bit (z unchanged by the split
    and the handover), the slowest rank's parts, and this survivor's ``idle`` (its seconds not
    training: ``summary.json``'s is rank 0's); printed by the first survivor."""
    size = len(gathered)
    newcomers = [r for r in range(size) if r in plan]
    run.hosts = [host for _, host, _ in gathered]
    as_donor = all(gathered[n][2] == gathered[d][2] for n, d in plan.items())
    keys = sorted({k for g in gathered for k in g[0]["heal_parts"]})
    record = dict(gathered[first][0], as_donor=as_donor, hosts={str(r): run.hosts[r] for r in newcomers},
                  heal_parts={k: max(g[0]["heal_parts"].get(k, 0.0) for g in gathered) for k in keys})
    ready = [gathered[n][0].get("ready_s") for n in newcomers if gathered[n][0].get("ready_s") is not None]
    if ready and "sync_s" in record:   # (beside training) the job at full size once the last newcomer loaded
        record["total_s"] = record["sync_s"] + max(ready)
        record["back_at_s"] = record["sync_at_s"] + max(ready)
        record["ready_s"] = max(ready)
    record.pop("pending", None)
    if idle is not None:
        record["idle_s"] = idle
    failure["replaced"] = record
    if run.comm.Get_rank() == first and newcomers:
        streamed = (f"; the donor trained {record['heal_parts'].get('stream_steps', 0):.0f} steps while it sent "
                    f"for {record['heal_parts'].get('stream_s', 0.0):.2f} s" if record.get("beside_heal") else "")
        print(f"\n{run.algorithm}: rank{'s' if len(newcomers) > 1 else ''} {', '.join(map(str, newcomers))} "
              f"replaced: back at {size} ranks in {record['total_s']:.2f} s (spawn {record['spawn_s']:.2f} s, "
              f"{record.get('steps_beside', 0)} steps beside the newcomer's start, then a pause of "
              f"{record['pause_s'] or 0:.2f} s: heal {record['heal_s']:.2f} s{streamed})", flush=True)


class Healing:
    """A heal beside training (:func:`heal_run`, an asynchronous method), on every rank of the
    grown communicator until :meth:`test` says it is done: the donor's sends
    (:class:`~mpigossip.resilience.heal.Sending`; past half the run's deadline the donor waits for
    what is left, so that its newcomer's receive ends within it), then one ``MPI_Iallgather`` over ``comm`` (a
    duplicate of the grown communicator, made before the transfers) of every rank's part of the record, started by a donor once
    its sends have completed, by a newcomer once loaded, by the others at once; then the
    record is closed as the waiting heal's is (:func:`close_record`).

    A failure met meanwhile (by the sends, the gather, or the algorithm: ``Run._survive``
    calls :meth:`abandon`) leaves the record as this rank had it; the algorithm follows the
    failure as any other (a newcomer that died before its half arrived: the half is lost with
    it, counted in the failure's ``weight_lost`` like a message in flight)."""

    ROW = 4096   # bytes of one rank's pickled part of the record

    def __init__(self, run, comm, failure, record, mine, sending, *, plan, first, idle=None):
        self.run, self.failure, self.record, self.mine = run, failure, record, mine   # (mine: its model's digest)
        self.sending, self.plan, self.first, self.idle = sending, plan, first, idle
        self.comm = comm   # (a duplicate of the grown communicator, this object's)
        self.comm.Set_errhandler(MPI.ERRORS_RETURN)
        self.request, self.rows, self.done = None, None, False
        self.t_sent, self.steps = time.perf_counter(), 0
        if not sending:
            self._gather()

    def _gather(self):
        row = pickle.dumps((self.record, socket.gethostname(), self.mine), protocol=pickle.HIGHEST_PROTOCOL)
        if len(row) > self.ROW:
            raise RuntimeError(f"{OP}: a rank's part of the record takes {len(row)} bytes, more than {self.ROW}")
        mine = np.zeros(self.ROW, dtype=np.uint8)
        mine[:len(row)] = np.frombuffer(row, dtype=np.uint8)
        self.rows = np.empty(self.ROW * self.comm.Get_size(), dtype=np.uint8)
        self.request = self.comm.Iallgather([mine, MPI.BYTE], [self.rows, MPI.BYTE])
        self._mine = mine

    def hold(self, on):
        """A donor keeps its shares (its algorithm's ``holding``) while its sends go: it trains on,
        receives and steps, but its link carries the newcomers' state, not shares as well (AGP
        sends a model-sized share whenever the link is free: docs/RESULTS.md)."""
        for ps in getattr(self.run.algo, "comms", []):
            if hasattr(ps, "holding"):
                ps.holding = on

    def test(self):
        """After a training step: whether the heal is done (or given up); never blocks."""
        if self.request is None:
            self.steps += 1
        return self.progress()

    def progress(self):
        """Drive the donor's sends (one ``MPI_Test``: over TCP a rank's sends move only inside
        MPI, a socket's buffer at a time) and the gather; whether the heal is done (or given up).
        Never blocks: called within a training step too, between its parts."""
        if self.done:
            return True
        try:
            if self.request is None:
                if not self.sending.test():
                    if time.perf_counter() - self.t_sent < self.run.timeout / 2:
                        return False
                    # the newcomer waits within the deadline: past half of it the donor stops training to finish
                    self.record["stream_waited"] = True
                    self.sending.wait(comm=self.run.comm, timeout=self.run.timeout)
                self.record["heal_parts"] = dict(self.record["heal_parts"], stream_s=time.perf_counter() - self.t_sent,
                                                 stream_steps=float(self.steps))
                self.hold(False)
                self._gather()
            if not failures.test([self.request], f"{OP} (the record)"):
                return False
        except (failures.PeerFailure, MPI.Exception) as exc:
            if isinstance(exc, MPI.Exception) and exc.Get_error_class() not in failures.FAILED:
                raise
            self.abandon(f"a rank failed while the newcomers healed ({exc})")
            return True
        rows = [pickle.loads(self.rows[r * self.ROW:(r + 1) * self.ROW].tobytes()) for r in range(self.comm.Get_size())]
        self.comm.Free()
        self.done = True
        close_record(self.run, self.failure, rows, self.plan, self.first, idle=self.idle)
        return True

    def wait(self, timeout):
        """Until :meth:`progress` says done (the end of the run)."""
        deadline.wait_until(self.progress, comm=self.run.comm, timeout=timeout, op=f"{OP} (the heal beside training)")

    def abandon(self, why):
        """A failure met: keep the MPI objects (freeing those of a failed communicator may end
        the job), the record as this rank has it."""
        self.done = True
        self.hold(False)
        if self.sending:
            self.sending.keep()
        failures.keep(self.comm, self.request)
        self.failure["replaced"] = dict(self.record, incomplete=why, **({"idle_s": self.idle} if self.idle else {}))


def digest(model):
    """A hash of a model's parameters' bytes."""
    h = hashlib.blake2b(digest_size=16)
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()
