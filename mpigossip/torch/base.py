"""What every wrapper shares: flattening, the initial broadcast, device ordering, consensus,
checkpoint state, ``free()``."""

from __future__ import annotations

import abc
import contextlib
import contextvars
import copy
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from mpi4py import MPI

from ..core import deadline
from ..core.periodic import Every
from ..exact.hierarchical import Hierarchical
from ..resilience import failures
from ..resilience.tolerant import recover_together, revoke
from .flat import FlatParameters, broadcast_buffers, broadcast_parameters

if TYPE_CHECKING:
    from collections.abc import Mapping

#: Whether a wrapper built now starts every rank from rank 0's parameters and buffers (set by
#: :func:`mpigossip.torch.make`'s ``broadcast``, for every wrapper it builds, an outer method's base too).
BROADCAST: contextvars.ContextVar[bool] = contextvars.ContextVar("mpigossip_torch_broadcast", default=True)


class _Wrapper(abc.ABC):
    """Base of the wrappers: flattens the model, broadcasts rank 0's parameters and buffers.

    Buffers (BatchNorm's running statistics) are broadcast at construction, then stay each
    rank's own (statistics of its own data) except where an algorithm says otherwise
    (AllReduce averages them every step); :meth:`consensus_buffers` gives their exact mean,
    which the consensus model uses. They are in ``model.state_dict()``, so in checkpoints.
    """

    name = "?"
    on_failure = "abort"
    _agreeing = False  # agree_on_failures()
    #: Called after the wrapper's communicator has followed a failure (a training job's own
    #: communicator then follows it at once: every survivor's collectives in the same order).
    after_failure = None

    def __init__(self, model, *, comm, broadcast=True, timeout=None):
        self._freed = False
        self.failures = []  # failures survived (on_failure="continue"), as the first group recorded them
        if not isinstance(comm, MPI.Intracomm):
            raise TypeError(f"comm must be an mpi4py intracommunicator, got {comm!r}")
        self.model = model
        self.timeout = deadline.check_timeout(timeout)
        self.flat = FlatParameters(model)
        self.flat_buffers = FlatParameters.of_buffers(model)
        # A private duplicate for the wrapper's own collectives (broadcast, consensus), so they
        # never match the user's messages on ``comm``; freed by free().
        broadcast = bool(broadcast and BROADCAST.get())
        chosen = deadline.allgather(comm, broadcast, timeout=self.timeout, op=f"{type(self).__name__} (construction)")
        if len(set(chosen)) > 1:   # (some ranks would wait in the broadcast for the others)
            raise ValueError(f"{type(self).__name__}: broadcast must be the same on every rank, got "
                             f"{', '.join(f'rank {r}: {b}' for r, b in enumerate(chosen))}")
        self.comm = comm.Dup()
        try:
            if broadcast:
                broadcast_parameters(self.flat, self.comm, timeout=self.timeout)
                broadcast_buffers(model, self.comm, timeout=self.timeout)
            self.steps = 0
            self.comm_time_s = 0.0  # seconds inside the algorithm's communication, wherever it runs
            self._rehomed = []  # groups moved into a node's shared window (hierarchical)
            self.comms = [self._make(array) for array in self.flat.arrays]
            if self.on_failure == "continue":
                self._group_failures()
        except BaseException:
            self.comm.Free()
            raise

    @abc.abstractmethod
    def _make(self, array):
        """The communicator (or worker) for one flat parameter group."""

    def _hierarchical(self, array, inter, *, rehome=True, **options):
        """A :class:`~mpigossip.Hierarchical` communicator for one parameter group. A host
        group (``rehome``) moves into the node's shared window, so a step copies nothing in
        or out; a device group is staged through it."""
        common = dict(comm=self.comm, inter=inter, node_size=getattr(self, "node_size", None), timeout=self.timeout)
        if not isinstance(array, np.ndarray):
            return Hierarchical(array, **common, **options)
        h = Hierarchical.allocate(array.size, array.dtype, **common, **options)
        if rehome:
            index = next(i for i, a in enumerate(self.flat.arrays) if a is array)
            self.flat.rehome(index, h.array)
            self._rehomed.append(index)
        else:
            h.array[:] = array
        return h

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

    @property
    def closed(self) -> bool:
        """Whether :meth:`free` has run."""
        return self._freed

    def _check_open(self):
        """Raise on any use after :meth:`free` (a step that silently did nothing would let the
        ranks' models drift apart with exit status 0)."""
        if self._freed:
            raise RuntimeError(f"mpigossip.torch.{type(self).__name__} ({self.name}) has been freed")

    def step(self) -> None:
        """Call once per iteration, after ``optimizer.step()``."""
        self._check_open()
        t0 = time.perf_counter()
        with self._ordered():
            self._surviving(self._step)
        if self.on_failure == "continue":
            self._follow_failures()
        self.comm_time_s += time.perf_counter() - t0
        self.steps += 1

    def _check_on_failure(self, on_failure, refused=None):
        """Validate ``on_failure=`` (``refused``: why this configuration cannot continue) and keep it."""
        error = failures.check_on_failure(on_failure)
        if error is None and on_failure == "continue" and refused:
            error = f"{self.name}: on_failure='continue' {refused}"
        if error:
            raise ValueError(error)
        self.on_failure = on_failure

    def _tolerant_groups(self):
        """The communicators that survive failures, in the order ``_step`` steps them. With
        more than one (several dtypes or devices; AllReduce's floating-point buffers), a failure
        met in any goes to :meth:`step`, which recovers them together
        (:func:`mpigossip.resilience.tolerant.recover_together`): each recovering on its own, a survivor
        could shrink one group while another waits in a later group's exchange with it."""
        return self.comms

    def _surviving(self, run):
        """``run()`` (the groups' exchanges, in order); a failure met by one of several groups
        (``_tolerant_groups``) recovers them together, and with :meth:`agree_on_failures` the
        survivors first agree whether any met one. Returns whether they recovered."""
        try:
            run()
            met = False
        except failures.PeerFailure:
            met = True
        groups = self._tolerant_groups()
        if self._agreeing:
            if met:
                revoke(groups)  # (a survivor waiting in another group's exchange fails out of it)
            met = failures.agree_failed(groups[0].comm, met, timeout=self.timeout,
                                        op=f"{self.name} (did a rank fail in step {self.steps}?)")
        if met:
            recover_together(groups)
        return met

    def _group_failures(self):
        """After the groups are made (``on_failure="continue"``): several recover together."""
        groups = self._tolerant_groups()
        for c in groups:
            c._together = len(groups) > 1 or self._agreeing

    def agree_on_failures(self) -> None:
        """``on_failure="continue"``, for a caller that steps this wrapper only now and then (an
        outer optimizer's averages): after each step the survivors agree whether a rank failed in
        it (:func:`mpigossip.resilience.failures.agree_failed`) and all recover in that step, so that they
        meet the failure at the same iteration of their loop (and their checkpoints and
        evaluations, collectives between those steps, stay matched). One ``MPI_Comm_agree`` a
        step."""
        self._agreeing = True
        self._group_failures()

    def _follow_failures(self):
        """Once every group's communicator has recovered from a failure (each shrank in the same
        order on every survivor), the wrapper's own communicator (consensus, evaluation)
        shrinks to the survivors too."""
        groups = self._tolerant_groups()
        if min(len(c.failures) for c in groups) > len(self.failures):
            self.comm = failures.shrink(self.comm, self.steps, timeout=self.timeout,
                                        op=f"{self.name} (the wrapper's communicator)").comm
            self.failures.append(dict(groups[0].failures[len(self.failures)]))
            if self.after_failure is not None:
                self.after_failure()

    def consensus_model(self, into: torch.nn.Module | None = None) -> torch.nn.Module:
        """Collective (every rank calls it, not only the one that evaluates): the consensus
        model, whose parameters and floating-point buffers (BatchNorm statistics) are their
        exact means over ranks; other buffers are this rank's. The model to evaluate with a
        decentralized algorithm, whose ranks' own models differ.

        Args:
            into: a model of the same architecture to load it into (reused across
                evaluations), or None for a new copy of the wrapped model.

        Returns:
            ``into``, or the new model (in the wrapped model's training mode).
        """
        return self.load_consensus(self.consensus_parameters(), self.consensus_buffers(), into=into)

    def load_consensus(self, parameters: list[np.ndarray], buffers: list[np.ndarray],
                       into: torch.nn.Module | None = None) -> torch.nn.Module:
        """Load means as returned by :meth:`consensus_parameters` and :meth:`consensus_buffers`
        into ``into`` (or a new copy of the model); not collective."""
        if into is None:
            model = copy.deepcopy(self.model)
        else:
            model = into
            model.load_state_dict(self.model.state_dict())
        targets = dict(model.named_parameters())
        targets.update(model.named_buffers())
        names = {id(t): n for n, t in self.model.named_parameters()}
        names.update((id(t), n) for n, t in self.model.named_buffers())
        with torch.no_grad():
            for flat, means in ((self.flat, parameters), (self.flat_buffers, buffers)):
                for members, mean in zip(flat.params, means):
                    at = 0
                    for t in members:
                        n = t.numel()
                        dst = targets[names[id(t)]]
                        dst.copy_(torch.from_numpy(mean[at:at + n]).view_as(dst))
                        at += n
        return model

    def consensus_parameters(self) -> list[np.ndarray]:
        """Exact mean over ranks of the parameters the model evaluates: one float64 host
        array per group of :attr:`flat` (collective: every rank calls it)."""
        return self._mean(self.model_buffers(), "consensus_parameters")

    def consensus_buffers(self) -> list[np.ndarray]:
        """Exact mean over ranks of the floating-point buffers: one float64 host array per
        group of :attr:`flat_buffers` (collective: every rank calls it)."""
        return self._mean(self.flat_buffers.groups, "consensus_buffers")

    def _mean(self, groups, what):
        self._check_open()
        out = []
        op = f"{self.name} {what} (collective: every rank must call it)"
        for g in groups:
            host = g.detach().cpu().numpy().astype(np.float64)
            deadline.allreduce(self.comm, host, timeout=self.timeout, op=op)
            out.append(host / self.comm.Get_size())
        return out

    def model_buffers(self) -> list[torch.Tensor]:
        return self.flat.groups

    def drain(self) -> None:
        """Complete every message in flight (no-op for synchronous algorithms)."""

    def _stateful(self):
        """The objects whose ``state_dict()`` is part of this wrapper's (in a fixed order)."""
        return [c for c in self.comms if c is not None]

    def state_dict(self) -> dict[str, Any]:
        """``{"algorithm", "steps", "comms"}``: each communicator's own ``state_dict()``
        (counters, PushSum weight, EASGD center...) after :meth:`drain` (collective)."""
        self._check_open()
        self.drain()
        return {"algorithm": self.name, "steps": self.steps,
                "comms": [_tensors(c.state_dict()) for c in self._stateful()]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` (collective where a communicator's is)."""
        self._check_open()
        if state.get("algorithm") != self.name:
            raise ValueError(f"checkpoint is for {state.get('algorithm')!r}, not {self.name!r}")
        if "comms" not in state:
            raise ValueError(f"{self.name}: this checkpoint is from an older mpigossip (no 'comms' state); "
                             "resume it with the version that wrote it")
        stateful = self._stateful()
        if len(state["comms"]) != len(stateful):
            raise ValueError(f"{self.name}: the checkpoint has {len(state['comms'])} communicator states, "
                             f"this model needs {len(stateful)}")
        self.steps = int(state["steps"])
        for c, s in zip(stateful, state["comms"]):
            c.load_state_dict(s)

    def free(self) -> None:
        """Complete what is in flight and release the MPI resources (collective); a second
        call does nothing, any other use afterwards raises ``RuntimeError``."""
        if self._freed:
            return
        self.drain()
        for index in self._rehomed:  # the window goes: give the parameters private memory again
            self.flat.rehome(index, self.flat.arrays[index].copy())
        self._rehomed = []
        for c in self.comms:
            c.free()
        self.comms = []
        self._freed = True
        self.comm.Free()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()

    def __repr__(self):
        return f"<mpigossip.torch.{type(self).__name__} params={self.flat.numel} steps={self.steps}>"


class _Periodic(_Wrapper):
    """Wrappers that communicate every ``tau`` steps: each communicator is wrapped in
    :class:`mpigossip.core.periodic.Every`."""

    def _every(self, c):
        return Every(c, self.tau)

    def _step(self):
        for c in self.comms:
            c.step()


def _tensors(state):
    """``state`` with numpy arrays as torch tensors (checkpoints load with
    ``torch.load(weights_only=True)``), nested dicts and lists included."""
    if isinstance(state, dict):
        return {k: _tensors(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_tensors(v) for v in state]
    if isinstance(state, np.ndarray):
        return torch.from_numpy(state)
    return state
