"""The time model: how long each method's training steps take on a cluster, event by event.

Each rank is a process on a simulated :class:`~.cluster.Cluster`: per step it computes (a
sleep of the workload's ``compute`` seconds, a straggler's times its factor), spends its
step's CPU, then takes its method's step (:mod:`.methods`) with the messages, waits and
locks that method has, over the links and cores it shares with the others. Who waits for
whom comes out of the events.

The measured costs (:class:`Costs`) come from a calibration benchmark
(``benchmarks/calibrate_time.py``); nothing here is fitted to the rows it predicts.
"""

import dataclasses
import json
import math

from .cluster import Cluster
from .methods import METHODS, Steps

__all__ = ["Costs", "Workload", "METHODS", "simulate"]


@dataclasses.dataclass
class Costs:
    """Measured costs of the network, the cores and this package.

    Attributes:
        link_rate: payload bytes/s of a node's link, each way.
        latency: seconds before a message between nodes flows.
        rma_rate: the fraction of the link a one-sided read or write moves at.
        rma_lock: seconds to take or release a lock on a window on another node.
        shm_rate: bytes/s between two ranks of one node.
        pass_rate: bytes/s of one pass of a kernel over a buffer (read and write) on one core.
        message_cpu: CPU seconds each side spends per message.
        wire_cpu: CPU seconds per byte between nodes on each side (the network stack).
        step_cpu: CPU seconds per step outside the method per MB of model (forward, backward,
            optimizer and the wrappers' copies), and ``step_cpu0`` the fixed part.
        method_cpu: ``{method: [a, b]}``: CPU seconds of a whole step of that method (forward,
            backward, optimizer and the method's own work: copies, passes, Python, MPI calls)
            at ``a + b * MB``, measured on one node; where given it replaces ``step_cpu`` and
            the method's kernel passes.
        cores: cores per pool; cores_shared: one pool for the whole machine.
        gets_shared: a rank's one-sided gets between nodes, those it serves and its own,
            share one link's rate (Open MPI 5's TCP transport, measured: a ring of gets, or two
            gets both ways, take twice one get's time; ``benchmarks/bench_directions.py``).
            False: each get at its links' rate (RDMA NICs, the predictions at scale).
    """

    link_rate: float = 120e6
    latency: float = 1e-4
    rma_rate: float = 0.5
    rma_lock: float = 2e-4
    shm_rate: float = 5e9
    pass_rate: float = 4e9
    message_cpu: float = 2e-5
    wire_cpu: float = 0.0
    step_cpu: float = 1e-3
    step_cpu0: float = 1e-3
    method_cpu: dict = dataclasses.field(default_factory=dict)
    cores: int = 2
    cores_shared: bool = False
    gets_shared: bool = False

    @classmethod
    def load(cls, path):
        """The costs written by the calibration benchmark (its JSON's ``costs``)."""
        with open(path) as f:
            data = json.load(f)
        return cls(**data.get("costs", data))


@dataclasses.dataclass
class Workload:
    """What every rank does per step besides its method.

    Attributes:
        mb: model size in MB (2**20 bytes).
        compute: seconds of compute per step that use no core (a sleep, a GPU).
        straggler: ``{rank: factor}``: these ranks' compute takes factor times as long.
        steps: steps timed per rank (after ``warmup`` untimed ones).
    """

    mb: float
    compute: float = 0.2
    straggler: dict = dataclasses.field(default_factory=dict)
    steps: int = 30
    warmup: int = 2

    @property
    def nbytes(self):
        return self.mb * 2 ** 20


def _run(method, nodes, ranks_per_node, work, costs, seed):
    """One simulation: the cluster and the method's ranks, run to the end."""
    cl = Cluster(nodes, ranks_per_node, link_rate=costs.link_rate, latency=costs.latency, cores=costs.cores,
                 cores_shared=costs.cores_shared, shm_rate=costs.shm_rate, message_cpu=costs.message_cpu,
                 wire_cpu=costs.wire_cpu, gets_shared=costs.gets_shared)
    run = Steps(method, cl, costs, work, seed)
    for r in range(cl.size):
        cl.engine.process(run.rank(r))
    cl.engine.run()
    unfinished = [r for r, t in enumerate(run.times) if len(t) < work.warmup + work.steps]
    if unfinished:
        raise RuntimeError(f"{method}: ranks {unfinished} never finished (a deadlock in the model)")
    return cl, run


def _by_rank(cl):
    """The cluster's deliveries by the rank whose operation each was: ``{rank: [(time, bytes,
    between nodes)]}``."""
    per_rank = {}
    for t, rank, nbytes, between in cl.deliveries:
        per_rank.setdefault(rank, []).append((t, nbytes, between))
    return per_rank


def _measure(per_rank, run, first, last, charges=()):
    """Each rank over its own steps ``first..last`` (indices, inclusive): the sum over ranks
    of its steps per second, each rank's mean step, and the models each rank's operations
    delivered per step in that window (``per_rank``: :func:`_by_rank`), in all and between
    nodes; ``cpu_s``: each rank's CPU charged per step (its work and the network stack's on
    both sides of its messages, ``charges``: the cluster's) and ``parts``: each rank's parts
    of a step (:attr:`~.methods.Steps.parts`), per step, in that window."""
    rates, steps, moved, between_nodes, between_rate = [], [], 0.0, 0.0, 0.0
    cpu, parts = [0.0] * len(run.times), []
    count = last - first + 1
    for r, t in enumerate(run.times):
        start = t[first - 1] if first > 0 else 0.0
        span = t[last] - start
        rates.append(count / span if span > 0 else math.inf)
        steps.append(span / count)
        mine = 0.0
        for when, nbytes, between in per_rank.get(r, ()):
            if start < when <= t[last]:
                moved += nbytes
                mine += nbytes if between else 0.0
        between_nodes += mine
        between_rate += mine / span if span > 0 else 0.0
        totals = {}
        for k in range(first, last + 1):
            for name, value in run.parts[r].get(k, {}).items():
                totals[name] = totals.get(name, 0.0) + value
        parts.append({name: value / count for name, value in sorted(totals.items())})
    for when, rank, seconds in charges:
        t = run.times[rank]
        if (t[first - 1] if first > 0 else 0.0) <= when < t[last]:
            cpu[rank] += seconds / count
    per_step = run.M * count * len(run.times) if run.M else math.inf
    out = {"steps_per_s": sum(rates), "step_s": steps, "models_moved_per_step": moved / per_step,
           "internode_models_per_step": between_nodes / per_step, "internode_bytes_per_s": between_rate,
           "cpu_s": cpu, "parts": parts}
    if run.name == "agp":   # how many of its own steps after a share left its receiver combined it
        out["message_delays"] = sorted(k - sent for _, k, sent in run.combined if first <= k <= last)
    return out


def _close(a, b, tolerance, floor=0.0):
    return abs(a - b) <= tolerance * max(abs(a), abs(b)) + floor


def simulate(method, nodes, ranks_per_node, work, costs, *, seed=0, until_steady=False, tolerance=0.05,
             max_steps=4096):
    """Simulate ``method`` on ``nodes`` x ``ranks_per_node`` ranks.

    Returns a dict: ``steps_per_s`` (the sum over ranks of each rank's own steps per second,
    as the P4 benchmark counts), ``step_s`` (each rank's mean step), ``seconds`` (when the
    last rank finished), ``models_moved_per_step`` (the bytes each rank's operations delivered
    per step, in models: how often a gossip method really mixed; an asynchronous one that
    cannot keep up with its link sends less often) and ``internode_models_per_step`` (the part
    that crossed a node's link; ``internode_bytes_per_s``: those bytes per second, each rank's
    over its own steps, summed), ``steps`` (the timed steps simulated) and ``steady``; for AGP
    also ``message_delays``: for every share combined in those steps, the receiver's step then
    less the sender's step when the share left (sorted), the schedule its mixing follows.

    With ``until_steady=False`` the figures are over the workload's timed steps, as a run of
    that length measures them (the validation compares such runs). With ``until_steady`` the
    ranks run until the method's pace is steady and the figures are the steady state's: the
    timed steps double (from ``work.steps``, at least two periods of the peer schedule) until
    the two halves of the timed steps agree within ``tolerance`` in steps per second and in
    models moved per step, and the second half lasts at least three times a model's time on a
    node's link with each of the node's ranks sending one; the figures are then the second
    half's. ``steady`` is False where ``max_steps`` came first.
    """
    if not until_steady:
        cl, run = _run(method, nodes, ranks_per_node, work, costs, seed)
        out = _measure(_by_rank(cl), run, work.warmup, work.warmup + work.steps - 1, cl.charges)
        return dict(out, seconds=max(t[-1] for t in run.times), steps=work.steps, steady=None,
                    held=sum(run.held))
    n = nodes * ranks_per_node
    period = max(1, math.ceil(math.log2(n))) if n > 1 else 1
    # a model's time on a node's link when each of its ranks sends one (the link is theirs to share)
    message_s = work.nbytes * ranks_per_node / (costs.link_rate if nodes > 1 else costs.shm_rate * costs.cores)
    steps = max(work.steps, 2 * period, 4)
    steps += steps % 2
    while True:
        w = dataclasses.replace(work, steps=steps)
        cl, run = _run(method, nodes, ranks_per_node, w, costs, seed)
        half = w.warmup + steps // 2
        per_rank = _by_rank(cl)
        a = _measure(per_rank, run, w.warmup, half - 1)
        b = _measure(per_rank, run, half, w.warmup + steps - 1, cl.charges)
        span = sorted(s * (steps // 2) for s in b["step_s"])[len(b["step_s"]) // 2]
        long_enough = span >= 3 * message_s
        steady = (long_enough and _close(a["steps_per_s"], b["steps_per_s"], tolerance)
                  and _close(a["models_moved_per_step"], b["models_moved_per_step"], tolerance, 0.005))
        if steady or steps >= max_steps:
            return dict(b, seconds=max(t[-1] for t in run.times), steps=steps, steady=steady, held=sum(run.held))
        mean_step = span / (steps // 2)
        needed = 2 * math.ceil(3 * message_s / mean_step) if mean_step > 0 else 2 * steps
        steps = min(max_steps, max(2 * steps, needed + needed % 2))
