"""Wire formats (mpigossip.wire) on the CPU: rounding against references, the error kept by
the encode, decode-sums, limits (NaN, inf, saturation, all-zero blocks), bad arguments."""

import numpy as np
import pytest

from mpigossip import wire
from mpigossip.wire import INT8_BLOCK, Wire

FORMATS = list(wire.FORMATS)


def encoded(fmt, x, **kw):
    code = Wire(fmt, x.dtype)
    buf = np.empty(code.nbytes(x.size), np.uint8)
    code.encode(x, buf, **kw)
    return code, buf


def decoded(code, buf, n, dtype):
    out = np.full(n, np.nan, dtype)
    return code.decode(buf, out)


@pytest.mark.parametrize("n", [1, 7, INT8_BLOCK, 3 * INT8_BLOCK + 5, (1 << 15) + 999])
def test_bf16_rounds_to_nearest_even_like_torch(n):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * np.exp(rng.uniform(-20, 20, n))).astype(np.float32)
    code, buf = encoded("bf16", x.copy())
    ref = torch.from_numpy(x).to(torch.bfloat16).float().numpy()
    assert np.array_equal(decoded(code, buf, n, np.float32), ref)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_error_bounds_and_the_kept_error_is_exact(fmt, dtype):
    if fmt != "int8" and dtype == np.float16:
        pytest.skip("16-bit wire on a 16-bit buffer is refused")
    rng = np.random.default_rng(1)
    n = 5 * INT8_BLOCK + 17
    x = (rng.standard_normal(n) * 3).astype(dtype)
    code, buf = encoded(fmt, x.copy())
    d = decoded(code, buf, n, dtype).astype(np.float64)
    err = np.abs(d - x.astype(np.float64))
    if fmt == "bf16":
        assert np.all(err <= np.abs(x) * 2.0 ** -8)
    elif fmt == "fp16":
        assert np.all(err <= np.maximum(np.abs(x) * 2.0 ** -11, 2.0 ** -24))
    else:
        blocks = np.abs(np.pad(x.astype(np.float64), (0, -n % INT8_BLOCK))).reshape(-1, INT8_BLOCK).max(1)
        step = np.repeat(blocks / 127, INT8_BLOCK)[:n]
        held = np.abs(x.astype(np.float64)) * 2.0 ** -10 if dtype == np.float16 else 0  # fp16's own rounding
        assert np.all(err <= step * 0.5 + 1e-6 * step + held)
    assert err.max() > 0, "nothing was rounded: the test data is too easy"
    if dtype != np.float16:  # x - decoded is exact in the buffer's precision: nothing lost
        y = x.copy()
        code.encode(y, buf, keep=1.0)  # (bf16 now rounds stochastically: within one step)
        d = decoded(code, buf, n, dtype).astype(np.float64)
        assert np.array_equal(y.astype(np.float64) + d, x.astype(np.float64))
        if fmt == "bf16":
            assert np.all(np.abs(d - x) <= np.abs(x) * 2.0 ** -7)


def test_bf16_with_the_error_kept_rounds_stochastically_without_bias():
    """A value a quarter of the way between two bf16 values rounds up about a quarter of the
    time (rounding to nearest would always give the lower one), independently per seed."""
    lo = np.float32(1.0)
    x = np.full(1 << 15, lo + np.float32(2.0 ** -7) / 4, np.float32)
    ups = []
    for seed in (0, 1):
        code = Wire("bf16", np.float32, seed=seed)
        buf = np.empty(code.nbytes(x.size), np.uint8)
        code.encode(x.copy(), buf, keep=0.5)
        d = decoded(code, buf, x.size, np.float32)
        assert set(np.unique(d)) == {lo, lo + np.float32(2.0 ** -7)}
        ups.append(d > lo)
    for up in ups:
        assert abs(up.mean() - 0.25) < 0.02
    assert not np.array_equal(ups[0], ups[1]), "two ranks' seeds gave the same rounding"
    code, buf = encoded("bf16", x.copy())  # no error kept: to nearest
    assert np.all(decoded(code, buf, x.size, np.float32) == lo)


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_sum_matches_reference_and_debiases(fmt):
    rng = np.random.default_rng(2)
    n = 3 * INT8_BLOCK + 100
    x = rng.standard_normal(n)
    parts = [rng.standard_normal(n) for _ in range(3)]
    code = Wire(fmt, np.float64)
    bufs = [encoded(fmt, p.copy())[1] for p in parts]
    dec = [decoded(code, b, n, np.float64) for b in bufs]
    out, z = np.empty(n), np.empty(n)
    code.decode_sum(out, x, 0.25, bufs, [0.5, 0.125, 0.125], z=z, w=0.5)
    ref = 0.25 * x + 0.5 * dec[0] + 0.125 * dec[1] + 0.125 * dec[2]
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(z, ref / 0.5, rtol=1e-12, atol=1e-12)


def test_limits_nan_inf_saturation_and_zero_blocks():
    x = np.array([7e4, -7e4, np.nan, np.inf, -np.inf, 1.0], np.float32)
    code, buf = encoded("fp16", x.copy())
    d = decoded(code, buf, x.size, np.float32)
    assert d[0] == 65504 and d[1] == -65504 and np.isnan(d[2]) and d[3] == np.inf and d[4] == -np.inf
    odd_nan = np.frombuffer(np.uint32(0xFFFFFFFF).tobytes(), np.float32)[0]
    x = np.array([np.nan, odd_nan, -np.inf, 3e38, 1.0], np.float32)
    code, buf = encoded("bf16", x.copy())
    d = decoded(code, buf, x.size, np.float32)
    assert np.isnan(d[0]) and np.isnan(d[1]) and d[2] == -np.inf and np.isfinite(d[3])
    x = np.zeros(2 * INT8_BLOCK + 3)
    x[INT8_BLOCK:2 * INT8_BLOCK] = np.linspace(-1, 1, INT8_BLOCK)
    code, buf = encoded("int8", x.copy())
    d = decoded(code, buf, x.size, np.float64)
    assert np.all(np.isfinite(d)) and np.all(d[:INT8_BLOCK] == 0) and d[INT8_BLOCK] == -1 and d[2 * INT8_BLOCK - 1] == 1


def test_scaled_encode_and_layout():
    x = np.arange(INT8_BLOCK * 2 + 3, dtype=np.float32)
    code, buf = encoded("int8", x.copy(), scale=0.5)
    np.testing.assert_allclose(decoded(code, buf, x.size, np.float32), x * 0.5, rtol=0, atol=x.max() / 254)
    assert code.nbytes(x.size) == x.size + 4 * 3
    assert code.offset(INT8_BLOCK) == INT8_BLOCK + 4
    with pytest.raises(ValueError, match="multiple"):
        code.offset(3)
    assert Wire("bf16", np.float32).nbytes(10) == 20


def test_bad_arguments():
    with pytest.raises(ValueError, match="one of"):
        wire.check_wire("bf17")
    with pytest.raises(ValueError, match="as many bytes"):
        wire.check_wire("bf16", np.float16)
    assert wire.check_wire(None) is None and wire.check_wire("int8", np.float16) == "int8"
    code = Wire("bf16", np.float32)
    with pytest.raises(ValueError, match="need"):
        code.encode(np.zeros(4, np.float32), np.empty(3, np.uint8))
    with pytest.raises(ValueError, match="keep"):
        code.encode(np.zeros(4, np.float32), np.empty(8, np.uint8), keep=1.0, scale=0.5)
