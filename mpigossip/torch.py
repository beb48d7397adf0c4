"""torch adapter: a model's parameters in flat buffers, and one wrapper per algorithm.

:class:`FlatParameters` moves a model's parameters into one contiguous buffer per
(device, dtype) group and makes each parameter a view of it, so one message carries a
whole group. Every wrapper has the same contract::

    algo = mpigossip.torch.SGP(model, comm=comm)
    for batch in data:
        loss = criterion(model(inputs), targets)
        optimizer.zero_grad(); loss.backward(); optimizer.step()
        algo.step()

Create the wrapper before the optimizer: flattening re-points ``param.data`` (the
``Parameter`` objects the optimizer holds stay the same, so either order works, but an
optimizer that cached tensors of its own, e.g. fused state, must be built afterwards).
Wrappers work with any torch optimizer; they see only the parameters. Every wrapper takes
``timeout=`` (seconds any of its waits may take, default ``$MPIGOSSIP_TIMEOUT`` or 300).
"""

import abc
import contextlib

import numpy as np
import torch
from mpi4py import MPI

from . import buffers, deadline, kernels
from . import topology as topo_mod
from .allreduce import AllreduceAverager
from .elastic import AsyncSGD as _AsyncWorker
from .elastic import ElasticAveraging
from .gossip import Gossip
from .pushsum import PushSum
from .server import ParameterServer

from ._registry import ALGORITHMS, OPTIONS  # noqa: F401 - part of this module's API


class FlatParameters:
    """Parameters of ``module`` as views of flat buffers, one per (device, dtype) group.

    Attributes:
        groups: list of flat 1-D tensors (contiguous), in a deterministic order.
        arrays: numpy/cupy views of ``groups`` (zero-copy), for communicators and kernels.
    """

    def __init__(self, module, *, tensors=None):
        params = list(module.parameters()) if tensors is None else list(tensors)
        if not params and tensors is None:
            raise ValueError("the model has no parameters")
        keyed = {}
        for p in params:
            keyed.setdefault((str(p.device), p.dtype), []).append(p)
        self.groups, self.params = [], []
        for (device, dtype), members in sorted(keyed.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
            total = sum(p.numel() for p in members)
            flat = torch.empty(total, dtype=dtype, device=members[0].device)
            offset = 0
            for p in members:
                n = p.numel()
                flat[offset:offset + n].copy_(p.data.reshape(-1))
                p.data = flat[offset:offset + n].view_as(p)
                offset += n
            self.groups.append(flat)
            self.params.append(members)
        self.views = [buffers.as_buffer(g, name="parameters") for g in self.groups]
        self.arrays = [b.array for b in self.views]

    @classmethod
    def of_buffers(cls, module):
        """The floating-point buffers of ``module`` (BatchNorm's running statistics), flattened
        the same way (possibly no group at all)."""
        return cls(module, tensors=[b for b in module.buffers() if b.is_floating_point()])

    def check_views(self):
        """Raise if something replaced a parameter's storage (then flat buffers would be stale)."""
        for flat, members in zip(self.groups, self.params):
            base = flat.data_ptr()
            end = base + flat.numel() * flat.element_size()
            for p in members:
                if not base <= p.data.data_ptr() < end:
                    raise RuntimeError("a parameter no longer views the flat buffer "
                                       "(was param.data reassigned after wrapping?)")

    @property
    def numel(self):
        return sum(g.numel() for g in self.groups)


def broadcast_parameters(flat, comm, root=0, *, timeout=None):
    """Make every rank start from root's parameters (with a deadline)."""
    timeout = deadline.check_timeout(timeout)
    for buf in flat.views:
        buf.acquire()
        host = buf.array.get() if buf.on_device else buf.array
        deadline.bcast(comm, [host, buf.datatype], root=root, timeout=timeout, op="broadcast_parameters")
        if buf.on_device:
            buf.array.set(host)
            buf.release()


def broadcast_buffers(module, comm, root=0, *, timeout=None):
    """Make every rank start from root's buffers (BatchNorm statistics and counters)."""
    from mpi4py.util.dtlib import from_numpy_dtype
    timeout = deadline.check_timeout(timeout)
    for tensor in module.buffers():
        host = tensor.detach().cpu().numpy().copy()
        deadline.bcast(comm, [host, from_numpy_dtype(host.dtype)], root=root, timeout=timeout,
                       op="broadcast_buffers")
        with torch.no_grad():
            tensor.copy_(torch.from_numpy(host))


class _Wrapper(abc.ABC):
    """Base of the wrappers: flattens the model, broadcasts rank 0's parameters and buffers.

    Buffers (BatchNorm's running statistics) are broadcast at construction, then stay each
    rank's own (statistics of its own data) except where an algorithm says otherwise
    (AllReduce averages them every step); :meth:`consensus_buffers` gives their exact mean,
    which the consensus model uses. They are in ``model.state_dict()``, so in checkpoints.
    """

    name = "?"

    def __init__(self, model, *, comm, broadcast=True, timeout=None):
        if not isinstance(comm, MPI.Intracomm):
            raise TypeError(f"comm must be an mpi4py intracommunicator, got {comm!r}")
        self.model, self.comm = model, comm
        self.timeout = deadline.check_timeout(timeout)
        self.flat = FlatParameters(model)
        self.flat_buffers = FlatParameters.of_buffers(model)
        if broadcast:
            broadcast_parameters(self.flat, comm, timeout=self.timeout)
            broadcast_buffers(model, comm, timeout=self.timeout)
        self.steps = 0
        self.comms = [self._make(array) for array in self.flat.arrays]

    @abc.abstractmethod
    def _make(self, array):
        """The communicator (or worker) for one flat parameter group."""

    @abc.abstractmethod
    def _step(self):
        """One iteration's communication."""

    @contextlib.contextmanager
    def _ordered(self):
        """Device work queued inside runs after the user's pending work on the parameters
        (e.g. the optimizer's), and the user's later work (the next forward) after it."""
        views = self.flat.views + self.flat_buffers.views
        for buf in views:
            buf.acquire()
        yield
        for buf in views:
            buf.release()

    def step(self):
        """Call once per iteration, after ``optimizer.step()``."""
        with self._ordered():
            self._step()
        self.steps += 1

    def consensus_parameters(self):
        """Exact mean over ranks of the parameters the model evaluates (collective)."""
        return self._mean(self.model_buffers(), "consensus_parameters")

    def consensus_buffers(self):
        """Exact mean over ranks of the floating-point buffers, one host array per group of
        :attr:`flat_buffers` (collective)."""
        return self._mean(self.flat_buffers.groups, "consensus_buffers")

    def _mean(self, groups, what):
        out = []
        for g in groups:
            host = g.detach().cpu().numpy().astype(np.float64)
            deadline.allreduce(self.comm, host, timeout=self.timeout, op=f"{self.name} {what}")
            out.append(host / self.comm.Get_size())
        return out

    def model_buffers(self):
        return self.flat.groups

    def drain(self):
        """Complete every message in flight (no-op for synchronous algorithms)."""

    def state_dict(self):
        self.drain()
        return {"algorithm": self.name, "steps": self.steps}

    def load_state_dict(self, state):
        if state.get("algorithm") != self.name:
            raise ValueError(f"checkpoint is for {state.get('algorithm')!r}, not {self.name!r}")
        self.steps = int(state["steps"])

    def free(self):
        self.drain()
        for c in self.comms:
            c.free()
        self.comms = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()

    def __repr__(self):
        return f"<mpigossip.torch.{type(self).__name__} params={self.flat.numel} steps={self.steps}>"


class AllReduce(_Wrapper):
    """AllReduce SGD: after each local update, every rank takes the exact mean.

    All ranks start from the same parameters and apply the same averaged update, so
    averaging the updates (Jin et al.) equals averaging the parameters, which needs no
    snapshot of the previous parameters. Floating-point buffers (BatchNorm statistics) are
    averaged too, so that every rank holds the same model.
    """

    name = "allreduce"

    def __init__(self, model, *, comm, timeout=None):
        super().__init__(model, comm=comm, timeout=timeout)
        self.buffer_comms = [self._make(array) for array in self.flat_buffers.arrays]

    def _make(self, array):
        return AllreduceAverager(array, comm=self.comm, timeout=self.timeout)

    def _step(self):
        for c in self.comms + self.buffer_comms:
            c.average()

    def free(self):
        super().free()
        for c in self.buffer_comms:
            c.free()
        self.buffer_comms = []


class _Periodic(_Wrapper):
    """Wrappers whose communicator's own ``step()`` counts calls and communicates every
    ``tau``-th one; its counters (``_counters``) are part of the checkpoint."""

    _counters = ()

    def _step(self):
        for c in self.comms:
            c.step()

    def state_dict(self):
        state = super().state_dict()
        state["counters"] = [[getattr(c, k) for k in self._counters] for c in self.comms]
        return state

    def load_state_dict(self, state):
        super().load_state_dict(state)
        for c, values in zip(self.comms, state["counters"]):
            for key, value in zip(self._counters, values):
                setattr(c, key, int(value))


class _WithServer(_Wrapper):
    """Wrappers whose groups each have a :class:`ParameterServer` (center = initial parameters)."""

    def _server(self, array):
        server = ParameterServer(array.size, array.dtype, comm=self.comm, servers=self.servers, init=array,
                                 timeout=self.timeout)
        self.servers_.append(server)
        return server

    def center_parameters(self):
        """The center variable, one host array per group."""
        return [s.pull(np.empty(s.size_elements, s.dtype)) for s in self.servers_]

    def free(self):
        super().free()
        for s in self.servers_:
            s.free()
        self.servers_ = []


class EASGD(_WithServer, _Periodic):
    """Elastic Averaging SGD with the center on ``servers`` ranks (co-located with workers).

    ``beta`` is the center's moving rate; each of the P workers moves by ``beta / P`` (see
    :class:`mpigossip.ElasticAveraging`)."""

    name = "easgd"
    _counters = ("calls", "exchanges")

    def __init__(self, model, *, comm, beta=0.9, tau=4, servers=1, timeout=None):
        self.beta, self.tau, self.servers = beta, tau, servers
        self.servers_ = []
        super().__init__(model, comm=comm, timeout=timeout)

    def _make(self, array):
        return ElasticAveraging(array, self._server(array), beta=self.beta, tau=self.tau)


class ASGD(_WithServer):
    """Asynchronous (Downpour) SGD: push this step's update to the server, pull the center.

    Each worker pushes ``1/P`` of its local update (P = world size), so that one round of
    P pushes moves the center by the mean update, as AllReduce SGD would; pushing whole
    updates multiplies the effective learning rate by P and diverges at AllReduce's rate.
    """

    name = "asgd"

    def __init__(self, model, *, comm, servers=1, timeout=None):
        self.servers, self.servers_, self.prev, self.delta = servers, [], [], []
        super().__init__(model, comm=comm, timeout=timeout)

    def _make(self, array):
        self.prev.append(array.copy())
        self.delta.append(array.copy())
        return _AsyncWorker(array, self._server(array))

    def _step(self):
        for worker, array, prev, delta in zip(self.comms, self.flat.arrays, self.prev, self.delta):
            share = 1.0 / self.comm.Get_size()
            kernels.weighted_sum(delta, array, share, [prev], [-share])  # delta = (x - prev) / P
            worker.step(delta)                                     # center += delta; x = center
            prev[...] = array


class GossipPull(_Periodic):
    """Gossiping SGD, pull variant (one-sided RMA), every ``tau`` steps."""

    name = "gossip-pull"
    mode = "pull"
    _counters = ("calls", "rounds")

    def __init__(self, model, *, comm, tau=1, seed=0, timeout=None):
        self.tau, self.seed = tau, seed
        super().__init__(model, comm=comm, timeout=timeout)

    def _make(self, array):
        return Gossip(array, comm=self.comm, mode=self.mode, seed=self.seed, tau=self.tau, timeout=self.timeout)



class GossipPush(GossipPull):
    """Gossiping SGD, push variant, every ``tau`` steps."""

    name = "gossip-push"
    mode = "push"


class SGP(_Wrapper):
    """Stochastic Gradient Push (Algorithm 1 of Assran et al.).

    The model's parameters hold the de-biased ``z = x / w``; the numerator ``x`` lives in
    the wrapper. After ``optimizer.step()`` turned ``z`` into ``z + Δ``, :meth:`step`
    applies the same update to the numerator, ``x += Δ`` (so the gradient taken at ``z``
    is applied to ``x``, with any optimizer), mixes ``(x, w)`` with PushSum, and writes the
    new ``z = x / w`` back into the parameters in the same fused pass.
    """

    name = "sgp"
    max_delay = 0
    overlap = False

    def __init__(self, model, *, comm, topology=None, peers=1, timeout=None):
        self.topology = topology if topology is not None else topo_mod.ExponentialGraph(peers=peers)
        self.numerators = []
        super().__init__(model, comm=comm, timeout=timeout)

    def _make(self, array):
        x = array.copy()
        self.numerators.append(x)
        # Synchronous: the combine writes z in the same pass. Overlap: z is written after start().
        return PushSum(x, comm=self.comm, topology=self.topology, z=None if self.overlap else array,
                       max_delay=self.max_delay, timeout=self.timeout)

    def _apply_update(self):
        for ps, z in zip(self.comms, self.flat.arrays):
            # x += z_new - x / w, i.e. x = (1 - 1/w) x + z_new  (exactly z_new when w == 1)
            kernels.weighted_sum(ps.buffer.array, ps.buffer.array, 1.0 - 1.0 / ps.weight, [z], [1.0])

    def _step(self):
        self._apply_update()
        for ps in self.comms:
            ps.step()  # z written by the fused combine

    @property
    def weights(self):
        return [ps.weight for ps in self.comms]

    def state_dict(self):
        self.drain()
        state = super().state_dict()
        state["weights"] = self.weights
        # torch tensors, not numpy arrays: checkpoints load with torch.load(weights_only=True)
        state["numerators"] = [torch.from_numpy(np.array(x if isinstance(x, np.ndarray) else x.get()))
                               for x in self.numerators]
        state["pushsum_steps"] = [ps.step_count for ps in self.comms]
        return state

    def load_state_dict(self, state):
        super().load_state_dict(state)
        for ps, x, w, k in zip(self.comms, state["numerators"], state["weights"], state["pushsum_steps"]):
            _copy_in(ps.buffer.array, x)
            ps.weight = float(w)
            ps.step_count = int(k)
        with self._ordered():
            for z, ps in zip(self.flat.arrays, self.comms):
                kernels.debias(z, ps.buffer.array, ps.weight)


class OSGP(SGP):
    """Overlap SGP: this step's share is sent while the next forward/backward runs;
    arrivals are added at the next step, at most ``max_delay`` steps late."""

    name = "osgp"
    overlap = True

    def __init__(self, model, *, comm, topology=None, peers=1, max_delay=1, timeout=None):
        self.max_delay = max_delay
        super().__init__(model, comm=comm, topology=topology, peers=peers, timeout=timeout)

    def _step(self):
        self._apply_update()
        for ps, z in zip(self.comms, self.flat.arrays):
            if ps.started:
                ps.finish()     # add what arrived
            ps.start()          # split the share off and send it; x / w is unchanged
            kernels.debias(z, ps.buffer.array, ps.weight)

    def drain(self):
        with self._ordered():
            for ps, z in zip(self.comms, self.flat.arrays):
                if ps.started:
                    ps.finish()
                ps.drain()
                kernels.debias(z, ps.buffer.array, ps.weight)


def _copy_in(array, host):
    """Copy a host array (or CPU tensor) into a numpy or cupy array."""
    if isinstance(host, torch.Tensor):
        host = host.numpy()
    if isinstance(array, np.ndarray):
        array[...] = host
    else:
        array.set(np.ascontiguousarray(host, dtype=array.dtype))


_CLASSES = {"allreduce": AllReduce, "easgd": EASGD, "asgd": ASGD, "gossip-pull": GossipPull,
            "gossip-push": GossipPush, "sgp": SGP, "osgp": OSGP}


def make(name, model, *, comm, **options):
    """Build a wrapper by algorithm name (one of :data:`ALGORITHMS`) with its options
    (:data:`OPTIONS`, and ``timeout``, which every wrapper takes).

    Raises:
        ValueError: unknown algorithm.
        TypeError: an option that algorithm does not take (misspelled, or another algorithm's),
            naming it and the options it does take.
    """
    if name not in _CLASSES:
        raise ValueError(f"unknown algorithm {name!r}; choose from {', '.join(ALGORITHMS)}")
    accepted = OPTIONS[name] + ("timeout",)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise TypeError(f"make({name!r}): unexpected option{'s' if len(unknown) > 1 else ''} "
                        f"{', '.join(unknown)}; {name} takes {', '.join(accepted)}")
    return _CLASSES[name](model, comm=comm, **options)
