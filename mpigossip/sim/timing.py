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


def simulate(method, nodes, ranks_per_node, work, costs, *, seed=0):
    """Simulate ``method`` on ``nodes`` x ``ranks_per_node`` ranks.

    Returns a dict: ``steps_per_s`` (the sum over ranks of each rank's own steps per second
    over its timed steps, as the P4 benchmark counts), ``step_s`` (each rank's mean step),
    ``seconds`` (when the last rank finished) and ``models_moved_per_step`` (the bytes each
    rank's operations moved per step, in models: how often a gossip method really mixed; an
    asynchronous one that cannot keep up with its link sends less often).
    """
    cl = Cluster(nodes, ranks_per_node, link_rate=costs.link_rate, latency=costs.latency, cores=costs.cores,
                 cores_shared=costs.cores_shared, shm_rate=costs.shm_rate, message_cpu=costs.message_cpu,
                 wire_cpu=costs.wire_cpu)
    run = Steps(method, cl, costs, work, seed)
    for r in range(cl.size):
        cl.engine.process(run.rank(r))
    cl.engine.run()
    unfinished = [r for r, t in enumerate(run.times) if len(t) < work.warmup + work.steps]
    if unfinished:
        raise RuntimeError(f"{method}: ranks {unfinished} never finished (a deadlock in the model)")
    end = max(t[-1] for t in run.times)
    rates, steps = [], []
    for t in run.times:
        span = t[-1] - t[work.warmup - 1] if work.warmup else t[-1]
        rates.append(work.steps / span if span > 0 else math.inf)
        steps.append(span / work.steps)
    total = work.warmup + work.steps
    copies = sum(cl.moved.values()) / (run.M * total * cl.size) if run.M else 0.0
    return {"steps_per_s": sum(rates), "step_s": steps, "seconds": end, "models_moved_per_step": copies}
