"""Gossiping SGD's averaging (Jin et al. 2016): pull from, or push to, a random peer.

* ``mode="pull"``: each rank publishes its ``x`` into an RMA window (``Win.Allocate``)
  under an exclusive lock on itself; a puller fetches a random target's copy with
  one-sided ``Rget``s (in pieces, :mod:`mpigossip.onesided.rma`) under a shared lock (the target
  takes no part, and never exposes a half-written vector), then ``x = (x + x_t) / 2``.
* ``mode="push"``: each rank sends ``x`` to a random target (possibly itself) and
  averages its own ``x`` (weight 1, or 2 if it picked itself) with everything that
  arrived. Targets come from a schedule shared through the seed, so every receiver knows
  exactly whom to expect at each round; messages are tagged by round.

Targets are drawn from :class:`mpigossip.topology.RandomPeers` with ``allow_self=True``:
a run is reproducible from its seed. Neither mode conserves the global mean exactly.

Push mode survives failed peers with ``on_failure="continue"`` (:mod:`mpigossip.resilience.tolerant`:
persistent requests, the schedule redrawn over the survivors from the same seed); pull mode
cannot (Open MPI's fault tolerance does not cover one-sided windows).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from mpi4py import MPI

from .. import topology as topo_mod
from ..core import buffers, deadline, kernels
from ..core import wire as wire_mod
from ..core.base import Communicator, step_tag
from ..core.checks import check_integer
from ..core.periodic import new_with_tau
from ..onesided import rma
from ..resilience import failures
from ..resilience.persistent import PersistentRequests
from ..resilience.tolerant import Survives
from .pipeline import Pipeline

if TYPE_CHECKING:
    from ..core.hints import Buffer
    from ..topology import Topology

MODES = ("pull", "push")


class Gossip(Survives, Communicator):
    """Gossip averaging on one flat buffer: one round per :meth:`step`.

    Args:
        x: numpy/cupy/torch buffer, same length and dtype on every rank; updated in place.
        comm: communicator (keyword-only).
        mode: ``"pull"`` (one-sided RMA) or ``"push"`` (``Isend``/``Irecv``).
        seed: seed of the shared target schedule.
        tau: deprecated: ``tau=k`` > 1 returns ``mpigossip.Every(Gossip(...), k)`` (a round
            on every ``k``-th step), with a ``DeprecationWarning``.
        topology: override the target schedule (default ``RandomPeers(1, seed, allow_self=True)``).
        timeout: seconds any wait may take before the job is aborted.
        wire: push mode only: ``None`` or a compressed format of :mod:`mpigossip.core.wire`
            (the pushed copy travels encoded; the receiver averages the decoded values).
        on_failure: ``"abort"`` or, push mode only, ``"continue"``: the survivors of a failed
            rank go on, the target schedule drawn over them from the same seed (the round that
            met the failure leaves ``x`` as it was); persistent requests, one piece, not with
            ``wire``. ``failures`` records each failure (``step``, ``ranks``, ``size``,
            ``seconds``), ``members`` the original ranks still taking part.
    """

    _name = "Gossip"
    _renamed = {"calls": "steps", "rounds": "steps"}

    def __new__(cls, *args, tau=1, **kwargs):
        return new_with_tau(cls, super(), args, kwargs, tau)

    @classmethod
    def _hierarchical_error(cls, options):
        if options.get("mode", "pull") != "push":
            return "Gossip between nodes must use mode='push' (a pull window cannot live in shared memory slices)"
        return None

    def __init__(self, x: Buffer, *, comm: MPI.Intracomm, mode: str = "pull", seed: int = 0, tau: int = 1,
                 topology: Topology | None = None, timeout: float | None = None, cuda_aware: bool | None = None,
                 stage: bool | None = None, wire: str | None = None, on_failure: str = "abort") -> None:
        super().__init__(comm, timeout)
        error = failures.check_on_failure(on_failure, wire)
        if error is None and on_failure == "continue" and mode == "pull":
            error = ("Gossip(mode='pull', on_failure='continue'): a pull reads a one-sided window, which Open MPI's "
                     "fault tolerance (ULFM) does not cover: use mode='push'")
        try:
            if mode not in MODES:
                raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
            check_integer(tau, "tau", 1)  # (a valid tau > 1 went to __new__'s Every)
            if topology is None:
                topology = topo_mod.RandomPeers(peers=1, seed=seed, allow_self=True)
            if not isinstance(topology, topo_mod.Topology):
                raise TypeError(f"topology must be a mpigossip.topology.Topology, got {topology!r}")
            self._graph = topology
            self.topology = self._bind_topology()
            if wire is not None and mode != "push":
                raise ValueError(f"wire={wire!r} needs mode='push' (a pull reads the window's own dtype)")
        except (TypeError, ValueError) as exc:
            error = error or str(exc)
        self._validate(error)
        self.buffer = self._check_buffer(x, name="x", wire=wire, same={"mode": mode, "on_failure": on_failure})
        self.wire = wire
        self._code = None if wire is None else wire_mod.Wire(wire, self.buffer.dtype)
        self._send = None  # wire bytes of x (push with a wire format)
        self.mode, self.seed = mode, seed
        self.steps = 0
        self.last_peers: list[int] = []
        self._stage, self._cuda_aware = stage, cuda_aware
        self._x = buffers.Transport(self.buffer, stage=stage, cuda_aware=cuda_aware)
        self._recv: list[Any] = []
        self.win = None
        self.members = list(range(self.size))
        self.failures: list[Any] = []
        if mode == "pull":
            self._open_window()
        self._tolerate(on_failure, lambda: PersistentRequests(self))
        self._pipeline = None  # push without a wire format: the mixing step's pipeline (decentralized.pipeline)
        if mode == "push" and wire is None:
            self._pipeline = Pipeline(self, self._x, chunk_bytes=4 << 20, slots=2, stage=stage, cuda_aware=cuda_aware,
                                      requests=self._exchange)

    def _bind_topology(self):
        return self._graph.bind(self.size)

    def _open_window(self):
        itemsize = self.buffer.dtype.itemsize
        self.win = rma.allocate(self.comm, self.buffer.nbytes, itemsize, what=self._name)
        self._published = np.frombuffer(self.win.tomemory(), dtype=self.buffer.dtype)
        self._unified = self.win.Get_attr(MPI.WIN_MODEL) == MPI.WIN_UNIFIED
        self._publish()
        # RMA lands in host memory: device buffers are staged, host ones fetched directly.
        self._recv.append(buffers.Transport(buffers.scratch(self.buffer), cuda_aware=False))
        # Everyone has published before anyone pulls.
        deadline.barrier(self.comm, timeout=self.timeout, op=f"{self._name} window")

    def _publish(self):
        """Copy x into this rank's window under an exclusive lock on itself."""
        self._x.before_send()
        source = self._x.memory
        if not isinstance(source, np.ndarray):  # CUDA-aware: windows live in host memory
            source = source.get()
        self.win.Lock(self.rank, MPI.LOCK_EXCLUSIVE)
        if self._unified:
            np.copyto(self._published, source)
        else:
            self.win.Put([source, self.buffer.datatype], self.rank)
        self.win.Unlock(self.rank)

    def _message(self):
        """A full-size message buffer: the buffer's dtype, or its wire bytes."""
        return buffers.Transport(buffers.message(self.buffer, self._code), stage=self._stage,
                                 cuda_aware=self._cuda_aware)

    def _recv_slot(self, index):
        while len(self._recv) <= index:
            self._recv.append(self._message())
        return self._recv[index]

    def step(self) -> None:
        """One gossip round (collective only in push mode, where receivers wait for senders)."""
        self._check_open()
        if self._exchange is not None:
            return self._tolerant_step(self._mix)
        if self.mode == "pull":
            self._pull()
        elif self._pipeline is not None:
            self._mix(self.steps)
        else:
            self._push()
        self.steps += 1

    def _mix(self, r):
        """Push round ``r`` on the synchronous mixing step's pipeline (with ``on_failure="continue"``,
        atomic: a failure raises PeerFailure with ``x`` as it was)."""
        own, outs, senders, weights = self._mixing(r)
        tag = step_tag(0 if self._exchange is not None else r)   # (persistent requests keep their tags)
        self._pipeline.run(outs, senders, tag, f"step (round {r})", self_weight=own, weights=weights, step=r)
        self.buffer.release()

    def _mixing(self, r):
        """``(own weight, outs, ins, their weights)`` of push round r: x is averaged with what
        arrived, a self-push counting twice (Jin et al.)."""
        (target,) = self.topology.out_peers(self.rank, r)
        senders = [s for s in self.topology.in_peers(self.rank, r) if s != self.rank]
        self.last_peers = [target]
        own = 2.0 if target == self.rank else 1.0
        total = own + len(senders)
        return own / total, ([] if target == self.rank else [target]), senders, [1.0 / total] * len(senders)

    def _pull(self):
        r = self.steps
        self._publish()
        (target,) = self.topology.out_peers(self.rank, r)
        self.last_peers = [target]
        if target == self.rank:
            return  # averaging with one's own copy changes nothing
        slot = self._recv[0]
        self.win.Lock(target, MPI.LOCK_SHARED)
        requests = rma.rget(self.win, slot.memory, self.buffer.datatype, target)  # in pieces
        self._wait(requests, f"step (Rget, round {r})", peer=target)
        self.win.Unlock(target)
        slot.after_recv()
        kernels.weighted_sum(self.buffer.array, self.buffer.array, 0.5, [slot.buffer.array], [0.5])
        self.buffer.release()

    def _push(self):
        """A push round with a wire format: the whole x encoded once, every sender's bytes
        decoded into one fused average (no mass is kept, so the rounding error stays)."""
        r = self.steps
        tag = step_tag(r)
        own, outs, senders, weights = self._mixing(r)
        requests, peers = [], []
        self.buffer.synchronize()
        for j, src in enumerate(senders):
            requests.append(self.comm.Irecv(self._recv_slot(j).spec, source=src, tag=tag))
            peers.append(src)
        for target in outs:
            send = self._x
            if self._code is not None:
                if self._send is None:
                    self._send = self._message()
                send = self._send
                self._code.encode(self.buffer.array, send.buffer.array)
            send.before_send()
            requests.append(self.comm.Isend(send.spec, dest=target, tag=tag))
            peers.append(target)
        self._wait(requests, f"step (round {r})", peer=lambda pending: sorted({peers[i] for i in pending}))
        recvs = []
        for j in range(len(senders)):
            self._recv[j].after_recv()
            recvs.append(self._recv[j].buffer.array)
        if self._code is None:
            kernels.weighted_sum(self.buffer.array, self.buffer.array, own, recvs, weights)
        else:
            self._code.decode_sum(self.buffer.array, self.buffer.array, own, recvs, weights)
        self.buffer.release()

    def free(self) -> None:
        """Release the window and communicator (collective), and the persistent requests if no
        failure was met."""
        if not self.closed and self._exchange is not None and not self.failures:
            self._exchange.free()
        if self.win is not None and self.win != MPI.WIN_NULL:
            deadline.barrier(self.comm, timeout=self.timeout, op=f"{self._name}.free")
            self.win.Free()
        self._free_comm()

    def __repr__(self):
        state = "freed" if self.closed else "open"
        wire = "" if self.wire is None else f" wire={self.wire}"
        return (f"<Gossip mode={self.mode}{wire} {self.buffer.kind} {self.buffer.dtype} size={self.buffer.size} "
                f"rank={self.rank}/{self.size} seed={self.seed} steps={self.steps} {state}>")
