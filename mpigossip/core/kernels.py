"""All arithmetic of the algorithms, on numpy (CPU) or cupy (GPU) arrays, in place.

Each function takes 1-D contiguous arrays of one module and dtype. On the GPU each is
one pass of a fused CUDA kernel (``cuda/kernels.cu``, compiled once per process with
CuPy's NVRTC, with ``--fmad=false``: no multiply and add contracted into one fused
multiply-add, so every operation rounds as numpy's does and a CPU rank and a GPU rank compute
alike); on the CPU it is a few in-place numpy ufunc calls with ``out=``, run block by block so
that each block stays in cache (one pass over memory, no temporaries). Receive buffers passed
to :func:`weighted_sum` are scratch: the CPU path may scale them in place.
"""

import functools
import os

import numpy as np

CUDA_SOURCE_PATH = os.path.join(os.path.dirname(__file__), "cuda", "kernels.cu")
KERNEL_NAMES = ("weighted_sum", "weighted_sum_many", "split_share", "debias", "elastic", "scale", "outer")
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

#: Most received buffers passed to the GPU weighted sum as kernel arguments; more go through
#: a device array of pointers (one extra small copy per call).
MAX_DIRECT_RECVS = 8
_BLOCK = 256
_MAX_GRID = 65535


#: NVRTC's options: no fused multiply-add (NVRTC contracts ``a - s * d`` into one by default,
#: rounding once where numpy rounds twice: the kept error of a wire encode then differed).
NVRTC_OPTIONS = ("--std=c++14", "--fmad=false")


@functools.lru_cache(maxsize=None)
def _function(device_id, expression):
    """The compiled kernel ``expression`` (e.g. ``"scale<float, 4>"``) on one device. Each
    instantiation is compiled on first use (CuPy keeps the binary in its disk cache)."""
    import cupy
    with cupy.cuda.Device(device_id):
        module = cupy.RawModule(code=cuda_source(), options=NVRTC_OPTIONS, name_expressions=[expression])
        return module.get_function(expression)


def kernel_expressions():
    """Every kernel instantiation the GPU path can launch (the tests compile them all)."""
    out = []
    for t, size in (("__half", 2), ("float", 4), ("double", 8)):
        for v in (1, 16 // size):
            out += [f"weighted_sum<{t}, {k}, {v}>" for k in range(MAX_DIRECT_RECVS + 1)]
            out += [f"{name}<{t}, {v}>" for name in ("split_share", "debias", "elastic", "scale", "outer")]
        out.append(f"weighted_sum_many<{t}>")
    return out


def _pack(*arrays):
    """Elements per 16-byte access if every operand is 16-byte aligned, else 1."""
    itemsize = arrays[0].dtype.itemsize
    if all(a.data.ptr % 16 == 0 for a in arrays):
        return 16 // itemsize
    return 1


def cuda_type(dtype):
    """The CUDA C++ element type of a numpy dtype."""
    return _CUDA_TYPES[str(np.dtype(dtype))]


def grid(n):
    """Blocks of ``_BLOCK`` threads for a grid-stride launch over ``n`` elements (or packs)."""
    return max(1, min(-(-n // _BLOCK), _MAX_GRID))


function = _function  # for the other kernel modules (mpigossip.core.wire)
MAX_GRID = _MAX_GRID


def _launch(name, array, args, template=(), operands=()):
    """Launch kernel ``name<T, *template, V>`` over ``array.size`` elements; ``V`` from the
    alignment of ``operands`` (default: ``array``)."""
    import cupy
    n = array.size
    v = _pack(*(operands or (array,)))
    expression = f"{name}<{', '.join([cuda_type(array.dtype), *map(str, template), str(v)])}>"
    with cupy.cuda.Device(array.device.id):
        _function(array.device.id, expression)((grid(n // v),), (_BLOCK,), args + (np.int64(n),))


@functools.lru_cache(maxsize=64)
def _device_array(values, dtype, device_id):
    import cupy
    with cupy.cuda.Device(device_id):
        return cupy.asarray(np.array(values, dtype=dtype))


# --------------------------------------------------------------------------------- kernels


#: Elements per block of the CPU path: the operands of one block stay in L2 cache, so a
#: sequence of numpy ufuncs over a block costs one pass over main memory, like a fused kernel.
CPU_BLOCK = 1 << 15


def _blocks(n):
    for lo in range(0, n, CPU_BLOCK):
        yield slice(lo, min(lo + CPU_BLOCK, n))


def weighted_sum(out, x, self_weight, recvs=(), weights=(), *, z=None, w=1.0, keep_recvs=False):
    """``out = self_weight * x + sum_j weights[j] * recvs[j]``; if ``z`` is given, also ``z = out / w``.

    ``out`` may be ``x``. ``recvs`` are scratch (scaled in place on the CPU), unless
    ``keep_recvs``: then they are left as they were (a block-sized temporary on the CPU).
    """
    recvs = list(recvs)
    weights = [float(v) for v in weights]
    if len(recvs) != len(weights):
        raise ValueError(f"{len(recvs)} receive buffers but {len(weights)} weights")
    _check(out, x, *recvs, *(() if z is None else (z,)))
    if _is_numpy(x):
        uniform = all(wt == self_weight for wt in weights)  # regular graphs: out = p * (x + sum r)
        for b in _blocks(x.size):
            ob = out[b]
            if uniform and recvs:
                np.add(x[b], recvs[0][b], out=ob)
                for r in recvs[1:]:
                    np.add(ob, r[b], out=ob)
                if self_weight != 1.0:
                    np.multiply(ob, self_weight, out=ob)
            else:
                np.multiply(x[b], self_weight, out=ob)
                for r, wt in zip(recvs, weights):
                    rb = r[b]
                    if wt != 1.0:
                        rb = np.multiply(rb, wt) if keep_recvs else np.multiply(rb, wt, out=rb)
                    np.add(ob, rb, out=ob)
            if z is not None:
                np.divide(ob, w, out=z[b])
        return out
    target = out if z is None else z
    if len(recvs) <= MAX_DIRECT_RECVS:
        pad = MAX_DIRECT_RECVS - len(recvs)
        ptrs = tuple(np.uint64(r.data.ptr) for r in recvs) + (np.uint64(0),) * pad
        wts = tuple(np.float64(wt) for wt in weights) + (np.float64(0.0),) * pad
        _launch("weighted_sum", x, (out, x, np.float64(self_weight)) + ptrs + wts
                + (target, np.int32(z is not None), np.float64(w)),
                template=(len(recvs),), operands=(out, x, *recvs, target))
        return out
    ptrs = _device_array(tuple(r.data.ptr for r in recvs), np.uint64, x.device.id)
    wts = _device_array(tuple(weights), np.float64, x.device.id)
    n = x.size
    import cupy
    with cupy.cuda.Device(x.device.id):
        _function(x.device.id, f"weighted_sum_many<{_CUDA_TYPES[str(x.dtype)]}>")(
            (grid(n),), (_BLOCK,),
            (out, x, np.float64(self_weight), ptrs, wts, np.int32(len(recvs)), target,
             np.int32(z is not None), np.float64(w), np.int64(n)))
    return out


def split_share(x, send, p):
    """PushSum share for overlap mode: ``x = p * x`` and ``send = p * x`` (the same values)."""
    _check(x, send)
    if _is_numpy(x):
        for b in _blocks(x.size):
            np.multiply(x[b], p, out=x[b])
            np.copyto(send[b], x[b])
    else:
        _launch("split_share", x, (x, send, np.float64(p)), operands=(x, send))


def debias(z, x, w):
    """De-bias PushSum: ``z = x / w``."""
    _check(z, x)
    if _is_numpy(x):
        np.divide(x, w, out=z)
    else:
        _launch("debias", x, (z, x, np.float64(w)), operands=(z, x))
    return z


def elastic(x, center, alpha):
    """Elastic step: ``u = alpha * (x - center)``, written into ``center``; then ``x -= u``."""
    _check(x, center)
    if _is_numpy(x):
        for b in _blocks(x.size):
            cb, xb = center[b], x[b]
            np.subtract(xb, cb, out=cb)
            np.multiply(cb, alpha, out=cb)
            np.subtract(xb, cb, out=xb)
    else:
        _launch("elastic", x, (x, center, np.float64(alpha)), operands=(x, center))
    return center


def scale(x, alpha):
    """``x = alpha * x`` in place."""
    if _is_numpy(x):
        np.multiply(x, alpha, out=x)
    else:
        _launch("scale", x, (x, np.float64(alpha)))
    return x


def outer(anchor, x, momentum, lr, mu=0.0, *, nesterov=False, w=1.0):
    """Outer optimizer step on the model ``x / w`` just averaged, in one pass:
    ``g = anchor - x / w``; ``momentum = mu * momentum + g``; ``anchor -= lr * (g + mu *
    momentum if nesterov else momentum)``; ``x = w * anchor``. With ``lr=1, mu=0`` the anchor
    becomes the averaged model (local SGD); SlowMo is ``mu > 0``, DiLoCo ``nesterov``."""
    _check(anchor, x, momentum)
    if _is_numpy(x):
        for b in _blocks(x.size):
            ab, xb, mb = anchor[b], x[b], momentum[b]
            g = np.divide(xb, w) if w != 1.0 else xb.copy()   # a block-sized temporary
            np.subtract(ab, g, out=g)                         # g = a - x / w
            np.multiply(mb, mu, out=mb)
            np.add(mb, g, out=mb)                             # m = mu m + g
            if nesterov:
                np.multiply(mb, mu, out=xb)
                np.add(xb, g, out=xb)                         # d = g + mu m (x as scratch)
                np.multiply(xb, lr, out=xb)
            else:
                np.multiply(mb, lr, out=xb)                   # lr * m
            np.subtract(ab, xb, out=ab)                       # a -= lr d
            np.multiply(ab, w, out=xb) if w != 1.0 else np.copyto(xb, ab)
    else:
        _launch("outer", x, (anchor, x, momentum, np.float64(lr), np.float64(mu), np.float64(w),
                             np.int32(bool(nesterov))), operands=(anchor, x, momentum))
    return anchor
