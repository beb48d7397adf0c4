"""Wire formats (mpigossip.core.wire) on the CPU: rounding against references, the error kept by
the encode, decode-sums, limits (NaN, inf, saturation, all-zero blocks), bad arguments."""

import numpy as np
import pytest

from mpigossip.core import wire
from mpigossip.core.wire import INT8_BLOCK, Wire

FORMATS = list(wire.FORMATS)


def encoded(fmt, x, **kw):
    code = Wire(fmt, x.dtype)
    buf = np.empty(code.nbytes(x.size), np.uint8)
    code.encode(x, buf, **kw)
    return code, buf


def assert_kept(y, d, x):
    """The sender kept exactly what it did not send: y = x - d in the buffer's precision (y's
    dtype), one rounding (a stochastic rounding may land a whole grid step away, outside
    Sterbenz's exact range), so y + d == x to one unit in the last place of max(|x|, |d|)."""
    ulp = np.spacing(np.maximum(np.abs(x), np.abs(d)).astype(y.dtype)).astype(np.float64)
    err = np.abs(y.astype(np.float64) + d.astype(np.float64) - x.astype(np.float64))
    assert np.all(err <= ulp), "the kept error is not what was not sent"


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
        code.encode(y, buf, share=1.0)  # (bf16 now rounds stochastically: within one step)
        d = decoded(code, buf, n, dtype).astype(np.float64)
        assert_kept(y, d, x)
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
        code.encode(x.copy(), buf, share=0.5)
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
    with pytest.raises(ValueError, match="share"):
        code.encode(np.zeros(4, np.float32), np.empty(8, np.uint8), share=1.0, scale=0.5)


def _with_non_finite(n, dtype, seed=5):
    """A buffer of 3 int8 blocks and a bit, its non-finite positions (a NaN, +inf and -inf in
    block 1, a NaN alone in block 2), and the same buffer with zeros there."""
    rng = np.random.default_rng(seed)
    clean = (rng.standard_normal(n) * 3).astype(dtype)
    clean[INT8_BLOCK + 7] = 50.0  # the block's largest finite value is not at a bad position
    x = clean.copy()
    bad = np.zeros(n, bool)
    for i, v in ((INT8_BLOCK + 3, np.nan), (INT8_BLOCK + 4, np.inf), (INT8_BLOCK + 5, -np.inf),
                 (2 * INT8_BLOCK + 9, np.nan)):
        x[i], clean[i], bad[i] = v, 0.0, True
    return x, clean, bad


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("share", [0.0, 1.0, 0.5])
def test_a_non_finite_value_stays_in_its_element_and_harms_nothing_else(fmt, dtype, share):
    """One NaN or inf: non-finite in that element after decoding (NaN stays NaN; inf keeps its
    sign in bf16/fp16, int8 has one spare code and sends both as NaN), every other element of its
    block decoded exactly as without it (int8's scale leaves it out), and with the error kept
    the sender keeps the element as it was (not inf - inf) and exactly what it did not send
    elsewhere."""
    if fmt != "int8" and dtype == np.float16:
        pytest.skip("16-bit wire on a 16-bit buffer is refused")
    n = 3 * INT8_BLOCK + 11
    x, clean, bad = _with_non_finite(n, dtype)
    code = Wire(fmt, dtype, seed=3)
    y, yc = x.copy(), clean.copy()
    buf, bufc = np.empty(code.nbytes(n), np.uint8), np.empty(code.nbytes(n), np.uint8)
    code.encode(y, buf, share=share, salt=4)
    code.encode(yc, bufc, share=share, salt=4)
    d, dc = decoded(code, buf, n, dtype), decoded(code, bufc, n, dtype)
    assert np.all(~np.isfinite(d[bad])), "a non-finite value was sent as a finite one"
    assert np.all(np.isnan(d[bad]) == np.isnan(x[bad])) or fmt == "int8"
    if fmt != "int8":
        assert np.array_equal(d[bad & np.isinf(x)], x[bad & np.isinf(x)]), "inf lost its sign"
    assert np.array_equal(d[~bad], dc[~bad]), "a non-finite value changed its neighbours"
    if share:
        assert np.array_equal(y[bad], x[bad], equal_nan=True), "the sender lost its non-finite value"
        assert np.array_equal(y[~bad], yc[~bad])
        if share == 1.0 and dtype != np.float16:  # (exact in the buffer's precision, as above)
            assert_kept(y[~bad], d[~bad], x[~bad])


def test_int8_blocks_of_tiny_values_stay_finite_and_keep_their_error():
    """A block whose largest value is below ~1e-37 (or zero): 127 / max would overflow float32;
    nothing may come out inf or NaN, and the kept error is still exactly what was not sent."""
    n = 3 * INT8_BLOCK
    x = np.zeros(n, np.float32)
    x[:INT8_BLOCK] = np.linspace(-1e-38, 1e-38, INT8_BLOCK, dtype=np.float32)   # subnormal range
    x[INT8_BLOCK:2 * INT8_BLOCK] = np.linspace(-2e-37, 2e-37, INT8_BLOCK, dtype=np.float32)
    code = Wire("int8", np.float32)
    buf = np.empty(code.nbytes(n), np.uint8)
    with np.errstate(over="raise", invalid="raise", divide="raise"):  # (a subnormal scale may underflow)
        y = x.copy()
        code.encode(y, buf, share=1.0)
        d = decoded(code, buf, n, np.float32)
    assert np.all(np.isfinite(d)) and np.all(np.isfinite(y))
    assert np.all(d[2 * INT8_BLOCK:] == 0)
    assert_kept(y, d, x)
    np.testing.assert_allclose(d, x, rtol=0, atol=wire._INT8_TINY / 127)  # one step: it rounds stochastically


def test_the_random_bits_are_one_generator_with_no_short_period():
    """wire.random_bits against the formula written out in Python (the CUDA kernel computes
    the same: tests/test_kernels.py compares them on a GPU): per element, per step key, no
    repeat at the old table's period, and uniform."""
    def reference(i, key):
        h = (i * 0x9E3779B1 + key) & 0xFFFFFFFF
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & 0xFFFFFFFF
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & 0xFFFFFFFF
        h ^= h >> 16
        return h >> 16
    key = wire.random_key(7, 12)
    for first in (0, 5, (1 << 32) - 3, 123456789012):
        bits = wire.random_bits(first, 64, key)
        assert [int(b) for b in bits] == [reference(first + j, key) for j in range(64)]
    a = wire.random_bits(0, 1 << 15, key)
    b = wire.random_bits(1 << 15, 1 << 15, key)
    assert np.mean(a == b) < 0.01, "elements i and i + 32768 share their bits"
    assert abs(a.mean() / 65535 - 0.5) < 0.01
    assert np.mean(wire.random_bits(0, 1 << 15, wire.random_key(7, 13)) == a) < 0.01, "the step is ignored"
    assert np.mean(wire.random_bits(0, 1 << 15, wire.random_key(8, 12)) == a) < 0.01, "the rank is ignored"


GRIDS = {  # (a value a quarter of the way up, the grid values below and above it)
    "bf16": (1.0 + 2.0 ** -7 / 4, 1.0, 1.0 + 2.0 ** -7),
    "fp16": (1.0 + 2.0 ** -10 / 4, 1.0, 1.0 + 2.0 ** -10),
    "int8": (10.25, 10.0, 11.0),  # with a block maximum of 127: the scale is 1
}


@pytest.mark.parametrize("fmt", FORMATS)
def test_stochastic_rounding_draws_new_bits_every_step_both_ways(fmt):
    """Every format, with the error kept: the same value a quarter of the way up, encoded at
    many steps, rounds up in about a quarter of them (unbiased), each element both ways over
    the steps (the step is not ignored), and two steps draw different bits. Without a kept
    error: always to nearest."""
    value, lo, up = GRIDS[fmt]
    x = np.full(4 * INT8_BLOCK, value, np.float32)
    x[::INT8_BLOCK] = 127.0  # each int8 block's maximum (scale 1)
    probe = np.ones(x.size, bool)
    probe[::INT8_BLOCK] = False
    code = Wire(fmt, np.float32, seed=2)
    buf = np.empty(code.nbytes(x.size), np.uint8)
    ups = []
    for step in range(64):
        code.encode(x.copy(), buf, share=0.5, salt=step)
        d = decoded(code, buf, x.size, np.float32)[probe]
        assert set(np.unique(d)) <= {np.float32(lo), np.float32(up)}
        ups.append(d == np.float32(up))
    ups = np.array(ups)
    per_element = ups.mean(axis=0)
    assert np.mean((per_element > 0) & (per_element < 1)) > 0.99, "elements round the same way at every step"
    assert abs(ups.mean() - 0.25) < 0.01, "biased rounding"
    assert not np.array_equal(ups[0], ups[1]), "two steps drew the same bits"
    code.encode(x.copy(), buf)  # no error kept: to nearest
    assert np.all(decoded(code, buf, x.size, np.float32)[probe] == np.float32(lo))


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_a_scaled_float64_encode_rounds_once_to_float32_then_to_the_wire(fmt):
    """``scale * x`` of a float64 buffer is formed in float64 and rounded to float32 once, then
    to the wire format, as the CUDA kernel does: the same bytes as encoding the float32 product.
    (Casting x to float32 first, then multiplying, rounds twice; the values are chosen within a
    few float32 units of a wire rounding tie, where the two orders round apart.)"""
    n = 4 * INT8_BLOCK
    rng = np.random.default_rng(5)
    dropped = 16 if fmt == "bf16" else 13   # float32 mantissa bits the wire format drops
    high = rng.integers(0x3C00, 0x4300, n, dtype=np.uint32) << 16 if fmt == "bf16" else \
        rng.integers(0x3800, 0x4600, n, dtype=np.uint32) << 16
    tie = (high | (1 << (dropped - 1))) + rng.integers(-2, 3, n).astype(np.uint32)
    scale = 0.3
    x = tie.view(np.float32).astype(np.float64) / scale
    code64, code32 = Wire(fmt, np.float64), Wire(fmt, np.float32)
    b64, b32 = np.empty(code64.nbytes(n), np.uint8), np.empty(code32.nbytes(n), np.uint8)
    code64.encode(x.copy(), b64, scale=scale)
    code32.encode((x * scale).astype(np.float32), b32)
    assert np.array_equal(b64, b32)
