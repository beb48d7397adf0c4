"""AllReduce SGD as DDP and Horovod do it: gradients averaged in buckets during the backward pass."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from ..core import buffers
from ..exact.allreduce import AllreduceAverager
from ..exact.ring import Layout
from ..resilience import failures
from .allreduce import AllReduce

if TYPE_CHECKING:
    from mpi4py import MPI


class _Bucket:
    """A contiguous range of one group's gradient buffer (``view``), averaged by one ``Iallreduce``."""

    __slots__ = ("averager", "view", "params", "last", "ready", "started", "touched")

    def __init__(self, averager: Any, view: Any, params: Any, last: Any) -> None:
        self.averager, self.view, self.params, self.last = averager, view, params, last
        self.ready: set[int] = set()
        self.started = False
        self.touched = False   # on_failure="continue": its mean began in this pass (its averager keeps the gradients)


class GradientAllReduce(AllReduce):
    """AllReduce SGD with gradient averaging overlapped with the backward pass.

    Each parameter's gradient is copied, as soon as autograd has accumulated it, into a flat
    gradient buffer split into buckets of about ``bucket_mb`` MB, last layers first (their
    gradients are ready first); a full bucket starts its nonblocking ``Iallreduce`` at once,
    while the backward pass goes on with earlier layers (the bucket of the first layers,
    complete only when backward ends, is averaged by the blocking chunked ``Allreduce``).
    As DDP does, the buckets are completed at the end of the backward pass (an autograd
    callback) and every ``param.grad`` becomes a view of the averaged buffer: when
    ``backward()`` returns, the gradients are the mean over ranks, so gradient clipping,
    logging of norms and any optimizer (Adam included) see what single-process training on
    the union of the batches would. ``step()`` after ``optimizer.step()`` then only averages
    the floating-point buffers (BatchNorm statistics), as :class:`AllReduce` does.

    Contract: every rank runs the same number of ``backward()`` passes; a parameter that
    gets no gradient in a pass contributes zeros. Several passes before one
    ``optimizer.step()`` (gradient accumulation) sum their averaged gradients, as on one
    process. No process-wide hook: the wrapper touches only its own parameters' hooks and
    the backward pass that fires them (``torch.autograd.grad`` fills no ``.grad`` and is
    not averaged).

    Args:
        model: the torch module.
        comm: communicator (keyword-only).
        bucket_mb: bucket size in MB (25, as DDP's default).
        wire: ``None`` or a compressed format of :mod:`mpigossip.core.wire` for the gradients
            (DDP's ``fp16_compress_hook`` / ``bf16_compress_hook``, and int8); the
            BatchNorm statistics stay exact.
        on_failure: ``"abort"`` or ``"continue"``: the survivors of a failed rank go on
            (launched with ULFM: :mod:`mpigossip.resilience.failures`). The buckets and their
            overlap with the backward pass stay (each bucket's averager on the flat ring's
            persistent requests; no ``wire``); the survivors agree whether a rank failed in
            the pass (one ``MPI_Comm_agree`` a pass) and, if one did, every bucket recovers and
            means this rank's own gradients again over the survivors, so that every survivor
            steps with the same mean and the models stay equal.
        timeout: seconds any wait may take.
    """

    name = "allreduce"

    def __init__(self, model: torch.nn.Module, *, comm: MPI.Intracomm, bucket_mb: float = 25, wire: str | None = None,
                 on_failure: str = "abort", timeout: float | None = None) -> None:
        if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be a positive number, got {bucket_mb!r}")
        error = failures.check_on_failure(on_failure, wire)
        if error:
            raise ValueError(f"allreduce: {error}")
        self.bucket_bytes = max(1, int(bucket_mb * (1 << 20)))
        self.grad_views: list[Any] = []
        self.buckets: list[Any] = []
        self._where: dict[Any, Any] = {}
        self._layout: Any = None
        self.on_failure = on_failure  # (before the groups are made)
        super().__init__(model, comm=comm, wire=wire, on_failure=on_failure, timeout=timeout)
        if self.on_failure == "continue":
            self.agree_on_failures()  # the buffers' averages too: every survivor recovers in the same step
        self._next = 0  # the next bucket to start: in list order on every rank
        self._pending = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._where]

    def _make(self, array):
        """The gradient buffer and buckets of the next parameter group (called in group order;
        with ``on_failure="continue"`` each bucket's averager survives failures)."""
        g = len(self.grad_views)
        flat, members = self.flat.groups[g], self.flat.params[g]
        grad = torch.zeros_like(flat)
        view = buffers.as_buffer(grad, name="gradients")
        self.grad_views.append(view)
        offsets, at = [], 0
        for p in members:
            offsets.append(at)
            at += p.numel()
        hi, size, group = at, 0, []
        itemsize = flat.element_size()
        for p, lo in reversed(list(zip(members, offsets))):
            group.append((p, lo))
            size += p.numel() * itemsize
            if size >= self.bucket_bytes or lo == 0:
                # Every bucket on the wrapper's private communicator (not a duplicate each: a
                # 1B-parameter model has ~160 buckets, and context ids are finite); so buckets
                # start in one order on every rank.
                if self._layout is None:  # one node communicator (and one cross-node) for all buckets
                    self._layout = Layout(self.comm, timeout=self.timeout)
                tolerant = {} if self.on_failure == "abort" else {"on_failure": "continue"}
                averager = AllreduceAverager(view.array[lo:hi], comm=self.comm, timeout=self.timeout, dup=False,
                                             wire=self.wire, layout=self._layout, **tolerant)
                bucket = _Bucket(averager, view, [q for q, _ in group], last=lo == 0)
                self.buckets.append(bucket)
                for q, start in group:
                    self._where[q] = (bucket, grad[start:start + q.numel()].view_as(q))
                hi, size, group = lo, 0, []
        return None

    # -- during backward -------------------------------------------------------------
    def _on_grad(self, p):
        bucket, view = self._where[p]
        if not self._pending:  # the first gradient of this pass: complete them all when it ends
            torch.autograd.Variable._execution_engine.queue_callback(self.synchronize)
        if p in bucket.ready:
            raise RuntimeError("GradientAllReduce: a parameter's gradient arrived twice in one backward pass")
        if p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
        bucket.ready.add(p)
        self._pending = True
        # Start the full buckets in list order (the same on every rank: they share one
        # communicator); a group's last bucket waits for the end of the pass (blocking average).
        while self._next < len(self.buckets):
            nxt = self.buckets[self._next]
            if nxt.last or len(nxt.ready) < len(nxt.params):
                break
            self._start(nxt)
            self._next += 1
        for other in self.buckets:  # MPI progresses only inside MPI calls: drive the ones in flight
            if other.started:
                other.averager.test()

    def _start(self, bucket):
        bucket.view.synchronize()  # the copies into it ran on torch's stream
        bucket.touched = True
        bucket.averager.start()
        bucket.started = True

    def synchronize(self) -> None:
        """Complete the averaging of this pass's gradients (run at the end of every backward
        pass; call it yourself only after gradients computed outside ``backward()``). No-op
        when no gradient arrived since."""
        self._check_open()
        if not self._pending:
            return
        t0 = time.perf_counter()
        for bucket in self.buckets:
            for p in bucket.params:  # parameters without a gradient this pass contribute zeros
                if p not in bucket.ready:
                    view = self._where[p][1]
                    if p.grad is None:
                        view.zero_()
                    else:
                        view.copy_(p.grad)
        for view in self.grad_views:
            view.synchronize()
        if self.on_failure == "continue":
            self._complete_surviving()
        else:
            self._complete()
        self._next = 0
        for view in self.grad_views:
            view.release()
        for p, (_, view) in self._where.items():
            p.grad = view  # the averaged gradient, no copy; the next backward accumulates into it
        self._pending = False
        self.comm_time_s += time.perf_counter() - t0  # booked as communication, as every algorithm's

    def _complete(self):
        """Complete every bucket's mean, in list order."""
        for bucket in self.buckets:
            # Every rank treats a bucket the same way (a blocking and a nonblocking collective do
            # not match): the one holding a group's first layers completes last, with nothing
            # left to overlap, and goes by the blocking chunked average(), faster than Iallreduce.
            bucket.touched = True
            if bucket.last:
                bucket.averager.average()
            else:
                if not bucket.started:
                    bucket.averager.start()
                bucket.averager.finish()
            bucket.ready.clear()
            bucket.started = False

    def _complete_surviving(self):
        """``on_failure="continue"``: the buckets completed as :meth:`_complete` does; if a rank
        failed in this pass (the survivors agree: one ``MPI_Comm_agree``), every bucket recovers
        and means again over the survivors from this rank's own gradients (each averager kept
        them: ``restore()``), blocking, so that every survivor steps with the same mean."""
        again = False
        while self._surviving(self._again if again else self._complete):
            for bucket in self.buckets:   # (one never begun holds this rank's gradients still)
                if bucket.touched:
                    bucket.averager.restore()
                bucket.ready.clear()
                bucket.started = bucket.touched = False
            again = True
        for bucket in self.buckets:
            bucket.touched = False

    def _again(self):
        for bucket in self.buckets:
            bucket.touched = True
            bucket.averager.average()

    def _tolerant_groups(self):
        """Every bucket's averager, then the floating-point buffers' (the order they are stepped in)."""
        return [bucket.averager for bucket in self.buckets] + self.buffer_comms

    # -- after optimizer.step() -----------------------------------------------------------
    def _step(self):
        self.synchronize()  # in case no optimizer step ran (it is a no-op otherwise)
        for c in self.buffer_comms:
            c.average()

    def drain(self) -> None:
        self.synchronize()

    def free(self) -> None:
        if self.closed:
            return
        self.drain()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        for bucket in self.buckets:
            bucket.averager.free()
        if self._layout is not None:
            self._layout.free()
            self._layout = None
        self.buckets, self.comms = [], []
        super().free()
