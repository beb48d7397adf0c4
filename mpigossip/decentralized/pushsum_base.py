"""What PushSum (synchronous and overlap) and Asynchronous Gradient Push share: a numerator
``x`` (the user's buffer, updated in place) and a weight ``w`` mixed along a directed
graph, the de-biased ``z = x / w``, the checks of the construction and the saved state.

The two are siblings over :class:`PushSumBase`, not one a subclass of the other: their
steps differ in contract (PushSum's ranks run in lockstep, AGP's never wait), so
``isinstance(obj, PushSum)`` tells which contract an object keeps.
"""

from __future__ import annotations

from mpi4py import MPI

from .. import topology as topo_mod
from ..core import buffers, kernels
from ..core import wire as wire_mod
from ..core.base import Communicator
from ..core.hints import Buffer
from ..resilience import heal, membership
from ..resilience.tolerant import Survives
from .pipeline import bind_mixing


class PushSumBase(Survives, Communicator):
    """A numerator ``x`` and its PushSum weight ``w`` on one flat buffer (see
    :class:`~mpigossip.PushSum` and :class:`~mpigossip.decentralized.agp.AsyncPushSum`).

    Attributes:
        buffer: the :class:`~mpigossip.core.buffers.Buffer` of ``x``.
        weight: ``w`` (1.0 at start); Σw over ranks is conserved.
        steps: steps taken.
        topology: the graph, bound to the world size.
        members: the ranks of the communicator given at construction that still take part
            (all of them unless ranks left: :meth:`join`), in the order of ``comm``'s ranks.
        departures: ``[(step, [ranks]), ...]``: the ranks (of the original communicator) that
            left at each step.
        left: whether this rank has left (then its ``x`` holds its de-biased model).
        failures: ``[{"step", "ranks", "size", "weight_lost", "scaled_by", "seconds"}, ...]``:
            each failure survived (``on_failure="continue"``): the ranks lost (of the original
            communicator), the size after, the weight Σw lost with them (their own and what
            was in flight to or from them, the same on every survivor), the power of two every
            survivor's ``(x, w)`` was then multiplied by (:func:`mpigossip.resilience.heal.rescale`:
            Σw back above half the survivors, so that a heavy loss does not grow SGP's step on
            ``z``; ``z`` unchanged exactly) and the recovery time.
    """

    _name = "PushSum"
    _renamed = {"step_count": "steps"}
    _state_keys = ("weight",)

    def __init__(self, x, *, comm, topology, weight, timeout, cuda_aware, stage, slots, z=None, wire=None,
                 same=None, check=None):
        """``check()`` returns this rank's problem with the subclass's own arguments (a
        string) or None; ``same`` names settings that must be equal on every rank."""
        super().__init__(comm, timeout)
        error = None
        try:
            error = check() if check is not None else None
            self._graph = (topology, slots)  # rebound when ranks leave
            self.topology = self._bind_topology()
            if not float(weight) > 0:
                raise ValueError(f"weight must be > 0, got {weight!r}")
        except (TypeError, ValueError) as exc:
            error = error or str(exc)
        self._validate(error)
        zbuf, zerror = _check_z(z, x)  # raised on every rank with x's checks
        self.buffer = self._check_buffer(x, name="x", same=same, error=zerror, wire=wire)
        self.wire = wire
        self._code = None if wire is None else wire_mod.Wire(wire, self.buffer.dtype, seed=self.rank)
        self.weight = float(weight)
        self.steps = 0
        self._cuda_aware, self._stage = cuda_aware, stage
        self._zbuf, self._z_user = zbuf, z
        self._started = False
        self.members = list(range(self.size))
        self.departures = []
        self.left = False
        self._members = None  # a membership.Membership once joined
        self.failures = []  # failures survived (on_failure="continue": resilience.tolerant.Survives)

    def _bind_topology(self):
        topology, slots = self._graph
        return bind_mixing(topology, topo_mod.ExponentialGraph(peers=1), self.size, slots=slots,
                           what="PushSum needs distinct peers")

    # ------------------------------------------------------------------ leaving
    def _check_open(self):
        if getattr(self, "left", False):
            raise RuntimeError(f"{self._name}: this rank has left (leave()); its x holds its de-biased model")
        super()._check_open()

    def join(self) -> None:
        """Collective: from the next step on, a rank may :meth:`leave` (each step then posts
        one small nonblocking ``Iallreduce`` of who asks to leave). Every rank calls it at
        the same step (checked: the same error on every rank). See :class:`mpigossip.Join`."""
        self._check_open()
        if self._started:
            raise RuntimeError(f"{self._name}.join(): call finish() first")
        if self._exchange is not None:
            raise RuntimeError(f"{self._name}.join(): not with on_failure='continue'")
        membership.check_join(self.comm, self.steps, self._members is not None, timeout=self.timeout,
                              op=f"{self._name}.join")
        self._members = membership.Membership(self.comm, timeout=self.timeout, op=self._name)

    def _agree_members(self):
        """At the top of a step once joined: learn who left at the last step and regroup
        without them, then post this step's flags. True if this rank has just left."""
        if self._members is None:
            return False
        leaving = self._members.agreed()
        if leaving:
            self._regroup(leaving)
            if self.left:
                return True
        self._members.post()
        return False

    def _quiesce(self):
        """Complete every message in flight before the membership changes (override)."""

    def _regroup(self, leaving):
        """The agreed step of a departure: messages in flight completed, each leaver's (x, w)
        handed to a survivor, a new communicator and topology over the survivors."""
        op = f"{self._name} (ranks leaving at step {self.steps})"
        self._quiesce()
        membership.hand_off(self, leaving, op=op)
        new = membership.regroup(self.comm, leaving, timeout=self.timeout, op=op)
        gone = set(leaving)
        self.departures.append((self.steps, [self.members[r] for r in leaving]))
        self.members = [m for r, m in enumerate(self.members) if r not in gone]
        self.comm.Free()
        if new == MPI.COMM_NULL:
            self.comm, self.left, self._members = MPI.COMM_NULL, True, None
            return
        self.comm, self._owns_comm = new, True
        self.rank, self.size = new.Get_rank(), new.Get_size()
        self.topology = self._bind_topology()
        self._members = membership.Membership(new, timeout=self.timeout, op=self._name)

    # ------------------------------------------------------------------ failures
    def _recovery_share(self, entry):
        return {"w": self.weight}

    def _settled_weight(self, share, old_rank, last, before):
        """A survivor's weight once :meth:`_settle` has run on it (``share`` what it told the
        others; ``last`` the survivors' shares by their rank before the shrink)."""
        return share["w"]

    def _lost_mass(self, rec, before):
        """The weight Σw lost with the failed ranks (their own and what was in flight to or from
        them): the same number on every survivor, from what each told the others."""
        last = dict(zip(before.old, rec.shared))
        total = sum(self._settled_weight(share, r, last, before) for r, share in last.items())
        lost, scale = self._total_weight - total, heal.rescale(total, self.size)
        if scale != 1.0:   # (every survivor alike: the same total and size)
            self._scale_mass(scale)
        self._total_weight = total * scale
        return {"weight_lost": lost, "scaled_by": scale}

    def _scale_mass(self, scale):
        """``(x, w) *= scale`` (a power of two: z, Σx/Σw unchanged exactly). Only where no
        message is in flight: right after a recovery."""
        self.buffer.acquire()
        kernels.scale(self.buffer.array, scale)
        self.buffer.release()
        self.weight *= scale

    def _new_transport(self):
        """A full-size message buffer: the buffer's dtype, or its wire bytes."""
        return buffers.Transport(buffers.message(self.buffer, self._code), stage=self._stage,
                                 cuda_aware=self._cuda_aware)

    @property
    def started(self) -> bool:
        """Whether ``start()`` was called and ``finish()`` not yet."""
        return self._started

    def _acquire(self):
        """Order the device work queued here after the user's pending work on x (and z)."""
        self.buffer.acquire()
        if self._zbuf is not None:
            self._zbuf.acquire()

    def _release(self):
        """Order the user's later work on x (and z) after the device work queued here."""
        self.buffer.release()
        if self._zbuf is not None:
            self._zbuf.release()

    def _state(self):
        state = {"weight": self.weight}
        if getattr(self, "_total_weight", None) is not None:   # (on_failure="continue") Σw, as a failure's loss
            state["total_weight"] = float(self._total_weight)  # is reckoned from: not n after a loss or a heal
        return state

    def _load_state(self, state):
        self.weight = float(state["weight"])
        if "total_weight" in state and getattr(self, "_total_weight", None) is not None:
            self._total_weight = float(state["total_weight"])

    def debiased(self) -> Buffer:
        """``z = x / w`` now, in a buffer of x's kind that is reused across calls."""
        self._check_open()
        if self._zbuf is None:
            self._zbuf = buffers.scratch(self.buffer)
            self._z_user = self.buffer.like(self._zbuf.array)
        self._acquire()
        kernels.debias(self._zbuf.array, self.buffer.array, self.weight)
        self._release()
        return self._z_user

    @property
    def z(self) -> Buffer | None:
        """The de-biased buffer as last written (by ``debiased()`` or a fused combine), or None."""
        return self._z_user


def _check_z(z, x):
    """``(Buffer of z or None, this rank's problem with z or None)``: z must match x."""
    if z is None:
        return None, None
    try:
        zbuf = buffers.as_buffer(z, name="z")
    except (TypeError, ValueError) as exc:
        return None, str(exc)
    try:
        xbuf = buffers.as_buffer(x, name="x")
    except (TypeError, ValueError):
        return zbuf, None  # x's own problem: check_buffer reports it
    if buffers.describe(zbuf) != buffers.describe(xbuf):
        return zbuf, f"z must match x ({xbuf}), got {zbuf}"
    return zbuf, None
