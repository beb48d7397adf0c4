"""AD-PSGD's averaging (Lian et al. 2018): asynchronous, atomic pairwise averaging in
one-sided RMA windows (passive target).

Ranks are split as in the paper, into *active* (even) and *passive* (odd) ranks. A
passive rank's model lives in its ``MPI.Win.Allocate`` window; an active rank's in its
own buffer, which nobody else touches.

* An active rank's :meth:`ADPSGD.step` picks a passive peer (seeded per rank), locks its
  window exclusively, reads it, writes back ``(x_a + x_p) / 2``, unlocks, and takes the
  same average itself: both become their average, atomically for the pair, while the
  passive rank computes on.
* A passive rank's :meth:`ADPSGD.step` folds its local update into its window under an
  exclusive lock on itself, ``W += x - x_last``, then continues from ``x = W`` (which
  carries every average taken with it since its last step).

No rank ever holds two locks, so no cycle of waits (deadlock) can form; the split is the
paper's way to that end. Σx over ranks (windows for passive ranks) changes only by the
local updates: an exchange replaces two models by two copies of their mean. With Open
MPI's ``Win.Allocate`` windows on one node the target needs no progress calls; across
nodes over TCP, Open MPI's osc/rdma may (docs/CLUSTER.md).
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import numpy as np
from mpi4py import MPI

from ..core import buffers, deadline, kernels
from ..core.base import Communicator
from ..core.checks import integer_error
from . import rma

if TYPE_CHECKING:
    from ..core.hints import Buffer


class ADPSGD(Communicator):
    """AD-PSGD averaging on one flat buffer.

    Args:
        x: numpy/cupy/torch buffer, same length and dtype on every rank; updated in place
            (device buffers are staged through host memory: windows live there).
        comm: communicator (keyword-only); collective construction.
        seed: seed of the active ranks' peer choice (each draws from ``(seed, rank)``).
        timeout: seconds any wait may take before the job is aborted.
    """

    _name = "ADPSGD"
    _counters = ("steps", "exchanges")
    _state_keys = ("rng",)
    _renamed = {"step_count": "steps"}

    def __init__(self, x: Buffer, *, comm: MPI.Intracomm, seed: int = 0, timeout: float | None = None) -> None:
        super().__init__(comm, timeout)
        error = None
        error = integer_error(seed, "seed")
        self._validate(error)
        self.buffer = self._check_buffer(x, name="x")
        self.seed = seed
        self.active = self.rank % 2 == 0
        self.passives = list(range(1, self.size, 2))
        self.exchanges = 0     # averages this rank started (active) or folds it made (passive)
        self.steps = 0
        self.last_peer = None
        self._rng = random.Random(f"{seed}:{self.rank}")
        self._x = buffers.Transport(self.buffer, stage=self.buffer.on_device)
        n, itemsize = self.buffer.size, self.buffer.dtype.itemsize
        self.win = rma.allocate(self.comm, 0 if self.active else n * itemsize, itemsize, what=self._name)
        self._unified = self.win.Get_attr(MPI.WIN_MODEL) == MPI.WIN_UNIFIED
        self._scratch = np.empty(n, dtype=self.buffer.dtype)   # the peer's model / x_last
        if not self.active:
            self.window = np.frombuffer(self.win.tomemory(), dtype=self.buffer.dtype)
            self._x.before_send()
            self.win.Lock(self.rank, MPI.LOCK_EXCLUSIVE)
            self._store(self._x.memory)
            self.win.Unlock(self.rank)
            np.copyto(self._scratch, self._x.memory)
        deadline.barrier(self.comm, timeout=self.timeout, op=f"{self._name} window")

    # Own window access inside an exclusive self-lock: loads and stores in the unified
    # memory model (Open MPI's Win.Allocate), Get/Put otherwise.
    def _load(self, out):
        if self._unified:
            np.copyto(out, self.window)
        else:
            self._wait(self.win.Rget([out, self.buffer.datatype], self.rank), "step (own window)")

    def _store(self, data):
        if self._unified:
            np.copyto(self.window, data)
        else:
            self._wait(self.win.Rput([data, self.buffer.datatype], self.rank), "step (own window)")

    def step(self) -> None:
        """Active rank: average atomically with a random passive rank. Passive rank: fold
        the local update into the window and continue from it. No-op on one rank."""
        self._check_open()
        if self.passives:
            self._x.before_send()
            if self.active:
                self._average()
            else:
                self._fold()
            self._x.after_recv()
            self.buffer.release()
            self.exchanges += 1
        self.steps += 1

    def _average(self):
        peer = self._rng.choice(self.passives)
        self.last_peer = peer
        x, theirs, dt = self._x.memory, self._scratch, self.buffer.datatype
        self.win.Lock(peer, MPI.LOCK_EXCLUSIVE)
        self._wait(rma.rget(self.win, theirs, dt, peer), f"step (Rget, step {self.steps})", peer=peer)
        kernels.weighted_sum(x, x, 0.5, [theirs], [0.5])
        np.copyto(theirs, x)
        self._wait(rma.rput(self.win, theirs, dt, peer), f"step (Rput, step {self.steps})", peer=peer)
        self.win.Unlock(peer)

    def _fold(self):
        x, last = self._x.memory, self._scratch
        self.win.Lock(self.rank, MPI.LOCK_EXCLUSIVE)
        shared = np.empty_like(last) if not self._unified else self.window
        if not self._unified:
            self._load(shared)
        kernels.weighted_sum(shared, shared, 1.0, [x, last], [1.0, -1.0])  # W += x - x_last
        if not self._unified:
            self._store(shared)
        np.copyto(x, shared)
        np.copyto(last, shared)
        self.win.Unlock(self.rank)

    def drain(self) -> None:
        """Collective: once every rank has stopped averaging, passive ranks take their
        window (with the averages taken since their last step) into ``x``. Then Σx over
        ranks holds all the mass; training may go on."""
        self._check_open()
        deadline.barrier(self.comm, timeout=self.timeout, op=f"{self._name}.drain")
        if not self.active:
            self._x.before_send()
            self._fold()
            self._x.after_recv()
            self.buffer.release()
        deadline.barrier(self.comm, timeout=self.timeout, op=f"{self._name}.drain")

    def _state(self):
        return {"rng": self._rng.getstate()}

    def _load_state(self, state):
        version, internal, gauss = state["rng"]
        self._rng.setstate((version, tuple(internal), gauss))

    def free(self) -> None:
        """Collective: wait (with deadline) for every rank, then release the window."""
        if self.closed:
            return
        deadline.barrier(self.comm, timeout=self.timeout, op=f"{self._name}.free")
        self.win.Free()
        self._free_comm()

    def __repr__(self):
        role = "active" if self.active else "passive"
        state = "freed" if self.closed else "open"
        return (f"<ADPSGD {self.buffer.kind} {self.buffer.dtype} size={self.buffer.size} rank={self.rank}/"
                f"{self.size} ({role}) exchanges={self.exchanges} {state}>")
