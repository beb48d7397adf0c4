"""A model's parameters (and buffers) as views of flat buffers, and their broadcast."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..core import buffers, deadline

if TYPE_CHECKING:
    from collections.abc import Sequence

    from mpi4py import MPI

    from ..core.hints import Buffer


class FlatParameters:
    """Parameters of ``module`` as views of flat buffers, one per (device, dtype) group.

    Attributes:
        groups: list of flat 1-D tensors (contiguous), in a deterministic order.
        arrays: numpy/cupy views of ``groups`` (zero-copy), for communicators and kernels.
    """

    def __init__(self, module: torch.nn.Module, *, tensors: Sequence[torch.Tensor] | None = None) -> None:
        params = list(module.parameters()) if tensors is None else list(tensors)
        if not params and tensors is None:
            raise ValueError("the model has no parameters")
        keyed: dict[Any, list[Any]] = {}
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

    def rehome(self, index: int, array: Buffer) -> None:
        """Move group ``index`` into ``array`` (a host numpy array of its size and dtype, e.g. a
        node's shared-memory segment): copy the values, re-point its parameters there."""
        old = self.groups[index]
        new = torch.from_numpy(array)
        if new.numel() != old.numel() or new.dtype != old.dtype or old.device.type != "cpu":
            raise ValueError(f"cannot move a {old.dtype} group of {old.numel()} on {old.device} into "
                             f"{new.dtype} x {new.numel()} host memory")
        with torch.no_grad():
            new.copy_(old)
        offset = 0
        for p in self.params[index]:
            n = p.numel()
            p.data = new[offset:offset + n].view_as(p)
            offset += n
        self.groups[index] = new
        self.views[index] = buffers.as_buffer(new, name="parameters")
        self.arrays[index] = self.views[index].array

    @classmethod
    def of_buffers(cls, module: torch.nn.Module) -> FlatParameters:
        """The floating-point buffers of ``module`` (BatchNorm's running statistics), flattened
        the same way (possibly no group at all)."""
        return cls(module, tensors=[b for b in module.buffers() if b.is_floating_point()])

    def check_views(self) -> None:
        """Raise if something replaced a parameter's storage (then flat buffers would be stale)."""
        for flat, members in zip(self.groups, self.params):
            base = flat.data_ptr()
            end = base + flat.numel() * flat.element_size()
            for p in members:
                if not base <= p.data.data_ptr() < end:
                    raise RuntimeError("a parameter no longer views the flat buffer "
                                       "(was param.data reassigned after wrapping?)")

    @property
    def numel(self) -> int:
        return sum(g.numel() for g in self.groups)


def broadcast_parameters(flat: FlatParameters, comm: MPI.Intracomm, root: int = 0, *,
                         timeout: float | None = None) -> None:
    """Make every rank start from root's parameters (with a deadline)."""
    timeout = deadline.check_timeout(timeout)
    for buf in flat.views:
        buf.acquire()
        host = buf.array.get() if buf.on_device else buf.array
        deadline.bcast(comm, [host, buf.datatype], root=root, timeout=timeout, op="broadcast_parameters")
        if buf.on_device:
            buf.array.set(host)
            buf.release()


def broadcast_buffers(module: torch.nn.Module, comm: MPI.Intracomm, root: int = 0, *,
                      timeout: float | None = None) -> None:
    """Make every rank start from root's buffers (BatchNorm statistics and counters)."""
    from mpi4py.util.dtlib import from_numpy_dtype
    timeout = deadline.check_timeout(timeout)
    for tensor in module.buffers():
        host = tensor.detach().cpu().numpy().copy()
        deadline.bcast(comm, [host, from_numpy_dtype(host.dtype)], root=root, timeout=timeout,
                       op="broadcast_buffers")
        with torch.no_grad():
            tensor.copy_(torch.from_numpy(host))
