"""Buffers: numpy, cupy or torch (CPU or CUDA) arrays as flat, zero-copy MPI buffers.

:func:`as_buffer` checks a user's array and returns a :class:`Buffer` holding a 1-D
numpy or cupy view of the same memory (torch tensors are viewed through ``.numpy()``
or DLPack, never copied), so every layer above works on plain arrays.
:class:`Transport` is what a communicator hands to MPI: the array itself when MPI can
read it (host memory, or device memory with a CUDA-aware MPI), else a reusable pinned
host copy that is filled before a send and copied back after a receive, on the array's
stream. torch is never imported here; it is only recognised when the user passes it.
"""

import ctypes
import os
import sys

import numpy as np
from mpi4py import MPI

from . import deadline

#: Environment variable that overrides CUDA-aware MPI detection ("1" or "0").
CUDA_AWARE_ENV = "MPIGOSSIP_CUDA_AWARE"

SUPPORTED_DTYPES = ("float16", "float32", "float64")

_MPI_TYPES = {
    np.dtype(np.float32): MPI.FLOAT,
    np.dtype(np.float64): MPI.DOUBLE,
}
_MPI_TYPES[np.dtype(np.uint8)] = MPI.BYTE  # wire bytes (mpigossip.core.wire); never a user's buffer
if MPI.FLOAT16_T != MPI.DATATYPE_NULL:
    _MPI_TYPES[np.dtype(np.float16)] = MPI.FLOAT16_T


def mpi_datatype(dtype):
    """The MPI datatype for a numpy dtype, or ``TypeError`` if MPI cannot carry it."""
    dtype = np.dtype(dtype)
    try:
        return _MPI_TYPES[dtype]
    except KeyError:
        extra = " (this MPI has no MPI_FLOAT16_T)" if dtype == np.float16 else ""
        raise TypeError(f"dtype {dtype} is not supported{extra}; use one of "
                        + ", ".join(str(d) for d in _MPI_TYPES if d.kind == "f")) from None


def array_kind(obj):
    """``"numpy"``, ``"cupy"`` or ``"torch"``; ``TypeError`` for anything else."""
    if isinstance(obj, np.ndarray):
        return "numpy"
    module = type(obj).__module__.split(".")[0]
    if module == "cupy" and hasattr(obj, "__cuda_array_interface__"):
        return "cupy"
    if module == "torch" and hasattr(obj, "data_ptr"):
        return "torch"
    raise TypeError(f"expected a numpy array, cupy array or torch tensor, got {type(obj).__name__}")


def _cupy():
    try:
        import cupy
    except ImportError:  # pragma: no cover - depends on the install
        raise TypeError("CUDA tensors need CuPy: pip install 'mpigossip[gpu]'") from None
    return cupy


def _event():
    """A CUDA event for ordering only (no timing: cheaper to record and wait on)."""
    return _cupy().cuda.Event(disable_timing=True)


class Buffer:
    """A checked, flat, contiguous view of a user's array.

    Attributes:
        obj: the array the user passed.
        kind: ``"numpy"``, ``"cupy"`` or ``"torch"``.
        array: 1-D numpy (host) or cupy (device) view of the same memory.
        on_device: whether the memory is on a GPU.
        dtype: numpy dtype of the elements.
        size: number of elements.
        datatype: the MPI datatype.
    """

    def __init__(self, obj, array, kind):
        self.obj = obj
        self.kind = kind
        self.array = array
        self.on_device = not isinstance(array, np.ndarray)
        self.dtype = np.dtype(array.dtype)
        self.size = int(array.size)
        self.nbytes = int(array.nbytes)
        self.datatype = mpi_datatype(self.dtype)

    def like(self, array):
        """Wrap ``array`` (same module as :attr:`array`) as an object of the user's kind."""
        if self.kind == "torch":
            import torch  # already imported by the user: they passed a tensor
            return torch.from_numpy(array) if isinstance(array, np.ndarray) else torch.from_dlpack(array)
        return array

    def empty(self, size=None):
        """A new uninitialised array of the same module, dtype and device."""
        size = self.size if size is None else size
        if self.on_device:
            cupy = _cupy()
            with cupy.cuda.Device(self.array.device.id):
                return cupy.empty(size, dtype=self.dtype)
        return np.empty(size, dtype=self.dtype)

    # -- ordering of device work ------------------------------------------------------
    # mpigossip's kernels and copies run on CuPy's current stream of the buffer's device
    # ("ours"). The user's own work on a torch tensor runs on torch's current stream, which
    # may be another one: then ``acquire`` orders ours after the user's pending work and
    # ``release`` orders the user's stream after ours, both with events (no host wait).
    # With the default streams (both the legacy default stream) the two are the same stream
    # and neither call does anything.

    def _streams(self):
        """(our stream, the user's stream or None if it is ours)."""
        cupy = _cupy()
        with cupy.cuda.Device(self.array.device.id):
            ours = cupy.cuda.get_current_stream()
            if self.kind != "torch":
                return ours, None
            ptr = sys.modules["torch"].cuda.current_stream(self.obj.device).cuda_stream
            if ptr == ours.ptr:
                return ours, None
            return ours, cupy.cuda.ExternalStream(ptr, self.array.device.id)

    def acquire(self):
        """Order our stream after the user's pending work on this buffer (before we read it)."""
        if self.on_device:
            ours, user = self._streams()
            if user is not None:
                ours.wait_event(user.record(_event()))

    def release(self):
        """Order the user's later work on this buffer after what we queued (after we wrote it)."""
        if self.on_device:
            ours, user = self._streams()
            if user is not None:
                user.wait_event(ours.record(_event()))

    def synchronize(self):
        """Block the host until all device work on this buffer, the user's and ours, has
        finished (before MPI or the host reads or writes its memory). No-op on CPU."""
        if self.on_device:
            ours, user = self._streams()
            if user is not None:
                user.synchronize()
            ours.synchronize()

    def __repr__(self):
        where = f"cuda:{self.array.device.id}" if self.on_device else "cpu"
        return f"<Buffer {self.kind} {self.dtype} size={self.size} {where}>"


def as_buffer(obj, *, name="buffer"):
    """Check ``obj`` and return a :class:`Buffer` viewing its memory, zero-copy.

    Raises:
        TypeError: not an array, or a dtype MPI cannot carry (bfloat16, integers, ...).
        ValueError: not contiguous, or empty.
    """
    kind = array_kind(obj)
    if kind == "torch":
        dtype_name = str(obj.dtype).replace("torch.", "")
        if dtype_name not in SUPPORTED_DTYPES:
            raise TypeError(f"{name}: dtype torch.{dtype_name} is not supported; use one of "
                            + ", ".join(SUPPORTED_DTYPES)
                            + (" (keep a float32 master copy of bfloat16 models)"
                               if dtype_name == "bfloat16" else ""))
        if not obj.is_contiguous():
            raise ValueError(f"{name}: torch tensor of shape {tuple(obj.shape)} is not contiguous; "
                             "pass .contiguous() or a flat parameter buffer")
        data = obj.detach()  # same memory, no autograd
        if obj.device.type == "cuda":
            array = _cupy().from_dlpack(data)
        elif obj.device.type == "cpu":
            array = data.numpy()
        else:
            raise ValueError(f"{name}: torch device {obj.device} is not supported (cpu or cuda)")
    else:
        array = obj
        if str(array.dtype) not in SUPPORTED_DTYPES:
            raise TypeError(f"{name}: dtype {array.dtype} is not supported; use one of "
                            + ", ".join(SUPPORTED_DTYPES))
        if not array.flags.c_contiguous:
            raise ValueError(f"{name}: array of shape {array.shape} with strides {array.strides} "
                             "is not C-contiguous; pass a contiguous copy")
    if array.size == 0:
        raise ValueError(f"{name}: buffer is empty")
    mpi_datatype(array.dtype)
    return Buffer(obj, array.reshape(-1), kind)


def scratch(buf, size=None):
    """A new :class:`Buffer` of uninitialised numpy/cupy memory like ``buf`` (same dtype, device)."""
    array = buf.empty(size)
    return Buffer(array, array, "numpy" if isinstance(array, np.ndarray) else "cupy")


def empty_like(array, n):
    """An uninitialised 1-D array of ``n`` elements of ``array``'s module (numpy or cupy), dtype
    and device."""
    if isinstance(array, np.ndarray):
        return np.empty(n, array.dtype)
    cupy = _cupy()
    with cupy.cuda.Device(array.device.id):
        return cupy.empty(n, array.dtype)


def raw(like, nbytes):
    """A new :class:`Buffer` of ``nbytes`` uninitialised bytes (uint8) on ``like``'s device
    (wire bytes of a compressed message)."""
    if like.on_device:
        cupy = _cupy()
        with cupy.cuda.Device(like.array.device.id):
            array = cupy.empty(nbytes, dtype=np.uint8)
        return Buffer(array, array, "cupy")
    array = np.empty(nbytes, dtype=np.uint8)
    return Buffer(array, array, "numpy")


def message(like, code=None):
    """A new :class:`Buffer` for one message of all of ``like``'s values: ``like``'s dtype, or
    the wire bytes of ``code`` (a :class:`mpigossip.core.wire.Wire`)."""
    return scratch(like) if code is None else raw(like, code.nbytes(like.size))


def describe(buf):
    """(size, dtype, device kind) of a buffer, as compared across ranks."""
    return (buf.size, str(buf.dtype), "cuda" if buf.on_device else "cpu")


def check_buffer(obj, *, comm, op, name="buffer", timeout=None, same=None, error=None):
    """Collective: check ``obj`` on every rank and that all ranks agree on length and dtype.
    The buffer must be writable (every communicator updates it in place).

    Args:
        same: optional ``{argument name: value}`` of settings that must also be equal on
            every rank (e.g. a chunk size that fixes how many messages are sent).
        error: this rank's problem with another argument (a string), raised on every rank
            together with the buffer's.

    Returns the :class:`Buffer`. If any rank's buffer is invalid, or lengths, dtypes or
    ``same`` values differ, every rank raises the same ``ValueError`` naming the ranks
    and the problem, instead of hanging or truncating in a later transfer.
    """
    timeout = deadline.check_timeout(timeout)
    buf = None
    try:
        buf = as_buffer(obj, name=name)
        if not buf.on_device and not buf.array.flags.writeable:
            raise ValueError(f"{name} is read-only; it is updated in place: pass a writable array")
    except (TypeError, ValueError) as exc:
        error = str(exc) if error is None else f"{exc}; {error}"
    same = dict(same or {})
    infos = deadline.allgather(comm, (error, None if error else describe(buf), same), timeout=timeout, op=op)
    deadline.raise_gathered([e for e, _, _ in infos], op=op)
    shapes = {info[:2] for _, info, _ in infos}
    if len(shapes) > 1:
        detail = ", ".join(f"rank {r}: {n} x {d}" for r, (_, (n, d, _), _) in enumerate(infos))
        raise ValueError(f"{op}: {name} differs across ranks (length x dtype): {detail}")
    for key in same:
        values = [s.get(key) for _, _, s in infos]
        if any(v != values[0] for v in values):
            detail = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            raise ValueError(f"{op}: {key} differs across ranks: {detail}")
    return buf


# ---------------------------------------------------------------------------- CUDA-aware MPI


def _query_mpi_cuda_support():
    """Ask the MPI library (Open MPI's MPIX_Query_cuda_support, MPICH's MPIX_GPU_query_support)."""
    libs = set()
    try:
        with open("/proc/self/maps") as maps:
            libs = {line.split()[-1] for line in maps if "libmpi" in line and ".so" in line}
    except OSError:
        pass
    for path in sorted(libs):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        if hasattr(lib, "MPIX_Query_cuda_support"):
            lib.MPIX_Query_cuda_support.restype = ctypes.c_int
            return bool(lib.MPIX_Query_cuda_support())
        if hasattr(lib, "MPIX_GPU_query_support"):
            flag = ctypes.c_int(0)
            lib.MPIX_GPU_query_support(ctypes.c_int(0), ctypes.byref(flag))  # MPIX_GPU_SUPPORT_CUDA
            return bool(flag.value)
    return False


def cuda_aware(override=None):
    """Whether device buffers may go to MPI directly.

    ``override`` (bool) wins; then ``$MPIGOSSIP_CUDA_AWARE`` ("1"/"0"); then the MPI
    library's own answer. Returns ``(flag, source)``.
    """
    if override is not None:
        return bool(override), "argument"
    env = os.environ.get(CUDA_AWARE_ENV, "").strip().lower()
    if env in ("1", "true", "yes", "on"):
        return True, f"${CUDA_AWARE_ENV}"
    if env in ("0", "false", "no", "off"):
        return False, f"${CUDA_AWARE_ENV}"
    if env:
        raise ValueError(f"{CUDA_AWARE_ENV}={env!r}: expected 1 or 0")
    return _query_mpi_cuda_support(), "MPI library"


def _pinned_empty(size, dtype):
    """A page-locked host array when CuPy can give one, else a plain numpy array."""
    try:
        import cupyx
        return cupyx.empty_pinned(size, dtype=dtype)
    except Exception:  # no CuPy, or no driver
        return np.empty(size, dtype=dtype)


class Transport:
    """What MPI reads and writes for one buffer: the buffer itself, or a host staging copy.

    Args:
        buf: a :class:`Buffer` or an array of the same module as the communicator's buffer.
        stage: ``None`` decides from the device and :func:`cuda_aware`; ``True`` forces
            a host staging copy (used to test the staged path on CPU).
        cuda_aware: override for the detection.

    Call :meth:`before_send` before MPI reads and :meth:`after_recv` once MPI has written;
    :meth:`reading` once a kernel that reads a received buffer has been queued.
    :attr:`memory`, :attr:`spec` and :meth:`part` hand the memory to MPI, and first wait
    for device work still reading it: a host-to-device copy out of the staging buffer (a
    copy from pinned memory is asynchronous), or a combine reading the device buffer itself.
    MPI writing the next message while either still reads would corrupt it silently.
    """

    def __init__(self, buf, *, stage=None, cuda_aware=None):
        if not isinstance(buf, Buffer):
            buf = as_buffer(buf)
        self.buffer = buf
        if stage is None:
            stage = buf.on_device and not globals()["cuda_aware"](cuda_aware)[0]
        self.staged = bool(stage)
        self.host = None
        if self.staged:
            self.host = (_pinned_empty(buf.size, buf.dtype) if buf.on_device
                         else np.empty(buf.size, dtype=buf.dtype))
        self._busy = None  # event of queued device work still reading what MPI writes next

    @property
    def memory(self):
        """The array MPI reads and writes (the staging buffer, or the buffer itself), once
        no device work queued before reads it."""
        if self._busy is not None:
            self._busy.synchronize()
            self._busy = None
        return self.host if self.staged else self.buffer.array

    @property
    def spec(self):
        """MPI spec of the whole buffer."""
        return [self.memory, self.buffer.datatype]

    def part(self, lo, hi):
        """MPI spec for elements ``[lo, hi)``."""
        return [self.memory[lo:hi], self.buffer.datatype]

    def before_send(self):
        """Make the data visible to MPI: device sync, or device-to-host copy."""
        if self.staged:
            if self.buffer.on_device:
                self.buffer.acquire()
                self.buffer.array.get(out=self.memory, blocking=True)
            else:
                np.copyto(self.host, self.buffer.array)
        else:
            self.buffer.synchronize()

    def after_recv(self):
        """Move what MPI wrote back into the buffer (host-to-device copy when staged).

        The device copy is queued on our stream, so kernels queued after it see the data;
        the staging buffer is handed to MPI again only once the copy has finished."""
        if self.staged:
            if self.buffer.on_device:
                self.buffer.array.set(self.memory)
                self._busy = _cupy().cuda.get_current_stream().record(_event())
            else:
                np.copyto(self.buffer.array, self.host)

    def reading(self):
        """Say that device work just queued (on our stream) reads the buffer: MPI gets
        :attr:`memory` again only once that work has run. Staged: nothing to do (MPI writes the
        host copy, and the next copy to the device is queued after the work); on the host:
        nothing (the work has run)."""
        if self.buffer.on_device and not self.staged:
            self._busy = _cupy().cuda.get_current_stream().record(_event())
