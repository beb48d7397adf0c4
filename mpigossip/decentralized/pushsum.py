"""PushSum (Stochastic Gradient Push): approximate averaging along a time-varying directed graph.

Each rank holds a numerator ``x`` (the user's buffer, updated in place) and a weight
``w``. At step k it keeps the share of ``(x, w)`` that its column of the topology's mixing
matrix gives itself (``1/(d_out+1)`` for the uniform graphs) and sends each out-peer that
peer's share, then adds what it received. Any column-stochastic matrix works (checked
at each new step, the same error on every rank); Σx and Σw over ranks (plus what is in
flight) are conserved; ``z = x / w`` converges to the average.

Two modes:

* ``step()``: synchronous. ``x`` itself is sent (zero-copy) and each receiver scales
  what it receives by the sender's share, in the same fused pass that combines. The
  buffer travels in chunks through a few receive slots per in-peer: each chunk is
  combined as soon as it has arrived, while later chunks are still on the wire, and the
  receive memory is ``slots * chunk_bytes`` per in-peer, not a copy of the model.
* ``start()`` ... ``finish()``: overlap (OSGP). ``start()`` splits off the share into a
  send buffer and posts the sends; ``finish()`` adds whatever has arrived, and blocks only
  on messages sent ``max_delay`` or more steps ago (:mod:`mpigossip.decentralized.overlap`).
  Progress comes from ``Test`` calls at step boundaries; there is no background thread.

Each mode has one schedule of messages; with ``on_failure="continue"`` it runs on the request
strategy of :mod:`mpigossip.resilience.persistent`, and a recovery salvages what it can
(:mod:`mpigossip.resilience.overlap` for overlap mode).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from mpi4py import MPI

from ..core import buffers, deadline, kernels
from ..core.base import check_chunk_bytes, tag_period
from ..core.checks import check_integer
from ..core.registry import OPTION_DEFAULTS
from ..resilience import failures
from ..resilience import overlap as overlap_recovery
from ..resilience.persistent import AlarmedRequests, PersistentRequests
from .agp import AsyncPushSum
from .overlap import Overlap, tag
from .pipeline import Pipeline
from .pushsum_base import PushSumBase

if TYPE_CHECKING:
    from ..core.hints import Buffer
    from ..topology import Topology


class PushSum(PushSumBase):
    """PushSum gossip on one flat buffer.

    Args:
        x: the numerator (numpy/cupy/torch, contiguous, same length and dtype on every
            rank); updated in place.
        comm: communicator (keyword-only).
        topology: a :mod:`mpigossip.topology` graph; default ``ExponentialGraph(peers=1)``.
        max_delay: overlap mode only: a message sent at step k must be consumed by the
            end of step ``k + max_delay`` (default 1, as OSGP's wrapper and ``--max-delay``);
            ``finish()`` blocks (with timeout) for older ones. ``PushSum(x, ...,
            max_delay=None)`` is a spelling of ``AsyncPushSum(x, ...)`` (Asynchronous Gradient
            Push: no bound, no rank ever waits): a sibling class with its own contract, not a
            PushSum (see :mod:`mpigossip.decentralized.agp`).
        weight: initial PushSum weight (1.0).
        z: optional buffer of x's kind receiving ``x / w`` in the same pass as each combine.
        timeout: seconds any wait may take before the job is aborted.
        cuda_aware, stage: see :class:`mpigossip.core.buffers.Transport`.
        chunk_bytes: ``step()`` sends and combines the buffer in chunks of this size
            (4 MiB), through ``slots`` (2) receive slots per in-peer: receive memory is
            ``slots * chunk_bytes`` per in-peer, not a copy of the model. Same on every rank.
            A staged buffer (device memory without CUDA-aware MPI) goes in one piece.
        wire: ``None`` (the buffer's dtype) or a compressed format of :mod:`mpigossip.core.wire`
            (``"bf16"``, ``"fp16"``, ``"int8"``), same on every rank. The sender keeps the
            rounding error of what it sends, so Σx over ranks and messages stays exact.
        on_failure: ``"abort"`` (a failed peer ends the job) or ``"continue"``: the
            survivors go on (:mod:`mpigossip.resilience.failures`; launch with ``mpiexec --with-ft ulfm``).
            ``step()`` then sends the buffer in one piece on persistent requests and combines
            once the whole step has arrived; at a failure every survivor learns it in that
            step, the communicator shrinks to the survivors, the topology is rebuilt over
            them, the mass the lost ranks held (or had in flight) is gone and reported in
            :attr:`failures`, and ``z = x / w`` goes on averaging the survivors. Survivors of
            a failure must end with :func:`mpigossip.resilience.failures.exit`. Overlap mode
            (``start()``/``finish()``) survives too, on persistent requests: what was in flight
            at the failure (shares sent and not yet added) is lost with it and counted in the
            weight lost. Without ``wire`` or ``join()``.
    """

    _name = "PushSum"

    def __new__(cls, *args, max_delay=OPTION_DEFAULTS["max_delay"], **kwargs):
        if cls is PushSum and max_delay is None:  # the documented spelling of Asynchronous Gradient Push
            return AsyncPushSum(*args, **kwargs)
        return super().__new__(cls)

    def __init__(self, x: Buffer, *, comm: MPI.Intracomm, topology: Topology | None = None,
                 max_delay: int | None = OPTION_DEFAULTS["max_delay"], weight: float = 1.0, z: Buffer | None = None,
                 timeout: float | None = None, cuda_aware: bool | None = None, stage: bool | None = None,
                 chunk_bytes: int = 4 << 20, slots: int = 2, wire: str | None = None,
                 on_failure: str = "abort") -> None:
        def check():
            check_integer(max_delay, "max_delay", 0, allow_none=True)  # None: AsyncPushSum (__new__)
            if max_delay >= tag_period(2) - 1:
                raise ValueError(f"max_delay must be below {tag_period(2) - 1} (this MPI's tag bound), got {max_delay}")
            return failures.check_on_failure(on_failure, wire) or check_chunk_bytes(chunk_bytes)

        super().__init__(x, comm=comm, topology=topology, weight=weight, timeout=timeout, cuda_aware=cuda_aware,
                         stage=stage, slots=slots, z=z, wire=wire, check=check,
                         same={"chunk_bytes": chunk_bytes, "slots": slots, "on_failure": on_failure})
        self.max_delay: int = max_delay  # type: ignore[assignment]  # never None here: __new__
        self._tolerate(on_failure, lambda: PersistentRequests(self))
        if self._exchange is not None:  # Σw now, against which a failure's loss is reported
            self._total_weight = deadline.allreduce(self.comm, self.weight, timeout=self.timeout,
                                                    op=f"{self._name} (total weight)")
        self._x = buffers.Transport(self.buffer, stage=stage, cuda_aware=cuda_aware)
        self._pipeline = Pipeline(self, self._x, chunk_bytes=chunk_bytes, slots=slots, stage=stage,
                                  cuda_aware=cuda_aware, wire=wire, requests=self._exchange)
        self._wrecv = np.zeros(0, dtype=np.float64)   # the synchronous step's weights received and sent
        self._wsend = np.zeros(1, dtype=np.float64)
        self._osgp: Overlap | None = None  # overlap mode's schedule (made at the first start() on a communicator)
        self._overlap = False  # whether the last step was start()/finish() (leave() steps the same way)
        self._counted = False  # (continue) this start()'s step already counts: its finish() only ends it

    @property
    def in_flight(self) -> bool:
        """Whether any overlap-mode message is still pending or unsent."""
        return bool(self._started or (self._osgp is not None and self._osgp.in_flight))

    # ------------------------------------------------------------------ synchronous
    def step(self) -> None:
        """One synchronous PushSum round along this step's out-peers (see
        :mod:`mpigossip.decentralized.pipeline`: chunked, zero-copy sends, each chunk combined as it
        arrives). Every wait has the deadline and names the peers it waits for.
        """
        self._check_open()
        if self.in_flight:
            raise RuntimeError("PushSum.step(): overlap messages are in flight; call drain() first")
        self._overlap = False
        if self._exchange is not None:
            return self._tolerant_step(self._step)
        if self._agree_members():
            return
        self._step(self.steps)
        self.steps += 1

    def _step(self, k):
        """The synchronous round at step ``k`` (with ``on_failure="continue"``, atomic: a failure
        raises PeerFailure with ``(x, w)`` as they were)."""
        op = f"step (step {k})"
        self_weight, outs, ins, shares = self._mixing(k)
        requests, comm = self._pipeline.requests, self.comm
        tolerant = self._exchange is not None
        wtag = tag(0 if tolerant else k, True)   # (persistent requests keep their tags)
        if self._wrecv.size != len(ins):
            self._wrecv = np.zeros(len(ins), dtype=np.float64)
        wrecv, wsend = self._wrecv, self._wsend
        wsend[0] = self.weight
        weights = [requests.irecv(comm, wrecv[j:j + 1], src, wtag) for j, src in enumerate(ins)]
        weights += [requests.isend(comm, wsend, dst, wtag) for dst in outs]
        if self._zbuf is not None and not tolerant:
            self._zbuf.acquire()  # the fused de-bias writes z

        def new_weight(named):
            requests.wait(weights, op, named)  # same order as the pipeline's: ins, then outs
            if tolerant:   # every message has arrived: the step combines (x as sent kept for a recovery)
                self._acquire()
                self._keep(k)
            self.weight = self_weight * self.weight + sum(s * float(wj) for s, wj in zip(shares, wrecv))
            return self.weight

        self._pipeline.run(outs, ins, tag(0 if tolerant else k), op, self_weight=self_weight, weights=shares,
                           step=k, before_combine=new_weight, z=None if self._zbuf is None else self._zbuf.array)
        self._release()

    #: ``(step, x as sent, w as sent)`` of the last synchronous step combined with
    #: ``on_failure="continue"``, or None: a recovery hands back a share that a live out-peer never
    #: added (:meth:`_settle`).
    _previous = None

    def _keep(self, k):
        """Copy ``x`` as step ``k`` sent it, with its weight (the caller holds the buffer)."""
        if self._previous is None:
            self._previous = (k, buffers.scratch(self.buffer), self.weight)
        _, copy, _ = self._previous
        kernels.weighted_sum(copy.array, self.buffer.array, 1.0)
        self._previous = (k, copy, self.weight)

    def _mixing(self, k):
        """``(self_weight, outs, ins, shares)`` at step k: ``shares[j]`` is the weight the
        topology gives the edge ``ins[j] -> self`` (its column)."""
        self.topology.check_step(k)
        self_weight, out_weights = self.topology.mixing_weights(self.rank, k)
        ins = self.topology.in_peers(self.rank, k)
        shares = [self.topology.mixing_weights(src, k)[1][self.rank] for src in ins]
        return self_weight, sorted(out_weights), ins, shares

    def _combine(self, self_weight, recvs, weights):
        z = None if self._zbuf is None else self._zbuf.array
        if self._code is not None:
            self._code.decode_sum(self.buffer.array, self.buffer.array, self_weight, recvs, weights,
                                  z=z, w=self.weight)
            return
        kernels.weighted_sum(self.buffer.array, self.buffer.array, self_weight, recvs, weights,
                             z=z, w=self.weight)

    # ------------------------------------------------------------------ overlap
    def _schedule(self, k):
        """Overlap mode's schedule over the current communicator (made at its first start():
        with on_failure="continue" collective, and it may raise PeerFailure)."""
        if self._osgp is None:
            requests = self._pipeline.requests if self._exchange is None else AlarmedRequests(self)
            self._osgp = Overlap(self, requests, k)
        return self._osgp

    def start(self) -> None:
        """Overlap mode: split off this step's share of (x, w) and post its sends and receives."""
        self._check_open()
        if self._started:
            raise RuntimeError("PushSum.start(): call finish() before the next start()")
        self._overlap = True
        if self._exchange is not None:
            return self._tolerant_start()
        if self._agree_members():
            return
        k = self.steps
        self.topology.check_step(k)
        self._schedule(k).start(k, f"start (step {k})")
        self._started = True

    def _tolerant_start(self):
        """start() with on_failure="continue": a failure met is recovered from here."""
        if self._together:
            raise RuntimeError(f"{self._name}.start(): overlap mode with on_failure='continue' recovers one "
                               "PushSum at a time, not several stepped together")
        k = self.steps
        self._started = True
        if self._skip:   # a survivor that was behind when a peer failed: this step only counts
            self._skip -= 1
            self.steps += 1
            self._counted = True
            return
        self.topology.check_step(k)
        try:
            self._schedule(k).start(k, f"start (step {k})")
        except failures.PeerFailure:
            self._recover(k)

    def finish(self) -> None:
        """Overlap mode: add every message that has arrived; block only for those
        sent ``max_delay`` or more steps ago. Ends the step."""
        self._check_open()
        if not self._started:
            raise RuntimeError("PushSum.finish(): start() was not called")
        k = self.steps
        self._started = False
        if self._counted:   # (continue) the step counted already: a recovery, or a skip
            self._counted = False
            return
        schedule = self._osgp
        assert schedule is not None   # made by start()
        try:
            schedule.finish(f"finish (step {k})", force_before=k - self.max_delay)
        except failures.PeerFailure:
            self._recover(k)
            return
        self.steps += 1

    def drain(self) -> None:
        """Wait for every message in flight and add it (overlap mode), so that (x, w)
        hold all the mass. Every rank must have run the same number of steps."""
        self._check_open()
        if self._started:
            raise RuntimeError("PushSum.drain(): call finish() first")
        if self._osgp is None:
            return
        try:
            self._osgp.drain("drain")
        except failures.PeerFailure:
            self._recover(self.steps - 1)   # what was in flight is lost; the steps stand

    def _recover(self, entry):
        """Survives' recovery, and in overlap mode: what arrived whole is added, survivors
        exchange what they had in flight to each other (the rest is lost), and a step whose
        start() met the failure counts (its finish() only ends it)."""
        schedule, self._osgp = self._osgp, None   # a new one over the survivors, at the next start()
        if schedule is not None:
            overlap_recovery.salvage(schedule)
            overlap_recovery.quiesce(schedule, self.steps, f"{self._name} (failure at step {entry})")
            schedule.requests.abandon()
            failures.keep(*schedule.memory())
        super()._recover(entry)
        if self._started:
            self._counted = True

    def _recovery_share(self, entry):
        share = super()._recovery_share(entry)
        previous = self._previous
        if not self._overlap:   # synchronous steps: what _settle needs of every survivor
            share.update(entry=entry, combined=entry - 1 if previous is None else previous[0],
                         sent=None if previous is None else previous[2])
        return share

    def _adjustment(self, share, old_rank, last, topology):
        """Synchronous steps: ``(keep, back)`` for a survivor (its ``share``, its rank
        ``old_rank`` before the shrink): its ``(x, w)`` become ``keep * (x, w) + back * (x, w)
        as sent at its last combined step`` (see :meth:`_settle`)."""
        if "entry" not in share:
            return 1.0, 0.0
        entry, combined = share["entry"], share["combined"]
        keep = back = 0.0
        if combined < entry:   # entry not combined here: take out what live out-peers added
            _, outs = topology.mixing_weights(old_rank, entry)
            keep = sum(v for dst, v in outs.items() if dst in last and last[dst].get("combined", -1) >= entry)
        if share["sent"] is not None:   # combined: add back what live out-peers never added
            _, outs = topology.mixing_weights(old_rank, combined)
            back = sum(v for dst, v in outs.items() if dst in last and last[dst].get("combined", combined) < combined)
        return 1.0 - keep, back

    def _settled_weight(self, share, old_rank, last, before):
        keep, back = self._adjustment(share, old_rank, last, before.topology)
        return keep * share["w"] + (back * share["sent"] if back else 0.0)

    def _settle(self, rec, before):
        """Synchronous steps: a step is combined whole or not at all on each rank, so a failure
        can leave two survivors split over the step it struck. From what every survivor told
        the others (the last step it combined), for each out-peer that survived:

        * this rank did not combine the step it met the failure in (it keeps ``(x, w)`` as
          sent) and the peer did, adding this rank's share: the share is taken out here (it
          was counted twice);
        * this rank combined its last step and the peer did not, so the share sent to it then
          was never added: it is added back here, from the copy of ``(x, w)`` as sent
          (:attr:`_previous`).

        The survivors' sums then hold all their mass; only the dead ranks' own and what was in
        flight to or from them is lost. (A share sent at an older step to a peer that had not
        combined it would be lost too: not seen, since a rank finishes a step only once its
        in-peers have entered it.)"""
        previous, self._previous = self._previous, None   # (of the communicator that failed)
        last = dict(zip(before.old, rec.shared))
        mine = last[before.rank]
        keep, back = self._adjustment(mine, before.rank, last, before.topology)
        if keep == 1.0 and not back:
            return
        self.buffer.acquire()
        if keep != 1.0:
            kernels.scale(self.buffer.array, keep)
        if back:
            kernels.weighted_sum(self.buffer.array, self.buffer.array, 1.0, [previous[1].array], [back],
                                 keep_recvs=True)
        self.buffer.release()
        self.weight = keep * self.weight + back * (previous[2] if back else 0.0)
        if self._zbuf is not None:
            self._acquire()
            kernels.debias(self._zbuf.array, self.buffer.array, self.weight)
            self._release()

    def _quiesce(self):
        if self.in_flight:
            self.drain()

    def leave(self) -> None:
        """Drop out (after :meth:`join` on every rank; e.g. out of data): this rank asks to
        leave in the next step, mixes in it as usual (the others learn of it only at its
        end), then at the step after hands its whole ``(x, w)`` to one survivor and takes no
        further part. The survivors go on over a communicator and a topology of their own;
        Σx and Σw over them stay exact. Afterwards ``left`` is True and this rank's ``x``
        holds its de-biased model ``x / w``. Steps the way the last step did (``step()`` or
        ``start()``/``finish()``), as the other ranks do."""
        if self._started:
            raise RuntimeError("PushSum.leave(): call finish() first")
        self.ask_leave()
        while not self.left:
            if self._overlap:
                self.start()
                if not self.left:
                    self.finish()
            else:
                self.step()

    def ask_leave(self) -> None:
        """Ask to leave in the next step, without stepping: for a caller that steps several
        PushSums together (a model's parameter groups) and keeps stepping them until ``left``
        (:meth:`leave` is this, then the steps)."""
        self._check_open()
        if self._members is None:
            raise RuntimeError("PushSum.leave(): call join() on every rank first (or use mpigossip.Join)")
        self._members.leaving = True

    def _complete(self):
        if self._started:
            self.finish()
        if self.in_flight:
            self.drain()
        if self._members is not None:  # joined and never left: the last step's flags, posted by every rank
            self._members.complete()

    def free(self) -> None:
        """Drain what is in flight, then release the communicator (collective)."""
        if not self.closed:
            self._complete()
            if self._exchange is not None and not self.failures:
                self._exchange.free()
                if self._osgp is not None:
                    self._osgp.requests.free()
        self._free_comm()

    def __repr__(self):
        state = "freed" if self.closed else (
            f"{len(self._osgp.pending)} pending, {len(self._osgp.sends)} sending" if self._osgp and self.in_flight
            else "idle")
        return (f"<PushSum {self.buffer.kind} {self.buffer.dtype} size={self.buffer.size} rank={self.rank}/"
                f"{self.size} {self.topology!r} steps={self.steps} weight={self.weight:.6g} "
                f"max_delay={self.max_delay}{'' if self.wire is None else ' wire=' + self.wire} {state}>")
