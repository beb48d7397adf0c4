"""A training run's state across a growth (``train --on-failure replace``, #45): what
:mod:`.regrow` calls once the grown communicator is up.

- :func:`heal_run`: collective over the grown communicator: the newcomers' state from their
  donors (the PushSum family: the survivors' ``(x, w)`` rescaled by one power of two, half a
  donor's split to each newcomer; the optimizer state, step, clock and record of failures
  handed over), every rank's loaded into its rebuilt algorithm, the replacement recorded (AGP's
  beside training: :mod:`.beside`);
- :func:`weight_accounted`: the Σw a PushSum-family run's ``summary.json`` accounts for.
"""

import contextlib
import os
import random
import signal
import socket
import time

import numpy as np
import torch
from mpi4py import MPI

from ..core import deadline
from ..resilience import failures, grow, heal
from .beside import OP, Healing, close_record, digest
from .evaluate import Evaluator

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
        # (the hosts now: a heal beside training whose record a failure cuts short still knows where each rank runs)
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
        if streaming:
            sending.extend(sent)
        else:
            sent.wait(comm=comm, timeout=run.timeout)
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
        mine = digest(run.model) if new or comm.Get_rank() in plan.values() else None   # (before a step)
        if new:
            record["ready_s"] = time.perf_counter() - t_sync   # (from the ranks together to its start)
        run.healing = Healing(run, record_comm, failure, dict(record, **sync, beside_heal=True), mine, sending,
                              plan=plan, first=first, idle=_idle(t0, beside, new))
        run.healing.hold(bool(sending))
        failure["replaced"] = dict(record, beside_heal=True, pending=True)   # (until the gather completes)
        victim = os.environ.get(KILL_AFTER_HEAL, "") if len(run.failures) == 1 else ""   # (the first heal only)
        if victim and str(min(plan.values()) if victim == "donor" else victim) == str(comm.Get_rank()):
            os.kill(os.getpid(), signal.SIGKILL)
        return
    gathered = deadline.allgather(comm, (record, socket.gethostname(), digest(run.model)), timeout=run.timeout, op=OP)
    close_record(run, failure, gathered, plan, first, idle=_idle(t0, beside, new))


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
