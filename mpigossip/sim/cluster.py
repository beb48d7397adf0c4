"""A simulated cluster for the time model: nodes joined by links, ranks on the nodes, cores
they share, and the messages between them (on :mod:`.events`).

Every node has an uplink and a downlink of ``link_rate`` bytes/s (full duplex, shared by
the node's ranks: a message from node a to node b crosses a's uplink and b's downlink) and
a shared-memory path of ``shm_rate`` bytes/s per core for messages between its own ranks.
Cores come in pools: one per node by default, or one for the whole machine
(``cores_shared=True``: the emulated cluster's nodes share this machine's cores). A rank's CPU work takes at most one
core and shares its pool with the other ranks' (processor sharing); a sleep takes none.
"""

import math

from .events import Engine, Fabric

__all__ = ["Cluster"]


class Cluster:
    """Ranks on nodes, with links and cores (see the module).

    Args:
        nodes: number of nodes; ranks_per_node: ranks on each (rank r sits on node r // ranks_per_node).
        link_rate: payload bytes per second of each node's link, each way.
        latency: seconds before a message between nodes starts to flow.
        cores: cores per pool; cores_shared: one pool for every node (else one per node).
        shm_rate: bytes per second one core copies between two ranks of one node (a node's
            shared memory carries ``cores`` times that).
        message_cpu: CPU seconds each side spends per message (posting, matching, completing).
        wire_cpu: CPU seconds per byte between nodes, on each side (the network stack's copies).
        eager: bytes up to which a message leaves before its receive is posted (Open MPI's TCP
            eager limit); a larger one waits for the receive (rendezvous).
        gets_shared: a rank's one-sided gets between nodes, served and its own, share one
            link's rate (see :meth:`wire`).
    """

    def __init__(self, nodes, ranks_per_node, *, link_rate, latency=5e-5, cores=None, cores_shared=False,
                 shm_rate=5e9, message_cpu=0.0, wire_cpu=0.0, eager=65536, gets_shared=False):
        if nodes < 1 or ranks_per_node < 1:
            raise ValueError(f"need at least one node and one rank per node, got {nodes} x {ranks_per_node}")
        self.nodes, self.ranks_per_node = nodes, ranks_per_node
        self.size = nodes * ranks_per_node
        self.latency, self.message_cpu, self.wire_cpu, self.eager = latency, message_cpu, wire_cpu, eager
        self.cores = ranks_per_node if cores is None else cores
        self.cores_shared = cores_shared
        capacity = {}
        for n in range(nodes):
            capacity[f"up{n}"] = capacity[f"down{n}"] = link_rate
            capacity[f"shm{n}"] = shm_rate * self.cores   # each core copies at shm_rate
        pools = ["cpu"] if cores_shared else [f"cpu{n}" for n in range(nodes)]
        for pool in pools:
            capacity[pool] = self.cores
        self.gets_shared = gets_shared and nodes > 1
        if self.gets_shared:   # each rank's one-sided gets, served and its own, between nodes (see wire's ``get``)
            for r in range(self.size):
                capacity[f"get{r}"] = link_rate
        self.engine = Engine()
        self.fabric = Fabric(self.engine, capacity)
        self._mail = {}
        #: every delivery: (time it completed, rank whose operation it was, bytes, between nodes)
        self.deliveries = []
        #: every CPU charge: (time it was asked for, rank, core seconds): a rank's work, and the
        #: network stack's per byte on each side of a message between nodes
        self.charges = []

    def node(self, rank):
        return rank // self.ranks_per_node

    def _pool(self, rank):
        return "cpu" if self.cores_shared else f"cpu{self.node(rank)}"

    def sleep(self, seconds):
        """Time that uses no core (a modelled compute that sleeps, a GPU kernel)."""
        return self.engine.timeout(seconds)

    def cpu(self, rank, seconds):
        """``seconds`` of one core's work by ``rank``, sharing its pool."""
        self.charges.append((self.engine.now, rank, seconds))
        return self.fabric.transfer(seconds, [self._pool(rank)], cap=1.0)

    def wire(self, src, dst, nbytes, *, rate=1.0, by=None, get=False):
        """The bytes of one message on the wire from ``src``'s node to ``dst``'s (shared
        memory inside a node); ``rate``: the fraction of a link this kind of message can use
        (one-sided gets, for instance, move at part of it); ``by``: the rank whose operation
        it is (default ``src``), credited in :attr:`deliveries` once the bytes have arrived (a
        message still on the wire has moved nothing yet). ``get``: a one-sided get (``src``
        the target, ``dst`` the reader): with ``gets_shared``, between nodes its bytes also
        cross both ranks' get resource, one link's rate each, which every get a rank serves or
        makes shares (measured with Open MPI 5's TCP transport: two 64 MB gets in opposite
        directions, or a ring of three, take twice one get's time; a ring of sends and puts
        both ways at once take one)."""
        who = src if by is None else by
        a, b = self.node(src), self.node(dst)
        if a == b:
            done = self.fabric.transfer(nbytes, [f"shm{a}"])
        else:
            cap = rate * self.fabric.capacity[f"up{a}"] if rate < 1 else math.inf
            uses = {f"up{a}": 1.0, f"down{b}": 1.0}
            if get and self.gets_shared:
                uses[f"get{src}"] = uses[f"get{dst}"] = 1.0
            if self.wire_cpu:   # the network stack's work on both sides, from the cores
                for pool in (self._pool(src), self._pool(dst)):
                    uses[pool] = uses.get(pool, 0.0) + self.wire_cpu
                self.charges += [(self.engine.now, src, nbytes * self.wire_cpu), (self.engine.now, dst, nbytes * self.wire_cpu)]
            done = self.fabric.transfer(nbytes, uses, cap=cap, latency=self.latency)
        done.then(lambda _: self.credit(who, nbytes, a != b))
        return done

    def credit(self, rank, nbytes, between_nodes):
        """Record ``nbytes`` delivered now by ``rank``'s operation."""
        self.deliveries.append((self.engine.now, rank, nbytes, between_nodes))

    def mailbox(self, key):
        """The event of the message ``key`` arriving (made by whichever side asks first)."""
        ev = self._mail.get(key)
        if ev is None:
            ev = self._mail[key] = self.engine.event()
        return ev

    def send(self, src, dst, nbytes, key):
        """A two-sided message: the sender's CPU per message, then the bytes on the wire (a
        message above ``eager`` bytes only once the receiver has posted its receive: MPI's
        rendezvous), then the receiver's mailbox ``key`` fires; returns the event of the send
        completing."""
        done = self.engine.event()

        def go():
            if self.message_cpu:
                yield self.cpu(src, self.message_cpu)
            if nbytes > self.eager:
                yield self.mailbox(("posted",) + tuple(key))
            yield self.wire(src, dst, nbytes)
            self.mailbox(key).succeed()
            done.succeed()
        self.engine.process(go())
        return done

    def receive(self, dst, key):
        """Post the receive of message ``key`` by ``dst``: the event of its having arrived and
        been taken (the receiver's CPU per message)."""
        done = self.engine.event()
        posted = self.mailbox(("posted",) + tuple(key))
        if not posted.done:
            posted.succeed()

        def go():
            yield self.mailbox(key)
            self._mail.pop(key, None)
            self._mail.pop(("posted",) + tuple(key), None)
            if self.message_cpu:
                yield self.cpu(dst, self.message_cpu)
            done.succeed()
        self.engine.process(go())
        return done
