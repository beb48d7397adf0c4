"""How an exact allreduce moves bytes when MPI's own algorithm is not the best one: a ring
over ``Isend``/``Irecv``, flat or node-aware.

**Ring** (:class:`Ring`): the buffer is cut into P blocks; a reduce-scatter passes blocks
around the ring in P - 1 steps, each rank adding what arrives from its left neighbour into its
own copy, until rank r holds the sum of block r + 1; an allgather passes the summed blocks
around in P - 1 more steps, received in place. Every rank sends and receives
``2 (P - 1) / P`` of the buffer: the bandwidth limit when each rank has a link of its own.
Each block travels in segments, and a segment is passed on as soon as it has been reduced,
so the transfer of one segment overlaps the reduction of the last and the steps overlap.
Only the owned block is scaled (by ``scale``: 1/P for a mean), before the allgather: every
rank ends with the same bytes.

**Node-aware** (:class:`NodeRing`): the ranks of a node first reduce-scatter the buffer in
shared memory (MPI over the node's communicator), so local rank l holds the node's sum of
shard l; one ring per local rank then runs between the nodes on its shard (L rings of 1/L of
the buffer each: a node's link carries ``2 (N - 1) / N`` of the buffer, the limit for N
nodes, instead of ``2 (P - 1) / P`` for the flat ring); a node allgather ends it.

Both are written as a generator of request lists (:meth:`_Schedule.steps`), so one schedule
serves the blocking call (every wait under the deadline) and the nonblocking
``start()``/``test()``/``finish()`` (progress from ``test()`` calls).

How a message's request is made, tested and waited is the schedule's *request strategy*:
:class:`~mpigossip.core.requests.Immediate` (``Isend``/``Irecv``, waited under the owner's deadline) by default, or
:class:`mpigossip.resilience.persistent.PersistentRequests` for ``on_failure="continue"``
(persistent requests made once and started each run, a failed peer raised as
:class:`~mpigossip.resilience.failures.PeerFailure`). The schedule, its segments and its
arithmetic are the same in both.
"""

from mpi4py import MPI

from ..core import buffers, kernels, nodes
from ..core.base import shard_bounds
from ..core.requests import Immediate


def _segments(lo, hi, seg):
    return [(a, min(hi, a + seg)) for a in range(lo, hi, seg)] if hi > lo else []


class _Schedule:
    """A generator of request lists over one buffer; :meth:`start`, :meth:`test` and
    :meth:`wait` drive it, its requests made by ``requests`` (a strategy: :class:`Immediate`
    by default)."""

    def __init__(self, owner, op, requests=None):
        self.owner, self.op = owner, op
        self.requests = Immediate(owner) if requests is None else requests
        self._gen, self._pending = None, None

    def start(self, memory):
        """Begin on ``memory`` (the array MPI reads and writes); returns at once."""
        self._gen = self.steps(memory)
        self._advance()

    def _advance(self):
        while True:
            try:
                self._pending = next(self._gen)
            except StopIteration:
                self._gen, self._pending = None, None
                return
            if not self.requests.test(self._pending, self.op):
                return

    def test(self):
        """Drive progress; whether the whole allreduce is done."""
        if self._gen is None:
            return True
        if self.requests.test(self._pending, self.op):
            self._advance()
        return self._gen is None

    def wait(self):
        """Complete it (every wait under the owner's deadline)."""
        while self._gen is not None:
            self.requests.wait(self._pending, self.op, self._peers())
            self._advance()

    def abandon(self):
        """A failure ended the run (the strategy keeps its requests): forget where it stood."""
        self._gen, self._pending = None, None

    def _peers(self):
        return "all ranks"

    def run(self, memory):
        """The blocking form: the caller has met every rank under the deadline first (a
        deadline-guarded barrier), so the blocking MPI calls a schedule may make return."""
        self.blocking = True
        try:
            self.start(memory)
            self.wait()
        finally:
            self.blocking = False

    blocking = False  # whether run() drives the schedule: blocking MPI calls are then safe


class Ring(_Schedule):
    """Ring allreduce (sum, then ``* scale``) of ``memory`` over ``comm``, in place.

    Args:
        owner: the communicator that owns this (its ``_wait`` and deadline).
        comm: the ring's communicator (ranks in ring order).
        synchronize: called after device work that MPI then reads or writes over (a no-op
            for host memory).
        segment: elements per message (at most the strategy's ``limit`` bytes: the caller's to cap).
        scale: multiplies the sum (1/P for the mean over ``owner``), applied once per element.
        requests: the request strategy (default :class:`Immediate`).
        phases: ``"both"``; ``"reduce-scatter"`` alone (rank r ends holding the sum, times
            ``scale``, of block ``(r + 1) % P`` of :func:`~mpigossip.core.base.shard_bounds`);
            or ``"allgather"`` alone (from that block on every rank).
    """

    def __init__(self, owner, comm, *, synchronize, segment, scale=1.0, op="allreduce (ring)", claim=None,
                 requests=None, phases="both"):
        super().__init__(owner, op, requests)
        self.comm, self.synchronize, self.segment, self.scale = comm, synchronize, max(1, int(segment)), scale
        self.phases = phases
        self.claim = claim or (lambda count: 0)  # the first of ``count`` tags of this run (Layout.claim_tags)
        self._scratch = None

    def _peers(self):
        p, r = self.comm.Get_size(), self.comm.Get_rank()
        return f"ring neighbours {(r - 1) % p} and {(r + 1) % p} (of {p})"

    def steps(self, x):
        comm = self.comm
        p, r = comm.Get_size(), comm.Get_rank()
        if p == 1:
            if self.scale != 1.0 and self.phases != "allgather":
                kernels.scale(x, self.scale)
            return
        right, left = (r + 1) % p, (r - 1) % p
        blocks = shard_bounds(x.size, p)
        width = max(hi - lo for lo, hi in blocks)
        if self._scratch is None or self._scratch.size < 2 * width or type(self._scratch) is not type(x):
            self._scratch = buffers.empty_like(x, 2 * width)  # two steps' receives: one is reduced while the next arrives
        scratch = self._scratch
        last_rs = p - 2  # steps 0 .. p-2 reduce-scatter, p-1 .. 2p-3 allgather
        total = 2 * (p - 1)
        # Tags of their own: rings on one communicator (a model's gradient buckets) may be in flight
        # together and progress in any order, and a message must match its own ring's receive.
        tag0 = self.claim(total)
        requests = self.requests
        begin = p - 1 if self.phases == "allgather" else 0        # the steps this run takes
        end = p - 1 if self.phases == "reduce-scatter" else total

        def block_in(s):  # the block received at step s
            return (r - s - 1) % p if s <= last_rs else (r - (s - p + 1)) % p

        def block_out(s):  # the block sent at step s (the one received at step s - 1)
            return (r - s) % p if s <= last_rs else (r + 1 - (s - p + 1)) % p

        sends = {}  # step -> its send requests (an allgather receive may reuse their block)
        recvs = {}

        def post_recvs(s):
            lo, hi = blocks[block_in(s)]
            reqs = []
            for a, b in _segments(lo, hi, self.segment):
                if s <= last_rs:  # into scratch, added afterwards
                    at = (s % 2) * width + (a - lo)
                    reqs.append(requests.irecv(comm, scratch[at:at + b - a], left, tag0 + s))
                else:             # in place: the allgather's blocks are final
                    reqs.append(requests.irecv(comm, x[a:b], left, tag0 + s))
            recvs[s] = reqs

        def post_send(s, a, b):
            sends.setdefault(s, []).append(requests.isend(comm, x[a:b], right, tag0 + s))

        self.synchronize()  # the caller's device writes to x come first
        post_recvs(begin)
        lo, hi = blocks[block_out(begin)]
        for a, b in _segments(lo, hi, self.segment):
            post_send(begin, a, b)
        for s in range(begin, end):
            if s + 1 < end:
                if s + 1 > last_rs:  # an allgather receive lands on a block sent at the reduce-scatter step t
                    t = s + 1 - (p - 1)
                    if sends.get(t):
                        yield sends.pop(t)
                post_recvs(s + 1)
            lo, hi = blocks[block_in(s)]
            for j, (a, b) in enumerate(_segments(lo, hi, self.segment)):
                yield [recvs[s][j]]
                if s <= last_rs:
                    at = (s % 2) * width + (a - lo)
                    kernels.weighted_sum(x[a:b], x[a:b], 1.0, [scratch[at:at + b - a]], [1.0], keep_recvs=True)
                    if s == last_rs and self.scale != 1.0:  # the block this rank owns: the mean, once
                        kernels.scale(x[a:b], self.scale)
                    self.synchronize()  # the reduction has written what MPI sends next, and read scratch
                if s + 1 < end:
                    post_send(s + 1, a, b)
            del recvs[s]
        pending = [q for reqs in sends.values() for q in reqs]
        if pending:
            yield pending


class NodeRing(_Schedule):
    """Node-aware allreduce (sum, then ``* scale``): reduce-scatter inside each node (MPI on
    ``node``, shared memory), one :class:`Ring` per local rank between the nodes on its shard
    (``cross``: the ranks with this local rank, one per node), allgather inside the node.
    Every node must have the same number of ranks. Blocking only (:meth:`run`): inside a node
    MPI's blocking collectives are fast, the nonblocking ones progress only at each ``Test`` of
    a poll (slow for a large buffer); an overlapped allreduce uses a plain :class:`Ring`.

    With a request strategy other than :class:`Immediate` (``on_failure="continue"``: MPI's
    collectives do not survive a failed rank) the node's phases are the two halves of a
    :class:`Ring` over ``node`` on the strategy's requests, in place: local rank l reduces
    block ``(l + 1) % L`` of the node's sum, the rings between nodes run on that block, and the
    node's allgather ring spreads it."""

    def __init__(self, owner, node, cross, *, synchronize, segment, scale=1.0, op="allreduce (node-aware ring)",
                 claim=None, requests=None):
        super().__init__(owner, op, requests)
        self.node, self.cross = node, cross
        self.ring = Ring(owner, cross, synchronize=synchronize, segment=segment, scale=scale, op=op, claim=claim,
                         requests=self.requests)
        self.synchronize = synchronize
        self._shard = None
        self._halves = None
        if not isinstance(self.requests, Immediate):
            self._halves = [Ring(owner, node, synchronize=synchronize, segment=segment, op=op, claim=claim,
                                 requests=self.requests, phases=phases) for phases in ("reduce-scatter", "allgather")]

    def _peers(self):
        return f"the node's ranks and the ring between nodes ({self.ring._peers()})"

    def steps(self, x):
        if self._halves is not None:  # every phase on the strategy's requests
            if not self.blocking:
                raise RuntimeError(f"{self.op}: the node-aware ring runs blocking only (run())")
            reduce_scatter, allgather = self._halves
            node = self.node
            lo, hi = shard_bounds(x.size, node.Get_size())[(node.Get_rank() + 1) % node.Get_size()]
            yield from reduce_scatter.steps(x)
            yield from self.ring.steps(x[lo:hi])
            yield from allgather.steps(x)
            return
        yield from self._collective_steps(x)

    def _collective_steps(self, x):
        node = self.node
        local, lr = node.Get_size(), node.Get_rank()
        bounds = shard_bounds(x.size, local)
        counts = [hi - lo for lo, hi in bounds]
        lo, hi = bounds[lr]
        if self._shard is None or self._shard.size != hi - lo or type(self._shard) is not type(x):
            self._shard = buffers.empty_like(x, max(1, hi - lo))
        shard = self._shard[:hi - lo]
        if not self.blocking:
            raise RuntimeError(f"{self.op}: the node-aware ring runs blocking only (run())")
        self.synchronize()
        if local == 1:
            shard[...] = x
        else:
            node.Reduce_scatter(x, shard, counts, MPI.SUM)
        yield from self.ring.steps(shard)
        displs = [a for a, _ in bounds]
        if local == 1:
            x[...] = shard
        else:
            node.Allgatherv(shard, [x, counts, displs, _datatype(x)])


def _datatype(x):
    from ..core.buffers import mpi_datatype
    return mpi_datatype(x.dtype)


#: The allreduce algorithms a user may force (``AllreduceAverager(algorithm=...)``).
ALGORITHMS = ("auto", "mpi", "ring", "node-ring")

#: The rings' default message size: the largest that Open MPI's TCP transport sends eagerly
#: (``btl_tcp_eager_limit``, 64 KiB, less its headers). A larger message goes by rendezvous, a
#: round trip through the receiver's progress: where ranks share cores the receiver is often not
#: running, and larger segments left the links idle (measured: docs/RESULTS.md, "AllReduce at
#: the limit").
SEGMENT_BYTES = 63 << 10

#: Below this many bytes across nodes, MPI's own algorithm (fewer latency rounds) wins; at and
#: above it the rings do (measured on 4 emulated nodes at 1 Gbit: docs/RESULTS.md, "AllReduce
#: at the limit").
RING_MIN_BYTES = 1 << 18


_RUNS_KEYVAL = None


def _runs_of(comm):
    """The count of ring runs started on ``comm``, cached on the communicator itself (an MPI
    attribute): every averager on one communicator, with its own layout or a shared one, takes
    its tag windows from one count, so two of them made with ``dup=False`` cannot cross-match
    messages. A new communicator starts at zero on every rank."""
    global _RUNS_KEYVAL
    if _RUNS_KEYVAL is None:
        _RUNS_KEYVAL = MPI.Comm.Create_keyval()
    runs = comm.Get_attr(_RUNS_KEYVAL)
    if runs is None:
        runs = [0]
        comm.Set_attr(_RUNS_KEYVAL, runs)
    return runs


class Layout:
    """Where a communicator's ranks are: its node sub-communicator (shared memory), whether
    every rank shares one node, whether every node has as many ranks, and (made on first use)
    the communicator of the ranks with this rank's local rank, one per node. One layout may
    serve many averagers on one communicator (a model's gradient buckets): the two
    sub-communicators are made once. Collective construction; :meth:`free` is collective."""

    def __init__(self, comm, *, timeout):
        from ..core import deadline
        self.comm = comm
        self.node = nodes.node_comm(comm)
        locals_ = deadline.allgather(comm, self.node.Get_size(), timeout=timeout, op="allreduce layout")
        self.local_size = self.node.Get_size()
        self.one_node = self.local_size == comm.Get_size()
        self.uniform = len(set(locals_)) == 1
        self._cross = None
        self._runs = _runs_of(comm)  # rings started on this communicator (the same count on every rank)

    def claim_tags(self, count):
        """The first of ``count`` message tags for the next ring run: consecutive runs get
        disjoint windows, cycling within the MPI's tag bound (Open MPI's: 2^31 - 1). Every rank
        starts its rings in the same order, so every rank gives a run the same window."""
        from ..core.base import tag_bound
        windows = max(1, (tag_bound() + 1) // count)
        base = (self._runs[0] % windows) * count
        self._runs[0] += 1
        return base

    @property
    def cross(self):
        """The ranks with this rank's local rank, one per node (collective on first use)."""
        if self._cross is None:
            self._cross = self.comm.Split(self.node.Get_rank(), self.comm.Get_rank())
        return self._cross

    def choose(self, algorithm, nbytes, *, tolerant=False):
        """The algorithm for ``nbytes`` (``algorithm`` unless it is "auto"): MPI's on one node
        and below :data:`RING_MIN_BYTES`; the node-aware ring across nodes with several ranks
        per node (equal on every node), else the flat ring (two ranks on two nodes too: as
        fast as MPI's blocking ``Allreduce``, and its ``start()`` half the time of MPI's
        ``Iallreduce``, which moves only inside MPI calls: docs/RESULTS.md). ``tolerant``
        (``on_failure="continue"``): never MPI's (its collectives do not survive a failed
        rank), the flat ring instead."""
        if tolerant and algorithm == "mpi":
            return "ring"
        if algorithm != "auto":
            if algorithm == "node-ring" and not self.uniform:
                return "ring"  # the node-aware ring needs as many ranks on every node
            return algorithm
        if self.one_node or nbytes < RING_MIN_BYTES:
            return "ring" if tolerant else "mpi"
        return "node-ring" if self.uniform and self.local_size > 1 else "ring"

    def free(self):
        for c in (self._cross, self.node):
            if c is not None and c != MPI.COMM_NULL:
                c.Free()
        self._cross = self.node = None
