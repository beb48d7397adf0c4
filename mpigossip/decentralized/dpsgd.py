"""D-PSGD's averaging (Lian et al. 2017): synchronous neighbour averaging with a doubly
stochastic mixing matrix.

At every step each rank sends ``x`` to its neighbours and receives theirs, then
``x_i = W_ii x_i + sum_j W_ij x_j`` in one fused pass, chunk by chunk as messages arrive
(the same zero-copy pipeline as synchronous PushSum: :mod:`mpigossip.decentralized.pipeline`). ``W``
must be doubly stochastic (checked at every new step, the same error naming the row or
column on every rank), so the plain mean of ``x`` over ranks is preserved: there is no
weight to de-bias. The undirected graphs of :mod:`mpigossip.topology.undirected` give
symmetric ``W`` (Metropolis-Hastings or lazy weights); a directed regular graph
(``ExponentialGraph``) is doubly stochastic too and is accepted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .. import topology as topo_mod
from ..core import buffers
from ..core.base import Communicator, check_chunk_bytes, step_tag
from ..resilience import failures
from ..resilience.persistent import PersistentRequests
from ..resilience.tolerant import Survives
from .pipeline import Pipeline, bind_mixing

if TYPE_CHECKING:
    from mpi4py import MPI

    from ..core.hints import Buffer
    from ..topology import Topology


class DPSGD(Survives, Communicator):
    """D-PSGD averaging on one flat buffer.

    Args:
        x: numpy/cupy/torch buffer, same length and dtype on every rank; updated in place.
        comm: communicator (keyword-only).
        topology: a doubly stochastic topology; default ``UndirectedRing()`` (the paper's).
        timeout: seconds any wait may take before the job is aborted.
        cuda_aware, stage: see :class:`mpigossip.core.buffers.Transport`.
        chunk_bytes, slots: pipelining, as for :class:`mpigossip.PushSum`; same on every rank.
        wire: ``None`` or a compressed format of :mod:`mpigossip.core.wire`, as for
            :class:`mpigossip.PushSum` (the sender keeps its rounding error: the mean over
            ranks stays exact).
        on_failure: ``"abort"`` or ``"continue"``: the survivors of a failed rank go on over
            the topology rebuilt for them (doubly stochastic again, so their mean is kept from
            then on; the step that met the failure leaves ``x`` as it was); as for
            :class:`mpigossip.PushSum` (one piece, persistent requests; not with ``wire``).
            ``failures`` records each failure (``step``, ``ranks``, ``size``, ``seconds``),
            ``members`` the original ranks still taking part.
    """

    _name = "DPSGD"
    _renamed = {"step_count": "steps"}

    def __init__(self, x: Buffer, *, comm: MPI.Intracomm, topology: Topology | None = None,
                 timeout: float | None = None, cuda_aware: bool | None = None, stage: bool | None = None,
                 chunk_bytes: int = 4 << 20, slots: int = 2, wire: str | None = None,
                 on_failure: str = "abort") -> None:
        super().__init__(comm, timeout)
        error = check_chunk_bytes(chunk_bytes) or failures.check_on_failure(on_failure, wire)
        try:
            self._graph = (topology, slots)
            self.topology = self._bind_topology()
        except (TypeError, ValueError) as exc:
            error = error or str(exc)
        self._validate(error)
        self.buffer = self._check_buffer(x, name="x", same={"chunk_bytes": chunk_bytes, "slots": slots,
                                                           "on_failure": on_failure}, wire=wire)
        self.wire = wire
        self.steps = 0
        self.members = list(range(self.size))
        self.failures: list[Any] = []
        self._stage, self._cuda_aware = stage, cuda_aware
        self._x = buffers.Transport(self.buffer, stage=stage, cuda_aware=cuda_aware)
        self._tolerate(on_failure, lambda: PersistentRequests(self))
        self._pipeline = Pipeline(self, self._x, chunk_bytes=chunk_bytes, slots=slots, stage=stage,
                                  cuda_aware=cuda_aware, wire=wire, requests=self._exchange)

    def _bind_topology(self):
        topology, slots = self._graph
        bound = bind_mixing(topology, topo_mod.UndirectedRing(), self.size, slots=slots,
                            what="D-PSGD needs distinct neighbours")
        bound.check_step(0, doubly=True)
        return bound

    def _mixing(self, k):
        """``(self_weight, outs, ins, weights)`` at step k (W's row and column of this rank)."""
        self.topology.check_step(k, doubly=True)
        self_weight, out_weights = self.topology.mixing_weights(self.rank, k)
        ins = self.topology.in_peers(self.rank, k)
        weights = [self.topology.mixing_weights(src, k)[1][self.rank] for src in ins]
        return self_weight, sorted(out_weights), ins, weights

    def step(self) -> None:
        """One averaging round with this step's neighbours (collective over the graph)."""
        self._check_open()
        if self._exchange is not None:
            return self._tolerant_step(self._step)
        self._step(self.steps)
        self.steps += 1

    def _step(self, k):
        """The round at step ``k`` (with ``on_failure="continue"``, atomic: a failure raises
        PeerFailure with ``x`` as it was)."""
        self_weight, outs, ins, weights = self._mixing(k)
        tag = step_tag(0 if self._exchange is not None else k)   # (persistent requests keep their tags)
        self._pipeline.run(outs, ins, tag, f"step (step {k})", self_weight=self_weight, weights=weights, step=k)
        self.buffer.release()

    def free(self) -> None:
        """Release the communicator (and the persistent requests, if no failure was met)."""
        if not self.closed and self._exchange is not None and not self.failures:
            self._exchange.free()
        super().free()

    def __repr__(self):
        state = "freed" if self.closed else "open"
        return (f"<DPSGD {self.buffer.kind} {self.buffer.dtype} size={self.buffer.size} rank={self.rank}/"
                f"{self.size} {self.topology!r}{'' if self.wire is None else ' wire=' + self.wire} steps={self.steps} "
                f"{state}>")
