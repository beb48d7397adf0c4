"""Wire formats: how a communicator packs a buffer's values into fewer bytes, and unpacks them.

A communicator that sends the model takes ``wire=`` (the same keyword everywhere):

* ``None`` (default): the buffer's own dtype, sent zero-copy;
* ``"bf16"``: the top 16 bits of each value as float32 (float32's range, 8 bits of
  mantissa): half the bytes of float32;
* ``"fp16"``: IEEE half precision (11 bits of mantissa, a narrow range): finite values beyond
  +-65504 saturate there (NaN and inf pass as they are);
* ``"int8"``: one int8 per value and one float32 scale (``max |x| / 127`` over the finite
  values) per :data:`INT8_BLOCK` values: a little over a quarter of float32's bytes; a NaN or
  inf travels as :data:`INT8_NONFINITE` and arrives as NaN.

Every format rounds to nearest, or, where the sender keeps its rounding error, stochastically
(see :class:`Wire`).

:class:`Wire` is the arithmetic, fused as the communicators need it (one pass each, on the
CPU block by block in cache, on the GPU one kernel): :meth:`Wire.encode` writes the wire
bytes of a chunk and, given the ``share`` of it that leaves, keeps the rounding error in the
sender's buffer (``x -= share * decoded``, so that PushSum's mass is exact);
:meth:`Wire.decode_sum` adds received wire bytes into the buffer in its own precision. A chunk's bytes: bf16/fp16 ``2 n``; int8 the
``ceil(n / INT8_BLOCK)`` scales, then the ``n`` values.
"""

import numpy as np

from . import kernels
from .registry import WIRE_FORMATS as FORMATS

#: Values per int8 scale.
INT8_BLOCK = 512
#: The int8 code of a NaN or an inf (decoded as NaN): -128 is never a value (they are -127..127),
#: and the block's scale leaves non-finite values out, so the rest of the block is unharmed.
INT8_NONFINITE = -128
_INT8_TINY = np.float32(128.0 / np.finfo(np.float32).max)  # floor of a block's max: 127 / it is finite
_GOLDEN32 = 0x9E3779B1
_WEYL = np.arange(kernels.CPU_BLOCK, dtype=np.uint32) * np.uint32(_GOLDEN32)  # j * golden, mod 2^32
_CODES = {"bf16": 0, "fp16": 1, "int8": 2}
_FP16_MAX = 65504.0


def check_wire(wire, dtype=None):
    """``wire`` itself if valid (``None`` or one of :data:`FORMATS`), else ``ValueError``.
    A 16-bit format on a float16 buffer saves nothing; it is refused as a likely mistake."""
    if wire is None:
        return None
    if wire not in FORMATS:
        raise ValueError(f"wire must be None (the buffer's dtype) or one of {FORMATS}, got {wire!r}")
    if dtype is not None and np.dtype(dtype).itemsize <= 2 and wire != "int8":
        raise ValueError(f"wire={wire!r} on a {np.dtype(dtype)} buffer sends as many bytes; use wire=None or 'int8'")
    return wire


def _blocks(n, step=kernels.CPU_BLOCK):
    for lo in range(0, n, step):
        yield lo, min(n, lo + step)


class Wire:
    """One wire format for buffers of one dtype.

    Args:
        fmt: one of :data:`FORMATS`.
        dtype: the buffer's dtype (float16, float32 or float64).
        seed: of the stochastic rounding (give each rank its own: the communicators use
            their rank).

    When the encode keeps the error (a ``share`` leaves), every format rounds stochastically
    (to the neighbour on the far side with the probability of the distance to it): with the
    error kept, a fixed grid rounding to nearest lets two ranks whose values differ by less
    than the grid spacing send the same value, and that difference is never averaged
    (measured: SGP on Fashion-MNIST lost 1.1 points with bf16 rounded to nearest; fp16's grid
    is 8 times finer and int8's moves with each block's largest value, but the same stall
    holds below their spacing). The random bits are a pure function of (seed, step,
    element): :func:`random_bits`, the same on CPU and GPU. Without a kept error (AllReduce)
    every format rounds to nearest.
    """

    def __init__(self, fmt, dtype, *, seed=0):
        self.format = check_wire(fmt, dtype)
        self.seed = int(seed)
        if self.format is None:
            raise ValueError("Wire needs a format; wire=None sends the buffer itself")
        self.dtype = np.dtype(dtype)
        #: Chunk boundaries (in elements) must be multiples of this.
        self.align = INT8_BLOCK if fmt == "int8" else 8

    def nbytes(self, n):
        """Bytes on the wire for a chunk of ``n`` values."""
        if self.format == "int8":
            return n + 4 * -(-n // INT8_BLOCK)
        return 2 * n

    def offset(self, lo):
        """Byte offset of the chunk starting at element ``lo`` (a multiple of :attr:`align`)
        in the wire bytes of the whole buffer."""
        if lo % self.align:
            raise ValueError(f"chunk start {lo} is not a multiple of {self.align}")
        return self.nbytes(lo)

    def chunk(self, chunk):
        """``chunk`` (elements) rounded down to a multiple of :attr:`align` (at least one)."""
        return max(self.align, chunk // self.align * self.align)

    # ------------------------------------------------------------------ encode
    def encode(self, x, wire, *, share=0.0, scale=1.0, salt=0, offset=0):
        """Write the wire bytes of ``scale * x`` into ``wire`` (``self.nbytes(x.size)`` uint8);
        if ``share`` (the part of ``x`` that leaves), also ``x -= share * decoded`` in the same
        pass (the error stays in ``x``; only with ``scale=1``). The random bits of a stochastic rounding are a function of
        (seed, ``salt``, ``offset`` + index), ``salt`` the step and ``offset`` the chunk's first
        element in the whole buffer: the same however the buffer is cut into chunks, and a
        run resumed from a checkpoint draws the bits of one never interrupted."""
        if share and scale != 1.0:
            raise ValueError("encode: share needs scale=1")
        n = x.size
        if wire.size != self.nbytes(n) or wire.dtype != np.uint8:
            raise ValueError(f"wire buffer of {wire.size} {wire.dtype} for {n} values; need {self.nbytes(n)} uint8")
        if x.dtype != self.dtype:
            raise ValueError(f"encode: {x.dtype} buffer for a {self.dtype} wire")
        if not isinstance(x, np.ndarray):
            self._launch_encode(x, wire, share, scale, salt, offset)
        elif self.format == "int8":
            self._encode_int8(x, wire, share, scale, salt, offset)
        else:
            self._encode16(x, wire, share, scale, salt, offset)
        return wire

    def _encode16(self, x, wire, share, scale, salt, offset):
        words = wire.view(np.uint16)
        as32 = x.dtype == np.float32
        key = random_key(self.seed, salt) if share else 0  # the step's key (stochastic rounding)
        for lo, hi in _blocks(x.size):
            xb, qb = x[lo:hi], words[lo:hi]
            if scale == 1.0:
                f = xb if as32 else xb.astype(np.float32)
            elif as32:
                f = np.multiply(xb, scale, dtype=np.float32)
            else:  # scale * x in the buffer's precision, then one rounding to float32 (as the CUDA kernel)
                f = np.multiply(xb, scale).astype(np.float32)
            finite = np.isfinite(f)
            bad = None if finite.all() else ~finite  # rare: NaN or inf in this block
            if self.format == "bf16":
                u = f.view(np.uint32)
                if share:  # stochastic: add 16 random low bits, then truncate
                    t = random_bits(offset + lo, u.size, key)
                else:     # to nearest even
                    t = np.right_shift(u, 16)
                    np.bitwise_and(t, 1, out=t)
                    np.add(t, 0x7FFF, out=t)
                np.add(t, u, out=t)
                np.right_shift(t, 16, out=t)
                if bad is not None:
                    t[np.isnan(f)] = 0x7FC0  # (inf encodes as inf by itself)
                np.copyto(qb, t, casting="unsafe")
                if share:
                    np.left_shift(t, 16, out=t)
                    d = t.view(np.float32)
            else:
                h = qb.view(np.float16)
                c = np.clip(f, -_FP16_MAX, _FP16_MAX)  # NaN stays NaN
                if bad is not None:
                    c[bad] = f[bad]  # only finite values saturate: an inf stays visible
                if share:
                    r = _fp16_stochastic(c if bad is None else np.where(bad, 0, c), random_bits(offset + lo, c.size, key))
                    if bad is not None:
                        r[bad] = c[bad]
                    np.copyto(h, r, casting="unsafe")  # exact
                    d = h
                else:
                    np.copyto(h, c, casting="unsafe")  # to nearest
            if share:
                self._subtract(xb, d, share, bad)

    def _encode_int8(self, x, wire, share, scale, salt, offset):
        n = x.size
        key = random_key(self.seed, salt) if share else 0
        nb = -(-n // INT8_BLOCK)
        scales = wire[:4 * nb].view(np.float32)
        q = wire[4 * nb:].view(np.int8)
        for lo, hi in _blocks(n):  # CPU_BLOCK is a multiple of INT8_BLOCK
            xb = x[lo:hi]
            m = hi - lo
            full = m // INT8_BLOCK * INT8_BLOCK
            f = xb.astype(np.float32) if scale == 1.0 else np.multiply(xb, scale, dtype=np.float32)
            sb = scales[lo // INT8_BLOCK:-(-hi // INT8_BLOCK)]
            amax = np.empty(sb.size, dtype=np.float32)
            bad = None
            for attempt in (0, 1):  # the second pass only for a block holding NaN or inf
                a = np.abs(f)
                if full:
                    np.max(a[:full].reshape(-1, INT8_BLOCK), axis=1, out=amax[:full // INT8_BLOCK])
                if full < m:
                    amax[-1] = np.max(a[full:])
                if attempt or np.isfinite(amax).all():
                    break
                bad = ~np.isfinite(f)  # left out of the scale, sent as INT8_NONFINITE
                f[bad] = 0.0           # (f is a copy of the caller's values)
            np.maximum(amax, _INT8_TINY, out=amax)  # a tiny block's 127 / max stays finite
            np.divide(amax, 127.0, out=sb)
            per = np.repeat(np.divide(127.0, amax), INT8_BLOCK)[:m]
            np.multiply(f, per, out=f)
            if share:  # stochastic: floor(v / scale + u), u uniform in (0, 1)
                np.add(f, _uniform(random_bits(offset + lo, m, key)), out=f)
                np.floor(f, out=f)
            else:
                np.rint(f, out=f)
            np.clip(f, -127.0, 127.0, out=f)
            np.copyto(q[lo:hi], f, casting="unsafe")
            if bad is not None:
                q[lo:hi][bad] = INT8_NONFINITE
            if share:
                np.multiply(f, np.repeat(sb, INT8_BLOCK)[:m], out=f)
                self._subtract(xb, f, share, bad)

    @staticmethod
    def _subtract(xb, d, share, bad=None):
        """``xb -= share * d``: the sender keeps what it did not send. A non-finite element
        (``bad``) stays as it was (NaN stays NaN, inf stays inf, not inf - inf)."""
        if share != 1.0:
            d = np.multiply(d, share, dtype=xb.dtype)
        if bad is None:
            np.subtract(xb, d, out=xb, casting="unsafe")
            return
        kept = xb[bad]
        with np.errstate(invalid="ignore"):  # inf - inf, put right below
            np.subtract(xb, d, out=xb, casting="unsafe")
        xb[bad] = kept

    # ------------------------------------------------------------------ decode
    def decode(self, wire, out):
        """``out = decoded wire`` (a convenience for tests and gathers)."""
        return self.decode_sum(out, out, 0.0, [wire], [1.0])

    def decode_sum(self, out, x, self_weight, wires=(), weights=(), *, z=None, w=1.0):
        """``out = self_weight * x + sum_j weights[j] * decode(wires[j])`` in ``x``'s own
        precision; with ``z``, also ``z = out / w``. ``out`` may be ``x``."""
        wires, weights = list(wires), [float(v) for v in weights]
        if len(wires) != len(weights):
            raise ValueError(f"{len(wires)} wire buffers but {len(weights)} weights")
        n = x.size
        for r in wires:
            if r.size != self.nbytes(n):
                raise ValueError(f"wire buffer of {r.size} bytes for {n} values; need {self.nbytes(n)}")
        if not isinstance(x, np.ndarray):
            return self._launch_decode(out, x, self_weight, wires, weights, z, w)
        for lo, hi in _blocks(n):
            ob = out[lo:hi]
            if self_weight == 0.0:
                ob[...] = 0  # (x may hold NaN or garbage: 0 * x would carry it)
            else:
                np.multiply(x[lo:hi], self_weight, out=ob)
            for r, wt in zip(wires, weights):
                d = self._decode_block(r, n, lo, hi)
                if x.dtype == np.float64:  # weights applied in the buffer's precision, as the sender's
                    d = d.astype(np.float64)
                if wt != 1.0:
                    np.multiply(d, wt, out=d)
                np.add(ob, d, out=ob, casting="unsafe")
            if z is not None:
                np.divide(ob, w, out=z[lo:hi])
        return out

    def _decode_block(self, wire, n, lo, hi):
        """Values ``[lo, hi)`` of a chunk of ``n`` as a new float32 array."""
        if self.format == "bf16":
            t = wire.view(np.uint16)[lo:hi].astype(np.uint32)
            np.left_shift(t, 16, out=t)
            return t.view(np.float32)
        if self.format == "fp16":
            return wire.view(np.float16)[lo:hi].astype(np.float32)
        nb = -(-n // INT8_BLOCK)
        scales = wire[:4 * nb].view(np.float32)[lo // INT8_BLOCK:-(-hi // INT8_BLOCK)]
        q = wire[4 * nb + lo:4 * nb + hi].view(np.int8)
        d = q.astype(np.float32)
        np.multiply(d, np.repeat(scales, INT8_BLOCK)[:hi - lo], out=d)
        bad = q == INT8_NONFINITE
        if bad.any():
            d[bad] = np.nan
        return d

    # ------------------------------------------------------------------ GPU
    def _launch_encode(self, x, wire, share, scale, salt=0, offset=0):
        import cupy
        n = x.size
        t = kernels.cuda_type(x.dtype)
        if self.format == "int8":
            name, blocks = f"encode_int8<{t}>", min(-(-n // INT8_BLOCK), kernels.MAX_GRID)
        else:
            name, blocks = f"encode16<{t}, {_CODES[self.format]}>", kernels.grid(n)
        key = np.uint32(random_key(self.seed, salt))
        with cupy.cuda.Device(x.device.id):
            kernels.function(x.device.id, name)((blocks,), (256,), (x, wire, np.float64(share), np.float64(scale),
                                                                     key, np.int64(offset), np.int64(n)))

    def _launch_decode(self, out, x, self_weight, wires, weights, z, w):
        import cupy
        n = x.size
        t = kernels.cuda_type(x.dtype)
        k = kernels.MAX_DIRECT_RECVS
        groups = [(wires[i:i + k], weights[i:i + k]) for i in range(0, len(wires), k)] or [([], [])]
        with cupy.cuda.Device(x.device.id):
            for g, (rs, ws) in enumerate(groups):
                last = g == len(groups) - 1
                pad = k - len(rs)
                args = ((out, x if g == 0 else out, np.float64(self_weight if g == 0 else 1.0))
                        + tuple(np.uint64(r.data.ptr) for r in rs) + (np.uint64(0),) * pad
                        + tuple(np.float64(v) for v in ws) + (np.float64(0.0),) * pad
                        + ((z if z is not None else out), np.int32(last and z is not None), np.float64(w),
                           np.int64(n)))
                name = f"decode_sum<{t}, {_CODES[self.format]}, {len(rs)}>"
                kernels.function(x.device.id, name)((kernels.grid(n),), (256,), args)
        return out

    def __repr__(self):
        return f"<Wire {self.format} for {self.dtype}>"


def _uniform(bits):
    """Random 16-bit values as float32 in (0, 1): ``(bits + 1/2) / 2^16`` (exact)."""
    u = bits.astype(np.float32)
    np.add(u, np.float32(0.5), out=u)
    np.multiply(u, np.float32(2.0 ** -16), out=u)
    return u


def _fp16_stochastic(c, bits):
    """``c`` (float32, finite, saturated at +-65504) rounded stochastically to float16's grid,
    as float32 values that convert to float16 exactly: with ``ulp`` the spacing of float16
    at ``c`` (a power of two, at least 2^-24), ``floor(c / ulp + u) * ulp``, u uniform in
    (0, 1). Every operation is exact but the addition of ``u``, which the CUDA kernel repeats
    (``fp16_stochastic``), so CPU and GPU round alike."""
    e = np.right_shift(c.view(np.uint32), 23)
    np.bitwise_and(e, 0xFF, out=e)
    np.maximum(e, 113, out=e)                              # exponent field, float16's subnormals' at least
    inv = np.left_shift(np.subtract(264, e, dtype=np.uint32), 23).view(np.float32)  # 1 / ulp
    np.subtract(e, 10, out=e)
    ulp = np.left_shift(e, 23, out=e).view(np.float32)
    t = np.multiply(c, inv)
    np.add(t, _uniform(bits), out=t)
    np.floor(t, out=t)
    return np.multiply(t, ulp, out=t)


def random_key(seed, step):
    """The 32-bit key of one rank's (``seed``) stochastic rounding at one ``step``."""
    return _mix(seed, step) & 0xFFFFFFFF


def random_bits(first, m, key):
    """The 16 random bits (uint32 values below 2^16) of elements ``first .. first + m - 1``
    (``m <= kernels.CPU_BLOCK``) under ``key``: the top half of murmur3's 32-bit finaliser of
    ``i * 0x9E3779B1 + key`` (mod 2^32). A pure function of (key, i), the same on CPU and GPU
    (``random_bits`` in cuda/kernels.cu), with no period below 2^32 elements; a new key each
    step gives each element fresh bits."""
    h = _WEYL[:m] + np.uint32((first * _GOLDEN32 + key) & 0xFFFFFFFF)
    t = np.right_shift(h, 16)
    np.bitwise_xor(h, t, out=h)
    np.multiply(h, np.uint32(0x85EBCA6B), out=h)
    np.right_shift(h, 13, out=t)
    np.bitwise_xor(h, t, out=h)
    np.multiply(h, np.uint32(0xC2B2AE35), out=h)
    np.right_shift(h, 16, out=t)
    np.bitwise_xor(h, t, out=h)
    return np.right_shift(h, 16, out=h)


def _mix(*words):
    """splitmix64 over ``words``: a well-mixed 64-bit integer, a pure function of them."""
    z = 0
    for w in words:
        z = (z + (int(w) & (2 ** 64 - 1)) + 0x9E3779B97F4A7C15) & (2 ** 64 - 1)
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2 ** 64 - 1)
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2 ** 64 - 1)
        z ^= z >> 31
    return z


def kernel_expressions():
    """Every wire kernel instantiation the GPU path can launch (the tests compile them all)."""
    out = []
    for t in ("__half", "float", "double"):
        out += [f"encode16<{t}, 0>", f"encode16<{t}, 1>", f"encode_int8<{t}>"]
        out += [f"decode_sum<{t}, {f}, {k}>" for f in range(3) for k in range(kernels.MAX_DIRECT_RECVS + 1)]
    return out
