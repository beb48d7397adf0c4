"""``train --on-failure replace``: the training job grows back to its size after a failure (#45).

On the survivors, right after they followed a failure (the algorithm recovered and the job's
communicator shrank; :meth:`~mpigossip.train.job.Run._survive`), :func:`grow_back` spawns one
process per dead rank running this same command line (:func:`mpigossip.resilience.grow.spawn`),
and the survivors train on. Such a process finds itself a newcomer, learns its place at once
(:func:`mpigossip.resilience.grow.arrive`, before torch's import) and runs :func:`newcomer_main`:
it takes the dead rank's number in the grown communicator, so the dead rank's data shard,
output files and place in the graph, and builds its run meanwhile. After every step the
survivors :func:`poll` (:class:`Joining`); once one has seen the newcomers ready, all grow back
at one step (:func:`_finish`): the algorithm drained and freed, the merge, every rank's
algorithm built again over the grown communicator, and :func:`heal_run`:

- the PushSum family (SGP, OSGP, AGP): every survivor's ``(x, w)`` is first multiplied by one
  power of two (:func:`~mpigossip.resilience.heal.rescale`: the weight a failure took with it no longer inflates the step
  on z), then a donor (the survivor with the largest weight) gives the newcomer half of each
  parameter group's ``(x, w)`` (:func:`mpigossip.resilience.heal.split`: Σx and Σw exact, the
  donor's model on both);
- the others (AllReduce, D-PSGD): the newcomer takes a survivor's model.

The donor also hands over (:func:`mpigossip.resilience.heal.handover`) what the newcomer needs
to go on as one of the others: the optimizer's state, the step, the learning-rate schedule's
place (the step), the run's clock and its record of failures. AGP, whose ranks never wait for
one another, heals beside training: the donor's sends go on while it trains
(:class:`~mpigossip.train.beside.Healing`). The newcomer draws its batches
from a stream of its own (the seed, its rank and the step it starts at). ``summary.json``
records the replacement under the failure (``"replaced"``: who, the donors, the spawn's and
the heal's seconds, the steps trained beside the newcomers' start and the pause, the rescale). A
spawn that cannot start, or newcomers not ready within the deadline, leave the run at the
smaller size (one warning); a failure while the newcomers start gives them up (:func:`give_up`:
they end, and the growth after the algorithm has followed the death replaces every rank lost); a
failure during the spawn, the merge or the heal ends every rank with :class:`ReplaceFailed`'s one
line (no traceback, no hang).
"""

import contextlib
import os
import signal
import time
import warnings

import numpy as np
from mpi4py import MPI

from ..core import deadline
from ..launch.slurm import SPARES
from ..resilience import failures, grow
from . import checkpoint
from .cli import algorithms_of
from .handover import OP, heal_run

#: Test hook: ``MPIGOSSIP_REPLACE_WITH="PROGRAM ARGS"`` spawns that instead of this command line
#: (a program that does not exist: the spawn is refused, the run goes on at the smaller size).
REPLACE_WITH = "MPIGOSSIP_REPLACE_WITH"
#: Test hook: ``MPIGOSSIP_KILL_BEFORE_GROW=R`` kills rank R of the launch (not a newcomer) as the
#: survivors begin to grow back (a second failure before the first is replaced).
KILL_BEFORE_GROW = "MPIGOSSIP_KILL_BEFORE_GROW"
#: Test hook: ``MPIGOSSIP_KILL_WHILE_JOINING=R`` kills rank R of the launch (a survivor) at its first
#: step after the spawn, while the newcomers start (a second failure before they joined).
KILL_WHILE_JOINING = "MPIGOSSIP_KILL_WHILE_JOINING"


def grow_back(run, step):
    """On the survivors, after the failure followed before ``step`` (the step each would take
    next): start the newcomers (collective over the survivors) and return the step to go on
    from. The survivors train on while the newcomers start (Python, torch, their data and
    model): :func:`poll` after every step finds them ready, and the survivors grow back then,
    all at one step (:func:`_finish`).

    The algorithm is drained first: where its drain is collective (AGP) a rank
    that died since the failure was followed is met there, by the survivors together, and
    followed (``run.lost`` then names it too; ranks that drift are in no other collective). One
    that dies before the survivors agree to grow (met by some of them in the agreement, by
    others not at all) puts the growth off: every survivor learns it from one
    ``MPI_Comm_agree``, trains on until the algorithm has met the death and followed it, and
    grows back then, all together."""
    t0 = time.perf_counter()
    if os.environ.get(KILL_BEFORE_GROW, "") == str(MPI.COMM_WORLD.Get_rank()) and not run.newcomer:
        os.kill(os.getpid(), signal.SIGKILL)
    run.algo.drain()
    steps = None
    try:
        steps = deadline.allgather(run.comm, int(step), timeout=run.timeout, op=OP)
    except MPI.Exception as exc:
        if exc.Get_error_class() not in failures.FAILED:
            raise
    if not failures.agree(run.comm, steps is not None, timeout=run.timeout, op=OP):
        run.grow_at = run.steps + 1   # until the algorithm has followed the new failure (Run._survive)
        return step
    assert steps is not None
    run.grow_pending = False
    if max(steps) >= run.steps:   # nothing left to train: no newcomer
        run.failures[-1]["replaced"] = {"ranks": [], "skipped": "the run ended"}
        return step
    argv = os.environ.get(REPLACE_WITH, "").split() or None   # (tests: a program that cannot start)
    with _named(run.out, run.lost, step):
        spawned = grow.spawn(run.comm, run.lost, argv=argv, timeout=run.timeout, info=_placement(run), op=OP)
        if spawned is None:   # refused: on at the smaller size (the survivors' heal: the rescale)
            step = max(steps)
            state = checkpoint.state_of(run, step)
            run.algo.free()
            rebuild(run, run.comm)
            heal_run(run, [], state, t0=t0, refused=True)
            return step
        run.joining = Joining(spawned, run.comm, t0, run.failures[-1])
    return step


class Joining:
    """Newcomers started (:func:`grow_back`), training on until they are ready (:func:`poll`).

    One small ``MPI_Iallreduce`` a step over the survivors (a duplicate of their communicator),
    started after one step and completed after the next, gives every survivor the same answer
    at the same round: 2, grow back now (a survivor saw the newcomers ready, or has no steps
    left); 1, the newcomers were not ready within the deadline; 0, train on."""

    def __init__(self, spawned, comm, t0, failure):
        self.spawned, self.t0, self.failure = spawned, t0, failure   # (failure: the record the growth replaces)
        self.t_spawned = time.perf_counter()
        self.comm = comm.Dup()
        self.comm.Set_errhandler(MPI.ERRORS_RETURN)
        self.flag = np.zeros(1, dtype=np.int32)
        self.request = None
        self.steps = 0   # steps this rank trained while the newcomers started

    def round(self, want, timeout):
        """Complete the round under way (None if none was) and start the next with ``want``."""
        agreed = None
        if self.request is not None:
            failures.wait([self.request], comm=self.comm, timeout=timeout, op=f"{OP} (the newcomers' start)",
                          peer="all survivors (Iallreduce)")
            agreed = int(self.flag[0])
        self.flag[0] = want
        self.request = self.comm.Iallreduce(MPI.IN_PLACE, self.flag, MPI.MAX)
        return agreed

    def close(self, timeout):
        if self.request is not None:   # (started by every survivor, like the one just completed)
            failures.wait([self.request], comm=self.comm, timeout=timeout, op=f"{OP} (the newcomers' start)")
        self.comm.Free()

    def abandon(self, why):
        """Give the newcomers up (they end, :func:`mpigossip.resilience.grow.join`), record it on
        the failure they were to replace; the communicator and requests are kept, not freed."""
        self.spawned.abandon()
        failures.keep(self.comm, self.request, self.spawned.inter)
        self.failure["abandoned"] = {"ranks": list(self.spawned.lost), "why": why, "steps_beside": self.steps,
                                     "beside_s": time.perf_counter() - self.t_spawned}


def poll(run, step, *, final=False):
    """On the survivors, after each step while newcomers start (``run.joining``), and with
    ``final`` once a survivor has no steps left (then until they have grown): grow back when
    every survivor has agreed to (:class:`Joining`). Returns the step to go on from."""
    joining = run.joining
    if os.environ.get(KILL_WHILE_JOINING, "") == str(MPI.COMM_WORLD.Get_rank()) and not run.newcomer:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        ready = final or joining.spawned.ready(OP)
        late = not ready and time.perf_counter() - joining.t_spawned > run.timeout
        agreed = joining.round(2 if ready else 1 if late else 0, run.timeout)
    except (failures.PeerFailure, MPI.Exception) as exc:
        if isinstance(exc, MPI.Exception) and exc.Get_error_class() not in failures.FAILED:
            raise
        # a survivor (or a newcomer) died while the newcomers started: give them up; the algorithm
        # meets the death and follows it (Run._survive), and the growth after it replaces every rank lost
        give_up(run, f"a rank failed while they started ({exc})")
        return step
    if agreed == 2:
        with _named(run.out, run.lost, step):
            try:
                return _finish(run, step)
            except (failures.PeerFailure, MPI.Exception):
                joining.spawned.abandon()   # (before the merge: the newcomers end at once, not at their deadline)
                raise
    if agreed == 1:   # as a spawn that cannot start: on at the smaller size, one warning
        give_up(run, f"not ready within {run.timeout:g} s (--timeout)", grow_again=False)
        if run.comm.Get_rank() == 0:
            warnings.warn(f"{OP}: the replacement(s) for rank(s) {joining.spawned.lost} were not ready within "
                          f"{run.timeout:g} s; going on with {run.comm.Get_size()} ranks", RuntimeWarning, stacklevel=2)
        return step
    joining.steps += 1
    return step


def _finish(run, step):
    """Collective over the survivors and the newcomers: the algorithm drained, merged, rebuilt
    over the grown communicator and healed, at the survivors' largest step (a method that lets
    ranks drift, OSGP or AGP, reaches this at different steps; the rebuilt algorithm starts with
    its step counters equal on every rank)."""
    joining = run.joining
    t_pause = time.perf_counter()
    beside_s = t_pause - joining.t_spawned
    state = checkpoint.state_of(run, step)   # (drains the algorithm first)
    t_drained = time.perf_counter()
    step = max(deadline.allgather(run.comm, int(step), timeout=run.timeout, op=OP))
    joining.close(run.timeout)
    state["step"] = step
    run.algo.free()
    t_merge = time.perf_counter()
    grown = joining.spawned.merge(timeout=run.timeout, op=OP)
    run.joining = None
    t_rebuild = time.perf_counter()
    rebuild(run, grown.comm)
    parts = {"drain_s": t_drained - t_pause, "agree_s": t_merge - t_drained, "merge_s": t_rebuild - t_merge,
             "rebuild_s": time.perf_counter() - t_rebuild}   # (the pause before the heal, this rank's)
    heal_run(run, grown.newcomers, state, spawn_s=joining.spawned.seconds, t0=joining.t0,
             beside={"at_step": step, "beside_s": beside_s, "steps_beside": joining.steps, "t_pause": t_pause,
                     "pause_parts": parts})
    return step


def give_up(run, why, *, grow_again=True):
    """On a survivor, while newcomers start (``run.joining``): give them up (a failure met, or
    they were too late). With ``grow_again`` the run grows back after the algorithm has followed
    the failure (``Run._survive``), replacing the ranks these newcomers were for with the new dead."""
    joining, run.joining = run.joining, None
    joining.abandon(why)
    run.grow_pending = grow_again
    run.grow_at = run.steps + 1   # (until Run._survive sets it, after the algorithm followed the failure)


class ReplaceFailed(RuntimeError):
    """A rank failed while the run grew back (the spawn, the rebuild or the heal): the newcomers
    hold no state yet and the survivors' was handed out in part, so the run cannot go on. It
    ends, every rank with this message; its last checkpoint resumes it."""


@contextlib.contextmanager
def _named(out, ranks, step=None):
    """A failure met inside the block raised as :class:`ReplaceFailed`, naming what was under way."""
    try:
        yield
    except (failures.PeerFailure, MPI.Exception) as exc:
        resume = f" (--resume {out})" if out else ""
        at = f" at step {step}" if step is not None else ""
        raise ReplaceFailed(f"{OP}: a rank failed while rank(s) {list(ranks)} were replaced{at} ({exc}); "
                            f"the run cannot go on: resume it from its last checkpoint{resume}") from exc


def _placement(run, spares=None):
    """Where the newcomers may go (``MPI_Comm_spawn``'s info): the allocation's spare nodes where
    no rank lives (``spares``, default: ``$MPIGOSSIP_SPARE_HOSTS``, set by ``python -m mpigossip
    launch --spares N``), all newcomers there; else the hosts where a survivor lives. Oversubscribed
    and unbound: ``mpirun`` inside a Slurm allocation counts a dead rank's slot as taken. (Only the
    hosts named, not their order, steer Open MPI's mapping: measured, a spare named first still lost
    to a survivor's host named after it.) Never a host where only dead ranks lived: across nodes,
    Open MPI 5.0.11's newcomer fails in ``MPI_Init`` there (``benchmarks/ulfm_respawn.py --spawn-on
    dead``). None where the hosts are not known."""
    if len(run.hosts) != run.size + len(run.lost):
        return None
    if spares is None:
        spares = [h for h in os.environ.get(SPARES, "").split(",") if h]
    hosts = sorted({run.hosts[r] for r in range(len(run.hosts)) if r not in run.lost})
    free = sorted(set(spares) - set(run.hosts))
    return {"host": ",".join(free or hosts), "map_by": ":OVERSUBSCRIBE", "bind_to": "none"}


def rebuild(run, comm):
    """The run over ``comm``: the algorithm built again (collective, on every rank; a newcomer's
    Run was built over its :class:`~mpigossip.resilience.grow.Arrival`, with no algorithm), with
    no broadcast of rank 0's model: the heal's load sets every rank's (the survivors' own, the
    newcomers' their donors')."""
    run.comm, run.rank, run.size = comm, comm.Get_rank(), comm.Get_size()
    run.algo = run.make_algorithm(broadcast=False)


def newcomer_main(args, run_class, out, arrival):
    """A process spawned by :func:`grow_back`, which has learnt its place (``arrival``:
    :func:`mpigossip.resilience.grow.arrive`, before torch's import): build its run (data,
    model, optimizer: the survivors train on meanwhile), join the grown communicator, heal,
    train to the end. Returns the run's summary and this rank."""
    timeout = deadline.check_timeout(args.timeout)
    algorithm = algorithms_of(args)[0]
    folder = out(algorithm, args.lr)
    with _named(folder, arrival.lost):
        run = run_class(args, arrival, algorithm, args.lr, folder, newcomer=True)
        comm, taken = grow.join(arrival, timeout=timeout, op=OP)
        rebuild(run, comm)
        heal_run(run, taken, None)
    return run.run(), run.rank
