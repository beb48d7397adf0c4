"""What PushSum (synchronous and overlap) and Asynchronous Gradient Push share: a numerator
``x`` (the user's buffer, updated in place) and a weight ``w`` mixed along a directed
graph, the de-biased ``z = x / w``, the checks of the construction and the saved state.

The two are siblings over :class:`PushSumBase`, not one a subclass of the other: their
steps differ in contract (PushSum's ranks run in lockstep, AGP's never wait), so
``isinstance(obj, PushSum)`` tells which contract an object keeps.
"""

from . import buffers, kernels
from . import topology as topo_mod
from . import wire as wire_mod
from ._base import Communicator
from ._pipeline import bind_mixing


class PushSumBase(Communicator):
    """A numerator ``x`` and its PushSum weight ``w`` on one flat buffer (see
    :class:`~mpigossip.PushSum` and :class:`~mpigossip.agp.AsyncPushSum`).

    Attributes:
        buffer: the :class:`~mpigossip.buffers.Buffer` of ``x``.
        weight: ``w`` (1.0 at start); Σw over ranks is conserved.
        steps: steps taken.
        topology: the graph, bound to the world size.
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
            self.topology = bind_mixing(topology, topo_mod.ExponentialGraph(peers=1), self.size, slots=slots,
                                        what="PushSum needs distinct peers")
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

    def _new_transport(self):
        """A full-size message buffer: the buffer's dtype, or its wire bytes."""
        return buffers.Transport(buffers.message(self.buffer, self._code), stage=self._stage,
                                 cuda_aware=self._cuda_aware)

    @property
    def started(self):
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
        return {"weight": self.weight}

    def _load_state(self, state):
        self.weight = float(state["weight"])

    def debiased(self):
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
    def z(self):
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
