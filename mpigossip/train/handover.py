"""A training run's state across a growth (``train --on-failure replace``, #45): what
:mod:`.regrow` calls once the grown communicator is up.

- :func:`heal_run`: collective over the grown communicator: the newcomers' state from their
  donors (the PushSum family: the survivors' ``(x, w)`` rescaled by one power of two, half a
  donor's split to each newcomer; the optimizer state, step, clock and record of failures
  handed over), every rank's loaded into its rebuilt algorithm, the replacement recorded;
- :func:`weight_accounted`: the Σw a PushSum-family run's ``summary.json`` accounts for.
"""

import contextlib
import hashlib
import os
import pickle
import random
import signal
import socket
import time

import numpy as np
import torch
from mpi4py import MPI

from ..core import deadline
from ..resilience import failures, grow, heal
from .evaluate import Evaluator

OP = "train (--on-failure replace)"
#: Test hook: ``MPIGOSSIP_KILL_IN_HEAL=R`` kills rank R of the grown communicator in the heal (a
#: second failure during a replacement).
KILL_IN_HEAL = "MPIGOSSIP_KILL_IN_HEAL"
#: Test hook: ``MPIGOSSIP_KILL_AFTER_HEAL=donor`` kills the (first) donor of the run's first heal
#: beside training as it goes back to training, its sends started (``=R``: rank R of the grown communicator): a
#: failure while the newcomer heals.
KILL_AFTER_HEAL = "MPIGOSSIP_KILL_AFTER_HEAL"
#: Benchmark hook: ``MPIGOSSIP_HEAL_BESIDE=0`` makes an asynchronous method's heal wait for its
#: transfers as the others' does (``benchmarks/replace_times.py --heal-modes``: the two side by side).
HEAL_BESIDE = "MPIGOSSIP_HEAL_BESIDE"


def heal_run(run, newcomers, state, *, spawn_s=None, t0=None, refused=False, beside=None):
    """Collective over the grown communicator (every survivor with its ``state``, every newcomer
    with None): the newcomers' state from their donors; every rank's loaded into the rebuilt
    algorithm.

    An asynchronous method (AGP: no rank waits for another) heals beside training: a donor
    halves its ``(x, w)``, starts its sends and trains on (its copies travel while it steps:
    ``run.healing``, a :class:`Healing`, tested after each step), the other survivors go back to
    training once loaded, and a newcomer starts training once it has received and loaded its
    state. Any other method waits for the transfers (its next step would wait for the newcomer)."""
    t_heal = time.perf_counter()
    parts = {}   # the heal's parts, in seconds (split, handover, load)
    comm, new = run.comm, run.comm.Get_rank() in newcomers
    if newcomers and os.environ.get(KILL_IN_HEAL, "") == str(comm.Get_rank()):
        os.kill(os.getpid(), signal.SIGKILL)
    pushsum = getattr(run.algo, "base", run.algo)   # (an outer optimizer's base)
    mixing = hasattr(pushsum, "numerators") and bool(getattr(pushsum, "weights", None))   # the PushSum family
    streaming = (bool(newcomers) and mixing and pushsum is run.algo and getattr(run.algo, "max_delay", 0) is None
                 and os.environ.get(HEAL_BESIDE, "1") != "0")
    sending = heal.Sending(OP)
    sync = {}   # (streaming) when the ranks were last together: seconds since t0 and since the run's start
    if mixing:
        if new:
            xs = [np.zeros_like(np.asarray(x)) for x in pushsum.numerators]
            ws = [0.0] * len(xs)
        else:
            part = _mixing_part(state["algo"])
            xs = [t.numpy() for t in part["numerators"]]
            ws = [float(c["weight"]) for c in part["comms"]]
        gathered = deadline.allgather(comm, (None if new else ws, socket.gethostname()), timeout=run.timeout, op=OP)
        weights, run.hosts = [w for w, _ in gathered], [host for _, host in gathered]
        t_sync = time.perf_counter()
        if streaming:   # (collective: here, where every rank is, not after the transfers, where the newcomers come late)
            record_comm = comm.Dup()
            if t0 is not None:
                sync = {"sync_s": t_sync - t0, "sync_at_s": t_sync - run.t_start}
        plan = heal.donors(weights, newcomers) if newcomers else {}
        totals = [sum(w[g] for w in weights if w is not None) for g in range(len(xs))]
        scales = [heal.rescale(total, comm.Get_size()) for total in totals]
        if not new:
            for x, c in zip(xs, scales):
                x *= c   # (a power of two: exact)
            ws = [w * c for w, c in zip(ws, scales)]
        t_split = time.perf_counter()
        with _donor_lost(streaming and new):
            ws, sent = heal.isplit(xs, ws, comm=comm, newcomers=newcomers, timeout=run.timeout, op=OP)
        if not streaming:
            sent.wait(comm=comm, timeout=run.timeout)
        sending.extend(sent)
        parts["split_s"] = time.perf_counter() - t_split
    else:
        plan = heal.donors([None if r in newcomers else 1.0 for r in range(comm.Get_size())],
                           newcomers) if newcomers else {}
    given = None
    if not new and mixing:   # (the numerators went by split; the parameters are x / w, rebuilt from them by the load)
        given = dict(state, algo=_without_numerators(state["algo"]),
                     model=_without_parameters(state["model"], run.model))
    elif not new:
        given = state
    t_hand = time.perf_counter()
    if streaming:   # (the donor's copies: it trains on, changing its optimizer's state)
        with _donor_lost(new):
            received, sent = heal.ihandover(given, comm=comm, plan=plan, timeout=run.timeout, op=OP)
        sending.extend(sent)
    else:
        received = heal.handover(given, comm=comm, plan=plan, timeout=run.timeout, op=OP)
    parts["handover_s"] = time.perf_counter() - t_hand
    t_load = time.perf_counter()
    if new:
        state = received
        if mixing:   # its own parameters stand in: the algorithm's load writes x / w over them
            state["model"] = {**run.model.state_dict(), **state["model"]}
    if mixing:
        part = _mixing_part(state["algo"])
        if new:
            part["numerators"] = [torch.from_numpy(x) for x in xs]
        for c, w, total, scale in zip(part["comms"], ws, totals, scales):
            c["weight"] = w
            if "total_weight" in c:   # Σw, against which the next failure's loss is reckoned
                c["total_weight"] = total * scale
    _align(state["algo"], int(state["step"]))
    run.model.load_state_dict(state["model"])   # (the rebuilt algorithm broadcast rank 0's)
    run.algo.load_state_dict(state["algo"])
    if new:
        _adopt(run, state)
    parts["load_s"] = time.perf_counter() - t_load
    beside = dict(beside or {})
    t_pause = beside.pop("t_pause", None)
    record = {"ranks": list(newcomers), "donors": {str(k): v for k, v in plan.items()}, "spawn_s": spawn_s,
              **({"weight_before": totals, "scaled_by": scales} if mixing else {}),
              **beside, "pause_s": time.perf_counter() - t_pause if t_pause is not None else None,
              "heal_s": time.perf_counter() - t_heal, "heal_parts": parts,
              "total_s": time.perf_counter() - t0 if t0 is not None else None,
              "back_at_s": time.perf_counter() - run.t_start if t0 is not None else None, "refused": refused}
    run.evaluate = Evaluator(run.eval_model, run.x_test, run.y_test, comm=comm, timeout=run.timeout)
    run.algo.after_failure = run._follow_algorithm
    run.failures_seen = 0
    first = min(r for r in range(comm.Get_size()) if r not in newcomers)
    failure = run.failures[-1]
    if streaming:   # each rank's part of the record gathered beside training; the transfers' checks then
        digest = _digest(run.model) if new or comm.Get_rank() in plan.values() else None   # (before a step)
        if new:
            record["ready_s"] = time.perf_counter() - t_sync   # (from the ranks together to its start)
        run.healing = Healing(run, record_comm, failure, dict(record, **sync, beside_heal=True), digest, sending,
                              plan=plan, first=first, idle=_idle(t0, beside, new))
        run.healing.hold(bool(sending))
        failure["replaced"] = dict(record, beside_heal=True, pending=True)   # (until the gather completes)
        victim = os.environ.get(KILL_AFTER_HEAL, "") if len(run.failures) == 1 else ""   # (the first heal only)
        if victim and str(min(plan.values()) if victim == "donor" else victim) == str(comm.Get_rank()):
            os.kill(os.getpid(), signal.SIGKILL)
        return
    gathered = deadline.allgather(comm, (record, socket.gethostname(), _digest(run.model)), timeout=run.timeout, op=OP)
    _close(run, failure, gathered, plan, first, idle=_idle(t0, beside, new))


@contextlib.contextmanager
def _donor_lost(newcomer):
    """On a newcomer healing beside training, whose survivors train on meanwhile: its donor's
    failure (or any failure that revoked the communicator) met while it receives ends it as a
    newcomer given up (:class:`~mpigossip.resilience.grow.Abandoned`: one note, exit 0); the
    survivors follow the deaths and replace both."""
    try:
        yield
    except (failures.PeerFailure, MPI.Exception) as exc:
        if not newcomer or (isinstance(exc, MPI.Exception) and exc.Get_error_class() not in failures.FAILED):
            raise
        raise grow.Abandoned(f"{OP}: a failure while the donor handed this newcomer its state ({exc}); the "
                             f"survivors train on and replace it") from exc


def _idle(t0, beside, new):
    """A survivor's seconds not training from the growth's start (``t0``) to now, its return to
    training: the whole time less that trained beside the newcomers' start. None on a newcomer."""
    if new or t0 is None:
        return None
    return time.perf_counter() - t0 - beside.get("beside_s", 0.0)


def _close(run, failure, gathered, plan, first, *, idle=None):
    """The replacement's record from every rank's ``(record, host, digest)``: the first
    survivor's (a newcomer, and rank 0 too when rank 0 died, timed nothing), where each newcomer
    runs, whether each newcomer's parameters are its donor's bit for bit (z unchanged by the split
    and the handover), the slowest rank's parts, and this survivor's ``idle`` (:func:`_idle`:
    ``summary.json``'s is rank 0's); printed by the first survivor."""
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
    record is closed as the waiting heal's is (:func:`_close`).

    A failure met meanwhile (by the sends, the gather, or the algorithm: ``Run._survive``
    calls :meth:`abandon`) leaves the record as this rank had it; the algorithm follows the
    failure as any other (a newcomer that died before its half arrived: the half is lost with
    it, counted in the failure's ``weight_lost`` like a message in flight)."""

    ROW = 4096   # bytes of one rank's pickled part of the record

    def __init__(self, run, comm, failure, record, digest, sending, *, plan, first, idle=None):
        self.run, self.failure, self.record, self.digest = run, failure, record, digest
        self.sending, self.plan, self.first, self.idle = sending, plan, first, idle
        self.comm = comm   # (a duplicate of the grown communicator, this object's)
        self.comm.Set_errhandler(MPI.ERRORS_RETURN)
        self.request, self.rows, self.done = None, None, False
        self.t_sent, self.steps = time.perf_counter(), 0
        if not sending:
            self._gather()

    def _gather(self):
        row = pickle.dumps((self.record, socket.gethostname(), self.digest), protocol=pickle.HIGHEST_PROTOCOL)
        if len(row) > self.ROW:
            raise RuntimeError(f"{OP}: a rank's part of the record takes {len(row)} bytes, more than {self.ROW}")
        mine = np.zeros(self.ROW, dtype=np.uint8)
        mine[:len(row)] = np.frombuffer(row, dtype=np.uint8)
        self.rows = np.empty(self.ROW * self.comm.Get_size(), dtype=np.uint8)
        self.request = self.comm.Iallgather([mine, MPI.BYTE], [self.rows, MPI.BYTE])
        self._mine = mine

    def hold(self, on):
        """A donor keeps its shares (its algorithm's ``holding``) while its sends go: it trains on,
        receives and steps, but its link carries the newcomers' state, not shares as well (a
        97 MB AGP share a step kept the link busy: the state took 24 steps, 9 s, to go)."""
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
        _close(self.run, self.failure, rows, self.plan, self.first, idle=self.idle)
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


def weight_accounted(summary, group=0):
    """The Σw a PushSum-family run under ``--on-failure continue|replace`` must end with, from its
    ``summary.json`` alone: the initial size, less each failure's ``weight_lost``, times each
    heal's ``scaled_by``. Raises ValueError where a heal's ``weight_before`` is not what the
    record before it leaves (mass created or lost unrecorded)."""
    total = float(summary["initial_world_size"])
    for f in summary.get("failures", []):
        total = (total - f["weight_lost"]) * f.get("scaled_by", 1.0)   # (the survivors' rescale)
        healed = f.get("replaced") or {}
        if "scaled_by" in healed:
            before = healed["weight_before"][group]
            if abs(before - total) > 1e-9 * max(1.0, total):
                raise ValueError(f"the heal of rank(s) {healed.get('ranks')} found Σw = {before!r}, the record "
                                 f"before it leaves {total!r}")
            total *= healed["scaled_by"][group]
    return total


def _mixing_part(algo_state):
    """The part of an algorithm's state that holds the PushSum numerators and weights (an outer
    optimizer's: its base's)."""
    return algo_state["base"] if "base" in algo_state else algo_state


def _without_numerators(algo_state):
    if "base" in algo_state:
        return dict(algo_state, base=dict(algo_state["base"], numerators=None))
    return dict(algo_state, numerators=None)


def _digest(model):
    """A hash of a model's parameters' bytes."""
    h = hashlib.blake2b(digest_size=16)
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()


def _without_parameters(model_state, model):
    """A model's state without its parameters (the buffers stay): for the PushSum family, whose
    parameters every rank's ``load_state_dict`` sets to its de-biased ``x / w``."""
    named = {name for name, _ in model.named_parameters()}
    return {k: v for k, v in model_state.items() if k not in named}


def _align(algo_state, step):
    """The step counters of an algorithm's state set to ``step``, the same on every rank (the
    messages of a step pair up by its number)."""
    parts = [algo_state, *([algo_state["base"]] if "base" in algo_state else [])]
    for part in [*parts, *(c for p in parts for c in p.get("comms", []))]:
        if "steps" in part:
            part["steps"] = step


def _adopt(run, state):
    """A newcomer takes on its donor's place in the run: optimizer, step, clock, failures."""
    run.optimizer.load_state_dict(state["optimizer"])
    run.start_step = int(state["step"])
    run.times = dict(state["times"])
    run.before = dict(state["clock"])
    run.failures = [dict(f) for f in state["failures"]]
    run.initial_size = int(state["initial_world_size"])
    run.rng = np.random.default_rng([run.args.seed, run.rank, run.start_step])
    run.slow_rng = random.Random(f"delay:{run.args.seed}:{run.rank}:{run.start_step}")
