"""Each method's step in the time model (:mod:`.timing`): its messages, waits and window
locks as events on a :class:`~.cluster.Cluster`. Who waits for whom comes out of the events:
AllReduce's ring waits for the slowest rank every step, SGP for its in-peers, OSGP for
messages ``max_delay + 1`` steps old, AGP for nobody; one-sided methods wait for the bytes
they read and for the locks they take.

What a method sends, per rank and step (M = the model's bytes):

* ``allreduce``: a ring (``2 (n - 1)`` rounds of M / n bytes, the first ``n - 1`` added in),
  or with several ranks per node the node-aware ring (the node's ranks reduce in shared
  memory, one ring per local rank between nodes on M / local bytes, then the node gathers);
* ``sgp``: x to its out-peer of :class:`~mpigossip.topology.ExponentialGraph`, x from its
  in-peer, both awaited, then the combine;
* ``osgp:T``: as ``sgp``, a step's messages combined once arrived, awaited only ``T + 1`` steps later;
* ``agp``: as :class:`~mpigossip.AsyncPushSum` runs it: x's share added to what accumulates
  for this step's out-peer (a kernel pass, and one to scale x), sent once the previous message
  to that peer has left (per out-peer one message in flight and one accumulating; every
  out-peer's accumulated shares leave as its link frees, also in ``finish()``); a receiver
  takes a share into one of ``receives`` (2) slots once it has seen the share's weight (a
  large share waits for its slot: MPI's rendezvous), combines what has arrived, and never
  waits; weights are tracked, and a rank below ``min_weight`` (2**-10) of its first weight
  keeps its shares (the package's floor);
* ``gossip-pull``: a one-sided read of a random rank's x (itself included) under a shared lock,
  averaged in, then x published into the rank's own window under its exclusive lock;
* ``adpsgd``: active ranks (even) read a passive rank's x under its exclusive lock and write
  the average back; passive ranks fold their update into their own window under that lock;
* ``easgd`` / ``easgd:S``: every rank, shard after shard of the center (on ``S`` ranks,
  default 1), takes the shard's exclusive lock, reads it, writes it back moved, unlocks;
* ``localsgd:H`` (Local SGD, DiLoCo and SlowMo over AllReduce): the parameters' AllReduce
  every ``H`` steps (default 32), nothing between (the outer update is a kernel pass);
* ``slowmo:H``: SlowMo with inner mixing over SGP: SGP's step every step, and every ``H``
  steps the exact mean (an AllReduce) before the outer update.

CPU: a rank's whole step as measured (``Costs.method_cpu``) where the calibration has it,
else the training step's CPU plus the kernel passes named here.
"""

import random

from .. import topology as topo_mod

#: The methods the model knows (``osgp`` and ``easgd`` take ``:N``).
METHODS = ("allreduce", "sgp", "osgp", "agp", "gossip-pull", "adpsgd", "easgd", "localsgd", "slowmo")
#: The outer methods' default ``H`` (``inner_steps``, as the package's).
INNER_STEPS = 32


class _Lock:
    """A lock on one window, shared or exclusive, granted first come first served: a request
    waits for the ones before it (a shared one goes with other shared holders)."""

    def __init__(self, engine):
        self.engine, self.shared, self.exclusive, self.queue = engine, 0, False, []

    def acquire(self, exclusive=True):
        ev = self.engine.event()
        self.queue.append((exclusive, ev))
        self._grant()
        return ev

    def release(self, exclusive=True):
        if exclusive:
            self.exclusive = False
        else:
            self.shared -= 1
        self._grant()

    def _grant(self):
        while self.queue and not self.exclusive:
            exclusive, ev = self.queue[0]
            if exclusive and self.shared:
                return
            self.queue.pop(0)
            if exclusive:
                self.exclusive = True
            else:
                self.shared += 1
            ev.succeed()


class Steps:
    """One simulation's ranks: the cluster, the costs, the workload, each method's step and
    each rank's step times (:meth:`rank` is a rank's process)."""

    def __init__(self, method, cluster, costs, work, seed):
        name, _, arg = method.partition(":")
        if name not in METHODS:
            raise ValueError(f"unknown method {method!r}: one of {', '.join(METHODS)} (osgp:T, easgd:S, "
                             "localsgd:H, slowmo:H)")
        self.name, self.arg = name, int(arg) if arg else None
        self.measured = costs.method_cpu.get(name)
        self.cl, self.costs, self.work = cluster, costs, work
        self.n = cluster.size
        self.M = work.nbytes
        self.rng = random.Random(seed)
        self.times = [[] for _ in range(self.n)]
        self.topology = topo_mod.ExponentialGraph(peers=1).bind(self.n) if self.n > 1 else None
        self.locks = {}
        self._arrivals = {}                  # allreduce by formula: step -> [ranks arrived, done]
        self.message_level_up_to = 32        # ranks up to which collectives are simulated message by message
        # AGP (as AsyncPushSum): per rank and out-peer [message in flight or None, weight accumulating]
        self.outs = [{} for _ in range(self.n)]
        self.announced = [[] for _ in range(self.n)]  # AGP: (message, weight, step sent) to each rank, not posted
        self.posted = [[] for _ in range(self.n)]     # AGP: (receive, weight, step sent) posted, not yet combined
        #: AGP: every share combined, as (receiver, its step then, the sender's step when it left):
        #: the schedule the accuracy simulator mixes by (``simulate(...)["message_delays"]``)
        self.combined = []
        self.receives = 2                    # AGP's receive slots per rank (AsyncPushSum(receives=2))
        self.weight = [1.0] * self.n         # AGP's PushSum weights
        self.min_weight = 2.0 ** -10         # AsyncPushSum(min_weight=...): below it a rank keeps its shares
        self.held = [0] * self.n             # AGP: steps a rank kept its shares (its weight below the floor)
        self.sent = [0] * self.n             # AGP: messages each rank sent
        #: each rank's parts of each of its steps (gossip pull's lock waits and reads, in seconds;
        #: AGP's messages sent): rank -> {step: {part: value}}
        self.parts = [{} for _ in range(self.n)]
        self.pending = [{} for _ in range(self.n)]    # OSGP: step -> (sends, receives) not yet complete

    # --- building blocks ---
    def passes(self, rank, nbytes, count=1.0):
        """``count`` kernel passes over ``nbytes`` on one core (nothing where the method's
        whole step is measured: :attr:`Costs.method_cpu`)."""
        if self.measured is not None:
            return self.cl.engine.timeout(0.0)
        return self.cl.cpu(rank, count * nbytes / self.costs.pass_rate)

    def lock(self, rank):
        if rank not in self.locks:
            self.locks[rank] = _Lock(self.cl.engine)
        return self.locks[rank]

    def rma(self, me, target, nbytes, read):
        """A one-sided read (target -> me) or write (me -> target)."""
        src, dst = (target, me) if read else (me, target)
        return self.cl.wire(src, dst, nbytes, rate=self.costs.rma_rate, by=me, get=read)

    # --- a rank ---
    def rank(self, r):
        cl, w = self.cl, self.work
        factor = w.straggler.get(r, 1.0)
        step = getattr(self, "_step_" + self.name.replace("-", "_"))
        for k in range(w.warmup + w.steps):
            yield cl.sleep(w.compute * factor)
            if self.measured is not None:
                yield cl.cpu(r, self.measured[0] + self.measured[1] * w.mb)
            else:
                yield cl.cpu(r, self.costs.step_cpu0 + self.costs.step_cpu * w.mb)
            yield from step(r, k)
            self.times[r].append(cl.engine.now)

    # --- the methods ---
    def _ring(self, r, ring, nbytes, key, reduce=True):
        """Ring allreduce of ``nbytes`` among ``ring`` (ranks in ring order) by ``r``."""
        n = len(ring)
        if n == 1:
            return
        i = ring.index(r)
        right, block = ring[(i + 1) % n], nbytes / n
        for s in range(2 * (n - 1)):
            yield self.cl.engine.all_of([self.cl.send(r, right, block, key + (s, right)),
                                         self.cl.receive(r, key + (s, r))])
            if reduce and s < n - 1:
                yield self.passes(r, block)

    def _step_allreduce(self, r, k):
        cl, L = self.cl, self.cl.ranks_per_node
        if self.n == 1:
            return
        if self.n > self.message_level_up_to:
            yield from self._allreduce_formula(r, k)
        elif L == 1 or cl.nodes == 1:
            yield from self._ring(r, list(range(self.n)), self.M, ("ar", k))
        else:  # node-aware: reduce-scatter in the node, a ring per local rank, gather in the node
            node, local = cl.node(r), r % L
            mates = [node * L + j for j in range(L)]
            shard = self.M / L
            yield from self._node_exchange(r, mates, shard, ("rs", k))
            yield self.passes(r, shard, L - 1)
            yield from self._ring(r, [n * L + local for n in range(cl.nodes)], shard, ("ar", k))
            yield from self._node_exchange(r, mates, shard, ("ag", k))
        yield self.passes(r, self.M)  # the 1/n

    def _allreduce_formula(self, r, k):
        """Past ``message_level_up_to`` ranks (a ring's 2 (n - 1) rounds per rank make the
        events grow as n^2): every rank waits for the last to arrive, then the ring's time by
        formula, the links to itself: ``2 (N - 1)`` rounds of ``M / N`` bytes per node link
        (all of the node's rings together) plus a latency each, the node's reduce-scatter and
        gather in shared memory, and the reduction's passes."""
        cl, L, N, M = self.cl, self.cl.ranks_per_node, self.cl.nodes, self.M
        arrived = self._arrivals.setdefault(k, [0, self.cl.engine.event()])
        # delivered when the ring ends, as a ring's rank sends: 2 (n - 1) / n models, of which the
        # inter-node ring's 2 (N - 1) / N of this rank's shard M / L cross its node's link
        between = 2 * (N - 1) / N * M / L

        def delivered(_):
            cl.credit(r, between, True)
            cl.credit(r, 2 * (self.n - 1) / self.n * M - between, False)
        arrived[1].then(delivered)
        arrived[0] += 1
        if arrived[0] == self.n:
            c = self.costs
            t = 2 * (N - 1) * (c.latency + M / N / c.link_rate) if N > 1 else 0.0
            if L > 1:   # every rank of the node moves (L - 1) / L of the model in and out, a core each
                t += 2 * (L - 1) / L * M * L / (c.shm_rate * min(L, cl.cores))
            t += (M / L if N > 1 else M) * ((N - 1) / N if N > 1 else (L - 1) / L) / c.pass_rate
            cl.engine.call_at(cl.engine.now + t, arrived[1].succeed)
        yield arrived[1]

    def _node_exchange(self, r, mates, shard, key):
        """Each rank of the node sends ``shard`` bytes to each other one through shared memory."""
        events = []
        for m in mates:
            if m != r:
                events += [self.cl.send(r, m, shard, key + (r, m)), self.cl.receive(r, key + (m, r))]
        yield self.cl.engine.all_of(events)

    def _exchange(self, r, k):
        """Post step k's PushSum messages of rank r: (sends, receives) events."""
        outs, ins = self.topology.out_peers(r, k), self.topology.in_peers(r, k)
        sends = [self.cl.send(r, d, self.M + 8, ("ps", k, r, d)) for d in outs]
        recvs = [self.cl.receive(r, ("ps", k, s, r)) for s in ins]
        return sends, recvs

    def _outer_step(self, k):
        return (k + 1) % (self.arg or INNER_STEPS) == 0

    def _step_localsgd(self, r, k):
        if self._outer_step(k):
            yield from self._step_allreduce(r, k)
            yield self.passes(r, self.M, 2)   # the outer update (anchor, momentum) where not measured

    def _step_slowmo(self, r, k):
        yield from self._step_sgp(r, k)
        if self._outer_step(k):
            yield from self._step_allreduce(r, k)
            yield self.passes(r, self.M, 2)

    def _step_sgp(self, r, k):
        if self.n == 1:
            return
        sends, recvs = self._exchange(r, k)
        yield self.cl.engine.all_of(sends + recvs)
        yield self.passes(r, self.M, 1 + len(recvs))

    def _step_osgp(self, r, k):
        if self.n == 1:
            return
        delay = self.arg or 1
        pending = self.pending[r]
        yield self.passes(r, self.M)  # start(): the share split off into the send buffer
        while True:                   # at most max_delay + 1 sends in flight: wait for the oldest
            sending = [j for j in pending if not all(e.done for e in pending[j][0])]
            if len(sending) <= delay:
                break
            yield self.cl.engine.all_of(pending[min(sending)][0])
        pending[k] = self._exchange(r, k)
        for j in sorted(pending):     # finish(): blocks only on messages of steps < k - max_delay
            sends, recvs = pending[j]
            if j < k - delay or all(e.done for e in recvs):
                yield self.cl.engine.all_of(recvs)
                if all(e.done for e in sends):
                    del pending[j]
                else:
                    pending[j] = (sends, [])
                if recvs:
                    yield self.passes(r, self.M, len(recvs))

    def _step_agp(self, r, k):
        if self.n == 1:
            return
        [d] = self.topology.out_peers(r, k)
        # start(): this step's share into d's accumulating buffer and x scaled (two passes), unless
        # the weight is below the floor; then what may leave, and what has arrived
        if self.weight[r] >= self.min_weight:
            out = self.outs[r].setdefault(d, [None, 0.0])
            share = self.weight[r] / 2   # ExponentialGraph(peers=1): half kept, half to the out-peer
            out[1] += share
            self.weight[r] -= share
            yield self.passes(r, self.M, 2)
        else:
            self.held[r] += 1
        if d in self.outs[r]:
            self._agp_send(r, d, k)
        yield from self._agp_poll(r, k)
        # finish(): every out-peer whose link freed gets its accumulated shares; what has arrived
        for dst in list(self.outs[r]):
            self._agp_send(r, dst, k)
        yield from self._agp_poll(r, k)

    def _agp_send(self, r, d, k):
        """Send what accumulates for ``d`` if there is some and the previous message to ``d`` left."""
        out = self.outs[r][d]
        if out[1] == 0.0 or (out[0] is not None and not out[0].done):
            return
        self.sent[r] += 1
        self._part(r, k, "sent", 1)
        key = ("agp", r, d, self.sent[r])
        out[0] = self.cl.send(r, d, self.M + 8, key)
        self.announced[d].append((key, out[1], k))   # its weight, a small message probed by d
        out[1] = 0.0

    def _agp_poll(self, r, k):
        """Combine the shares arrived in ``r``'s slots (a pass each) in its step ``k``, then post
        receives for the shares announced, into the slots that are free."""
        posted = self.posted[r]
        done = [(e, w, sent) for e, w, sent in posted if e.done]
        if done:
            self.posted[r] = [p for p in posted if not p[0].done]
            self.weight[r] += sum(w for _, w, _ in done)
            self.combined += [(r, k, sent) for _, _, sent in done]
            self._part(r, k, "combined", len(done))
            yield self.passes(r, self.M, len(done))
        while self.announced[r] and len(self.posted[r]) < self.receives:
            key, w, sent = self.announced[r].pop(0)
            self.posted[r].append((self.cl.receive(r, key), w, sent))

    def _step_gossip_pull(self, r, k):
        t = self.rng.randrange(self.n)
        engine = self.cl.engine
        if t != r:   # a shared lock on the target's window: waits while its owner publishes
            lock = self.lock(t)
            t0 = engine.now
            yield lock.acquire(exclusive=False)
            yield self.cl.engine.timeout(self.costs.rma_lock)
            t1 = engine.now
            yield self.rma(r, t, self.M, read=True)
            lock.release(exclusive=False)
            self._part(r, k, "read_lock", t1 - t0)
            self._part(r, k, "read", engine.now - t1)
            self._part(r, k, "reads", 1)
        yield self.passes(r, self.M)
        lock = self.lock(r)   # publishing x into its own window, exclusive: waits for readers
        t0 = engine.now
        yield lock.acquire()
        self._part(r, k, "publish_lock", engine.now - t0)
        yield self.passes(r, self.M)
        lock.release()

    def _part(self, r, k, name, value):
        """Add ``value`` to rank ``r``'s part ``name`` of its step ``k`` (:attr:`parts`)."""
        self.parts[r].setdefault(k, {})
        self.parts[r][k][name] = self.parts[r][k].get(name, 0.0) + value

    def _step_adpsgd(self, r, k):
        if self.n == 1:
            return
        if r % 2 == 1:  # passive: fold the update into its own window
            lock = self.lock(r)
            yield lock.acquire()
            yield self.passes(r, self.M)
            lock.release()
            return
        passive = [p for p in range(self.n) if p % 2 == 1]
        p = passive[self.rng.randrange(len(passive))]
        lock = self.lock(p)
        yield lock.acquire()
        yield self.cl.engine.timeout(self.costs.rma_lock)
        yield self.rma(r, p, self.M, read=True)
        yield self.passes(r, self.M)
        yield self.rma(r, p, self.M, read=False)
        lock.release()

    def _step_easgd(self, r, k):
        servers = self.arg or 1
        if servers < 1 or servers > self.n:
            raise ValueError(f"easgd:{servers}: 1 to {self.n} servers")
        shard = self.M / servers
        for j in range(servers):
            s = (r + j) % servers   # every walk starts at the rank's own shard
            lock = self.lock(("center", s))
            yield lock.acquire()
            if s != r:
                yield self.cl.engine.timeout(self.costs.rma_lock)
            yield self.rma(r, s, shard, read=True)
            yield self.passes(r, shard)
            yield self.rma(r, s, shard, read=False)
            lock.release()
