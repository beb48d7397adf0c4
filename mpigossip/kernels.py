"""All arithmetic of the algorithms, on numpy (CPU) or cupy (GPU) arrays, in place.

Each function takes 1-D contiguous arrays of one module and dtype. On the GPU each is
one pass of a fused CUDA kernel (``cuda/kernels.cu``, compiled once per process with
CuPy's NVRTC); on the CPU it is a few in-place numpy ufunc calls with ``out=`` and no
full-size temporaries. Receive buffers passed to :func:`weighted_sum` are scratch: the
CPU path may scale them in place.
"""

import functools
import os

import numpy as np

CUDA_SOURCE_PATH = os.path.join(os.path.dirname(__file__), "cuda", "kernels.cu")
KERNEL_NAMES = ("weighted_sum", "split_share", "debias", "elastic", "scale")
_CUDA_TYPES = {"float16": "__half", "float32": "float", "float64": "double"}


def cuda_source():
    """The CUDA C++ source of the GPU kernels."""
    with open(CUDA_SOURCE_PATH) as f:
        return f.read()


def _is_numpy(a):
    return isinstance(a, np.ndarray)


def _check(*arrays):
    first = arrays[0]
    for a in arrays:
        if a.shape != first.shape or a.dtype != first.dtype:
            raise ValueError(f"kernel operands differ: {a.shape} {a.dtype} vs {first.shape} {first.dtype}")
        if type(a) is not type(first):
            raise TypeError("kernel operands mix host and device arrays")
    return first


# ------------------------------------------------------------------------------ GPU dispatch


@functools.lru_cache(maxsize=None)
def _module(device_id):
    import cupy
    names = [f"{k}<{t}>" for k in KERNEL_NAMES for t in _CUDA_TYPES.values()]
    with cupy.cuda.Device(device_id):
        return cupy.RawModule(code=cuda_source(), options=("--std=c++14",), name_expressions=names)


def _kernel(name, array):
    return _module(array.device.id).get_function(f"{name}<{_CUDA_TYPES[str(array.dtype)]}>")


def _launch(name, array, args):
    import cupy
    n = array.size
    block = 256
    grid = max(1, min((n + block - 1) // block, 65535))
    with cupy.cuda.Device(array.device.id):
        _kernel(name, array)((grid,), (block,), args + (np.int64(n),))


@functools.lru_cache(maxsize=64)
def _device_array(values, dtype, device_id):
    import cupy
    with cupy.cuda.Device(device_id):
        return cupy.asarray(np.array(values, dtype=dtype))


# --------------------------------------------------------------------------------- kernels


def weighted_sum(out, x, self_weight, recvs=(), weights=(), *, z=None, w=1.0):
    """``out = self_weight * x + sum_j weights[j] * recvs[j]``; if ``z`` is given, also ``z = out / w``.

    ``out`` may be ``x``. ``recvs`` are scratch (scaled in place on the CPU).
    """
    recvs = list(recvs)
    weights = [float(v) for v in weights]
    if len(recvs) != len(weights):
        raise ValueError(f"{len(recvs)} receive buffers but {len(weights)} weights")
    _check(out, x, *recvs, *(() if z is None else (z,)))
    if _is_numpy(x):
        np.multiply(x, self_weight, out=out)
        for r, wt in zip(recvs, weights):
            if wt != 1.0:
                np.multiply(r, wt, out=r)
            np.add(out, r, out=out)
        if z is not None:
            np.divide(out, w, out=z)
        return out
    ptrs = _device_array(tuple(r.data.ptr for r in recvs) or (0,), np.uint64, x.device.id)
    wts = _device_array(tuple(weights) or (0.0,), np.float64, x.device.id)
    _launch("weighted_sum", x, (out, x, np.float64(self_weight), ptrs, wts, np.int32(len(recvs)),
                                out if z is None else z, np.int32(z is not None), np.float64(w)))
    return out


def split_share(x, send, p):
    """PushSum share for overlap mode: ``x = p * x`` and ``send = p * x`` (the same values)."""
    _check(x, send)
    if _is_numpy(x):
        np.multiply(x, p, out=x)
        np.copyto(send, x)
    else:
        _launch("split_share", x, (x, send, np.float64(p)))


def debias(z, x, w):
    """De-bias PushSum: ``z = x / w``."""
    _check(z, x)
    if _is_numpy(x):
        np.divide(x, w, out=z)
    else:
        _launch("debias", x, (z, x, np.float64(w)))
    return z


def elastic(x, center, beta):
    """Elastic step: ``u = beta * (x - center)``, written into ``center``; then ``x -= u``."""
    _check(x, center)
    if _is_numpy(x):
        np.subtract(x, center, out=center)
        np.multiply(center, beta, out=center)
        np.subtract(x, center, out=x)
    else:
        _launch("elastic", x, (x, center, np.float64(beta)))
    return center


def scale(x, alpha):
    """``x = alpha * x`` in place."""
    if _is_numpy(x):
        np.multiply(x, alpha, out=x)
    else:
        _launch("scale", x, (x, np.float64(alpha)))
    return x
