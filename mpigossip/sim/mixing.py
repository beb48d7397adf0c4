"""Mixing rounds on many virtual ranks in one process, without MPI: the package's topologies
and kernels applied to a ``(p, n)`` array, one row per virtual rank.

Each mixing round calls :func:`mpigossip.core.kernels.weighted_sum` with the same operands, in
the same order, as the communicator on a real rank (PushSum's synchronous step, gossip
push), so at the same world size the simulator's rows equal a real MPI run's buffers bit
for bit (tested at 8 ranks); it then scales to sizes no machine here can launch (p = 1024)
to show how consensus error scales with the graph and p.
"""

import numpy as np

from .. import topology as topo_mod
from ..core import kernels


def _rows(x):
    """A private ``(p, n)`` copy of ``x`` (float arrays keep their dtype, others become float64)."""
    x = np.asarray(x)
    out = np.array(x, dtype=x.dtype if x.dtype.kind == "f" else np.float64)
    if out.ndim != 2:
        raise ValueError(f"x must be a (p, n) array, got shape {out.shape}")
    return out


class PushSumSim:
    """Synchronous PushSum on ``p`` virtual ranks.

    Args:
        x: ``(p, n)`` float array, row i = rank i's numerator (copied).
        topology: any column-stochastic topology (default ``ExponentialGraph()``).
        delay: rounds a message spends in flight (0: received in the round it is sent, the
            synchronous step; ``d``: added to its receiver ``d`` rounds later, as overlap SGP
            with its messages ``d`` steps old). What is in flight counts in neither ``x`` nor
            ``w``; ``x`` and ``w`` plus it sum to what they did at the start.
        exact: combine each row with the package's kernel in a communicator's order, bit for
            bit as a rank does (``delay=0`` only; a Python loop over the rows); False: one
            vectorized sum per round, the same weights rounded otherwise (fast at p = 1024).
    """

    def __init__(self, x, topology=None, *, delay=0, exact=True):
        self.x = _rows(x)
        self.p = self.x.shape[0]
        self.topology = (topology or topo_mod.ExponentialGraph()).bind(self.p)
        self.w = np.ones(self.p)
        self.steps = 0
        if not (isinstance(delay, (int, np.integer)) and delay >= 0):
            raise ValueError(f"PushSumSim: delay must be an integer >= 0, got {delay!r}")
        self.delay = int(delay)
        self.exact = bool(exact) and not self.delay
        self.in_flight = []   # (x shares, w shares) per round sent, oldest first
        self._plans = {}

    def step(self):
        """One round: every virtual rank combines what its in-peers sent (their old values),
        or with a ``delay``, keeps its own share and adds what was sent ``delay`` rounds ago."""
        k, g = self.steps, self.topology
        g.check_step(k)
        if not self.exact:
            self._vector_step(k, g)
            return
        old, old_w, new_w = self.x.copy(), self.w.copy(), np.empty(self.p)
        for i in range(self.p):
            self_weight, _ = g.mixing_weights(i, k)
            ins = g.in_peers(i, k)
            shares = [g.mixing_weights(j, k)[1][i] for j in ins]
            new_w[i] = self_weight * old_w[i] + sum(s * float(old_w[j]) for s, j in zip(shares, ins))
            parts = [old[j].copy() for j in ins]  # receive buffers: scratch, as on a rank
            kernels.weighted_sum(self.x[i], old[i], self_weight, parts, shares)
        self.w = new_w
        self.steps += 1

    def _plan(self, k, g):
        """``(own, src, share, receivers, starts)``: the mixing matrix at step ``k``, its
        messages grouped by receiver (cached per step of the graph's period)."""
        key = k % g.period if g.period else k
        plan = self._plans.get(key)
        if plan is None:
            own, src, dst, share = np.empty(self.p), [], [], []
            for j in range(self.p):
                own[j], shares = g.mixing_weights(j, k)
                for i, s in shares.items():
                    src.append(j), dst.append(i), share.append(s)
            dst = np.array(dst, dtype=np.intp)
            order = np.argsort(dst, kind="stable")   # grouped by receiver: one reduceat per round
            receivers, starts = np.unique(dst[order], return_index=True)
            plan = (own, np.array(src, dtype=np.intp)[order], np.array(share)[order], receivers, starts)
            if g.period:
                self._plans[key] = plan
        return plan

    def _vector_step(self, k, g):
        own, src, share, receivers, starts = self._plan(k, g)
        sent_x, sent_w = np.zeros_like(self.x), np.zeros(self.p)
        if len(src):
            sent_x[receivers] = np.add.reduceat(share[:, None] * self.x[src], starts, axis=0)
            sent_w[receivers] = np.add.reduceat(share * self.w[src], starts)
        self.x *= own[:, None]
        self.w *= own
        self.in_flight.append((sent_x, sent_w))
        if len(self.in_flight) > self.delay:
            got_x, got_w = self.in_flight.pop(0)
            self.x += got_x
            self.w += got_w
        self.steps += 1

    def debiased(self):
        """``z = x / w`` per virtual rank."""
        return self.x / self.w[:, None]


class AsyncPushSumSim:
    """AGP's mixing (:class:`mpigossip.AsyncPushSum`) on ``p`` virtual ranks, its shares
    delivered on a schedule.

    Every round each rank whose weight is at least ``min_weight`` (of its first) moves half of
    its ``x`` and ``w`` into what accumulates for the round's out-peer (one peer of the
    graph's, in turn); what accumulates for an out-peer leaves once the message before it to
    that peer has been combined (per out-peer one message in flight and one accumulating, as
    the package keeps them); a message leaving in round ``k`` is combined by its receiver in
    round ``k + d``, ``d`` drawn from ``delays`` (the time model's ``message_delays``: how many
    of its own steps after a share left its receiver took it in). Nothing is lost: ``x`` and
    ``w`` plus what accumulates and what is in flight sum to what they did at the start.

    Args:
        x: ``(p, n)`` float array, row i = rank i's numerator (copied).
        delays: the delays (rounds >= 0) to draw from, uniformly; empty: no share ever arrives.
        topology: a one-peer graph with a period (default ``ExponentialGraph(peers=1)``).
        seed: the draws' seed.
        min_weight: the floor below which a rank keeps its shares (AsyncPushSum's).
    """

    def __init__(self, x, *, delays, topology=None, seed=0, min_weight=2.0 ** -10):
        self.x = _rows(x)
        self.p, n = self.x.shape
        self.topology = (topology or topo_mod.ExponentialGraph(peers=1)).bind(self.p)
        period = self.topology.period
        if not period:
            raise ValueError("AsyncPushSumSim: the topology needs a period (one accumulating buffer per out-peer)")
        self.delays = np.asarray(delays, dtype=np.int64).ravel()
        if (self.delays < 0).any():
            raise ValueError("AsyncPushSumSim: delays must be >= 0")
        self.w = np.ones(self.p)
        self.min_weight = float(min_weight)
        self.rng = np.random.default_rng(seed)
        self.steps = 0
        # per rank and out-peer slot (the round in the graph's period): the peer, what
        # accumulates, what is in flight and the round it is combined (-1: nothing in flight)
        self.peer = np.array([[self.topology.out_peers(i, s)[0] for s in range(period)]
                              for i in range(self.p)], dtype=np.intp)
        self.acc_x = np.zeros((self.p, period, n), self.x.dtype)
        self.acc_w = np.zeros((self.p, period))
        self.fly_x = np.zeros_like(self.acc_x)
        self.fly_w = np.zeros_like(self.acc_w)
        self.due = np.full((self.p, period), -1, dtype=np.int64)

    def step(self):
        k, slots = self.steps, self.peer.shape[1]
        s = k % slots
        give = self.w >= self.min_weight
        half_x, half_w = 0.5 * self.x[give], 0.5 * self.w[give]
        self.acc_x[give, s] += half_x
        self.acc_w[give, s] += half_w
        self.x[give] -= half_x
        self.w[give] -= half_w
        leave = (self.due < 0) & (self.acc_w > 0)
        if leave.any():
            self.fly_x[leave], self.fly_w[leave] = self.acc_x[leave], self.acc_w[leave]
            self.acc_x[leave], self.acc_w[leave] = 0.0, 0.0
            count = int(leave.sum())
            late = (self.rng.choice(self.delays, count) if len(self.delays)
                    else np.full(count, np.iinfo(np.int64).max // 2))
            self.due[leave] = k + late
        arrive = (self.due >= 0) & (self.due <= k)
        if arrive.any():
            to = self.peer[arrive]
            np.add.at(self.x, to, self.fly_x[arrive])
            np.add.at(self.w, to, self.fly_w[arrive])
            self.fly_x[arrive], self.fly_w[arrive] = 0.0, 0.0
            self.due[arrive] = -1
        self.steps += 1

    def debiased(self):
        """``z = x / w`` per virtual rank."""
        return self.x / self.w[:, None]

    def totals(self):
        """``(sum of x, sum of w)`` over the ranks, what accumulates and what is in flight."""
        return (self.x.sum(axis=0) + self.acc_x.sum(axis=(0, 1)) + self.fly_x.sum(axis=(0, 1)),
                float(self.w.sum() + self.acc_w.sum() + self.fly_w.sum()))


class GossipPushSim:
    """Gossip push (Jin et al.) on ``p`` virtual ranks, the schedule of :class:`mpigossip.Gossip`
    with ``mode="push"`` and the same seed."""

    def __init__(self, x, seed=0, topology=None):
        self.x = _rows(x)
        self.p = self.x.shape[0]
        self.topology = (topology or topo_mod.RandomPeers(peers=1, seed=seed, allow_self=True)).bind(self.p)
        self.steps = 0

    def step(self):
        r, g = self.steps, self.topology
        old = self.x.copy()
        for i in range(self.p):
            (target,) = g.out_peers(i, r)
            senders = [s for s in g.in_peers(i, r) if s != i]
            own = 2.0 if target == i else 1.0
            total = own + len(senders)
            parts = [old[s].copy() for s in senders]
            kernels.weighted_sum(self.x[i], old[i], own / total, parts, [1.0 / total] * len(parts))
        self.steps += 1


def consensus_error(z):
    """``sqrt(mean_i ||z_i - mean z||^2)`` of a ``(p, n)`` array."""
    z = np.asarray(z, dtype=np.float64)
    return float(np.sqrt(np.mean(np.sum((z - z.mean(axis=0)) ** 2, axis=1))))


def consensus_curve(topology, p, steps, *, n=16, seed=0):
    """Consensus error of PushSum's de-biased ``z`` after each of ``steps`` rounds, from
    standard normal rows, relative to the error at the start."""
    sim = PushSumSim(np.random.default_rng(seed).standard_normal((p, n)), topology)
    start = consensus_error(sim.debiased())
    out = []
    for _ in range(steps):
        sim.step()
        out.append(consensus_error(sim.debiased()) / start)
    return out
