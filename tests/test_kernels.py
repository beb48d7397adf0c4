"""Kernels: numpy path against reference formulas; CUDA source compiled by nvcc; CuPy vs numpy on a GPU."""

import shutil
import subprocess

import numpy as np
import pytest

from mpigossip.core import kernels, wire

DTYPES = [np.float32, np.float64]
LENGTHS = [1, 7, 1001, 2 * kernels.CPU_BLOCK + 3]  # the last crosses the CPU path's block boundary


def rng_arrays(n, count, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(n).astype(dtype) for _ in range(count)]


def tol(dtype):
    return {np.float16: 2e-3, np.float32: 1e-6, np.float64: 1e-14}[dtype]


@pytest.mark.parametrize("dtype", DTYPES + [np.float16])
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("k", range(5))
@pytest.mark.parametrize("in_place", [True, False])
def test_weighted_sum_matches_reference(dtype, n, k, in_place):
    x, *recvs = rng_arrays(n, k + 1, dtype, seed=k)
    weights = [0.5 / (j + 1) for j in range(k)]
    self_w = 1.0 / (k + 1)
    ref = self_w * x.astype(np.float64) + sum(w * r.astype(np.float64) for w, r in zip(weights, recvs))
    out = x if in_place else np.empty_like(x)
    z = np.empty_like(x)
    kernels.weighted_sum(out, x, self_w, [r.copy() for r in recvs], weights, z=z, w=0.75)
    np.testing.assert_allclose(out, ref, rtol=tol(dtype) * 10, atol=tol(dtype) * 10)
    np.testing.assert_allclose(z, out.astype(np.float64) / 0.75, rtol=tol(dtype) * 10, atol=tol(dtype) * 10)
    assert out.dtype == dtype


def test_weighted_sum_is_exact_on_dyadic_data():
    x = np.arange(11, dtype=np.float64)
    r = np.arange(11, dtype=np.float64)[::-1].copy()
    kernels.weighted_sum(x, x, 0.5, [r], [0.5])
    assert np.array_equal(x, np.full(11, 5.0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", LENGTHS)
def test_split_share_debias_elastic_scale(dtype, n):
    x, c = rng_arrays(n, 2, dtype)
    x0, c0 = x.astype(np.float64), c.astype(np.float64)
    send = np.empty_like(x)
    kernels.split_share(x, send, 1 / 3)
    np.testing.assert_allclose(x, x0 / 3, rtol=tol(dtype) * 4)
    assert np.array_equal(send, x)
    z = np.empty_like(x)
    kernels.debias(z, x, 1 / 3)
    np.testing.assert_allclose(z, x0, rtol=tol(dtype) * 10, atol=tol(dtype) * 10)
    x = x0.astype(dtype)
    kernels.elastic(x, c, 0.25)
    u = 0.25 * (x0 - c0)
    np.testing.assert_allclose(c, u, rtol=tol(dtype) * 10, atol=tol(dtype) * 10)
    np.testing.assert_allclose(x, x0 - u, rtol=tol(dtype) * 10, atol=tol(dtype) * 10)
    kernels.scale(x, 2.0)
    np.testing.assert_allclose(x, 2 * (x0 - u), rtol=tol(dtype) * 10, atol=tol(dtype) * 10)


def test_elastic_conserves_mass_exactly():
    x = np.arange(16, dtype=np.float64)
    c = np.full(16, 3.0)
    total = x + c
    kernels.elastic(x, c, 0.5)  # c now holds u; the center becomes 3 + u
    assert np.array_equal(x + (3.0 + c), total)


@pytest.mark.parametrize("dtype", DTYPES + [np.float16])
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("lr, mu, nesterov, w", [(1.0, 0.0, False, 1.0), (0.7, 0.9, True, 1.0),
                                                  (1.0, 0.5, False, 0.25), (0.7, 0.9, True, 3.0)])
def test_outer_step_matches_reference(dtype, n, lr, mu, nesterov, w):
    a0, z0, m0 = rng_arrays(n, 3, dtype, seed=n)
    x0 = (z0.astype(np.float64) * w).astype(dtype)
    a, x, m = a0.copy(), x0.copy(), m0.copy()
    kernels.outer(a, x, m, lr, mu, nesterov=nesterov, w=w)
    g = a0.astype(np.float64) - x0.astype(np.float64) / w
    m_ref = mu * m0 + g
    a_ref = a0 - lr * (g + mu * m_ref if nesterov else m_ref)
    t = tol(dtype) * 50
    np.testing.assert_allclose(m, m_ref, rtol=t, atol=t)
    np.testing.assert_allclose(a, a_ref, rtol=t, atol=t)
    np.testing.assert_allclose(x, w * a_ref, rtol=t, atol=t)


def test_outer_step_with_unit_rate_is_plain_averaging():
    """lr = 1, no momentum: the anchor becomes the averaged model (to rounding; the outer
    class copies instead, exactly)."""
    a, m = np.arange(10.0), np.zeros(10)
    x = np.linspace(-1, 1, 10)
    avg = x.copy()
    kernels.outer(a, x, m, 1.0)
    np.testing.assert_allclose(a, avg, rtol=0, atol=1e-15)
    assert np.array_equal(x, a)


def test_operand_checks():
    with pytest.raises(ValueError, match="differ"):
        kernels.weighted_sum(np.zeros(3), np.zeros(4), 1.0)
    with pytest.raises(ValueError, match="weights"):
        kernels.weighted_sum(np.zeros(3), np.zeros(3), 1.0, [np.zeros(3)], [])


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed on this machine")
def test_cuda_source_compiles_with_nvcc(tmp_path):
    inst = "".join(f"(void*)&{e}, " for e in kernels.kernel_expressions() + wire.kernel_expressions())
    src = tmp_path / "check.cu"
    src.write_text(f'#include "{kernels.CUDA_SOURCE_PATH}"\nvoid* all_kernels[] = {{{inst}}};\n')
    proc = subprocess.run(["nvcc", *kernels.NVRTC_OPTIONS, "-c", str(src), "-o", str(tmp_path / "check.o")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


def _gpu_available():
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


gpu = pytest.mark.skipif(not _gpu_available(), reason="no CUDA GPU (or CuPy) on this machine: GPU path untested here")


@gpu
@pytest.mark.parametrize("dtype", DTYPES + [np.float16])
@pytest.mark.parametrize("k", [0, 1, 2, 3, 4, 8, 9])
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_cupy_kernels_match_numpy(dtype, k, offset):
    """Every kernel against numpy: 16-byte packs (offset 0) and element by element (views
    starting 1 or 3 elements in, not 16-byte aligned), a ragged tail, 0-9 received buffers
    (more than 8 go through the device array of pointers)."""
    import cupy
    n = 100003

    def dev(a):  # a device copy of a, starting `offset` elements into its allocation
        d = cupy.empty(a.size + offset, a.dtype)[offset:]
        d[...] = cupy.asarray(a)
        return d

    x, c, *recvs = rng_arrays(n, k + 2, dtype, seed=k)
    weights = [1.0 / (k + 1)] * k
    ref_out, ref_z = x.copy(), np.empty_like(x)
    kernels.weighted_sum(ref_out, ref_out, 1.0 / (k + 1), [r.copy() for r in recvs], weights, z=ref_z, w=0.5)
    gx, gz = dev(x), dev(np.zeros(n, dtype))
    kernels.weighted_sum(gx, gx, 1.0 / (k + 1), [dev(r) for r in recvs], weights, z=gz, w=0.5)
    t = tol(dtype) * 100
    np.testing.assert_allclose(gx.get(), ref_out, rtol=t, atol=t)
    np.testing.assert_allclose(gz.get(), ref_z, rtol=t, atol=t)
    hx, hc = x.copy(), c.copy()
    kernels.elastic(hx, hc, 0.3)
    dx, dc = dev(x), dev(c)
    kernels.elastic(dx, dc, 0.3)
    np.testing.assert_allclose(dx.get(), hx, rtol=t, atol=t)
    np.testing.assert_allclose(dc.get(), hc, rtol=t, atol=t)
    send = dev(np.zeros(n, dtype))
    kernels.split_share(dx, send, 0.5)
    assert cupy.array_equal(dx, send)
    kernels.debias(gz, dx, 0.5)
    kernels.scale(dx, 2.0)
    np.testing.assert_allclose(gz.get(), dx.get(), rtol=t, atol=t)
    for nesterov, w in ((False, 1.0), (True, 0.5)):  # the outer step, both momentum forms
        ha, hx, hm = x.copy(), c.copy(), (x - c).astype(dtype)
        da, dx2, dm = dev(ha), dev(hx), dev(hm)
        kernels.outer(ha, hx, hm, 0.7, 0.9, nesterov=nesterov, w=w)
        kernels.outer(da, dx2, dm, 0.7, 0.9, nesterov=nesterov, w=w)
        for d, h in ((da, ha), (dx2, hx), (dm, hm)):
            np.testing.assert_allclose(d.get(), h, rtol=t * 10, atol=t * 10)


@gpu
@pytest.mark.parametrize("dtype", DTYPES + [np.float16])
@pytest.mark.parametrize("fmt", list(wire.FORMATS))
@pytest.mark.parametrize("k", [0, 1, 3, 9])
def test_cupy_wire_kernels_match_numpy(dtype, fmt, k):
    """The wire kernels against the numpy path: the encoded bytes (bf16 and int8 equal bit for
    bit up to one unit where a fused multiply-add rounds once), the error kept in x, and the
    decode-sum of k messages (more than 8 go in groups), on a ragged size."""
    import cupy
    if fmt != "int8" and dtype == np.float16:
        pytest.skip("16-bit wire on a 16-bit buffer is refused")
    n = 3 * wire.INT8_BLOCK * 7 + 13
    code = wire.Wire(fmt, dtype)
    x, *parts = rng_arrays(n, k + 1, dtype, seed=k)
    hb, hx = np.empty(code.nbytes(n), np.uint8), x.copy()
    code.encode(hx, hb, share=0.5)
    db, dx = cupy.empty(code.nbytes(n), np.uint8), cupy.asarray(x)
    code.encode(dx, db, share=0.5)
    t = tol(dtype) * 100
    hd, dd = np.empty(n, dtype), cupy.empty(n, dtype)
    code.decode(hb, hd)
    code.decode(db, dd)
    step = np.abs(x).max() / 127 if fmt == "int8" else np.abs(x).max() * 2.0 ** -7
    np.testing.assert_allclose(dd.get(), hd, rtol=0, atol=step * 1.01)
    np.testing.assert_allclose(dx.get() + 0.5 * dd.get(), x, rtol=t, atol=t)  # the error kept
    wires = []
    for p in parts:
        b = np.empty(code.nbytes(n), np.uint8)
        code.encode(p.copy(), b)
        wires.append(b)
    weights = [1.0 / (k + 1)] * k
    ho, hz = np.empty(n, dtype), np.empty(n, dtype)
    code.decode_sum(ho, x, 0.25, wires, weights, z=hz, w=0.5)
    do, dz = cupy.empty(n, dtype), cupy.empty(n, dtype)
    code.decode_sum(do, cupy.asarray(x), 0.25, [cupy.asarray(b) for b in wires], weights, z=dz, w=0.5)
    np.testing.assert_allclose(do.get(), ho, rtol=t, atol=t)
    np.testing.assert_allclose(dz.get(), hz, rtol=t, atol=t)


@gpu
@pytest.mark.parametrize("fmt", list(wire.FORMATS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cupy_wire_kernels_round_and_treat_non_finite_values_as_the_cpu(fmt, dtype):
    """One generator and one treatment of NaN/inf on CPU and GPU: every format's stochastic
    rounding draws the same bits for (rank, step, element) on both and computes alike (the
    same encoded bytes, so a CPU rank and a GPU rank round alike), a NaN or inf is sent non-finite in its element only
    (CUDA's fmaxf/fminf skip NaN: a NaN once vanished into -127), and a block of tiny values
    stays finite."""
    import cupy
    n = 3 * wire.INT8_BLOCK + 11
    rng = np.random.default_rng(9)
    x = (rng.standard_normal(n) * 3).astype(dtype)
    x[wire.INT8_BLOCK + 3], x[wire.INT8_BLOCK + 4], x[2 * wire.INT8_BLOCK + 9] = np.nan, np.inf, -np.inf
    x[:wire.INT8_BLOCK] = np.linspace(-1e-38, 1e-38, wire.INT8_BLOCK)
    bad = ~np.isfinite(x)
    code = wire.Wire(fmt, dtype, seed=5)
    hb, hx = np.empty(code.nbytes(n), np.uint8), x.copy()
    code.encode(hx, hb, share=0.5, salt=17, offset=wire.INT8_BLOCK * 8)
    db, dx = cupy.empty(code.nbytes(n), np.uint8), cupy.asarray(x)
    code.encode(dx, db, share=0.5, salt=17, offset=wire.INT8_BLOCK * 8)
    hd, dd = np.empty(n, dtype), cupy.empty(n, dtype)
    code.decode(hb, hd)
    code.decode(db, dd)
    dd, dx = dd.get(), dx.get()
    assert np.all(~np.isfinite(dd[bad])) and np.all(np.isfinite(dd[~bad])), "GPU: a NaN/inf moved or vanished"
    assert np.array_equal(dx[bad], x[bad], equal_nan=True), "GPU: the sender lost its non-finite value"
    assert np.array_equal(db.get(), hb), "CPU and GPU encoded differently (random bits, scales or rounding)"
    step = np.nanmax(np.abs(np.where(bad, 0, x))) / 127 if fmt == "int8" else np.abs(np.where(bad, 0, x)) * 2.0 ** -7
    np.testing.assert_allclose(dd[~bad], hd[~bad], rtol=0, atol=(step if np.isscalar(step) else step[~bad]).max() * 1.01)


@gpu
@pytest.mark.parametrize("fmt", list(wire.FORMATS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("share, scale", [(0.3, 1.0), (0.0, 0.3)])
def test_cupy_encodes_bit_for_bit_as_the_cpu_with_any_share_and_scale(fmt, dtype, share, scale):
    """A share other than 1/2 (``share * d`` rounds: a fused multiply-add would round once where
    numpy rounds twice) and a scale other than 1 (the 16-bit formats round ``scale * x`` once
    from the buffer's precision): the wire bytes and the error kept in x equal the CPU's bit
    for bit."""
    import cupy
    n = 3 * wire.INT8_BLOCK * 5 + 7
    rng = np.random.default_rng(11)
    if scale == 1.0:
        x = (rng.standard_normal(n) * 3).astype(dtype)
    else:   # scale * x within a few float32 units of a bf16 or fp16 rounding tie (where the order shows)
        dropped = 16 if fmt == "bf16" else 13
        tie = (rng.integers(0x3C00, 0x4300, n, dtype=np.uint32) << 16 | 1 << (dropped - 1)) + \
            rng.integers(-2, 3, n).astype(np.uint32)
        x = (tie.view(np.float32).astype(np.float64) / scale).astype(dtype)
    code = wire.Wire(fmt, dtype, seed=2)
    hb, hx = np.empty(code.nbytes(n), np.uint8), x.copy()
    code.encode(hx, hb, share=share, scale=scale, salt=3)
    db, dx = cupy.empty(code.nbytes(n), np.uint8), cupy.asarray(x)
    code.encode(dx, db, share=share, scale=scale, salt=3)
    assert np.array_equal(db.get(), hb), "CPU and GPU encoded differently"
    assert np.array_equal(dx.get(), hx), "CPU and GPU kept different errors"

