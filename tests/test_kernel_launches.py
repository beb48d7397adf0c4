"""Every CuPy kernel launch passes the arguments its kernel in ``cuda/kernels.cu`` declares,
checked without a GPU.

A launch through CuPy's ``RawKernel`` is not type-checked: a missing argument or a Python
``int`` where the kernel takes an ``int`` (CuPy passes 8 bytes) reads garbage on the device
(an int8 encode once read its length from the random seed: launched with seven arguments,
declared with five). Here the GPU path of :mod:`mpigossip.core.kernels` and :mod:`mpigossip.core.wire`
runs against stand-in device arrays and a stand-in ``cupy``; each launch is checked, argument by
argument, against the signature parsed from the CUDA source: count, scalar types (the exact
numpy type of the C type), and device pointers of the element type the template names.
"""

import contextlib
import re
import sys
import types

import numpy as np
import pytest

from mpigossip.core import kernels, wire

SCALARS = {"double": np.float64, "float": np.float32, "int": np.int32, "unsigned int": np.uint32,
           "long long": np.int64, "unsigned long long": np.uint64}
ELEMENTS = {"__half": np.float16, "float": np.float32, "double": np.float64, "unsigned char": np.uint8,
            "unsigned long long": np.uint64}


def signatures():
    """``{kernel: (template parameter names, [(C type, is pointer)])}`` from kernels.cu."""
    source = re.sub(r"//[^\n]*", "", kernels.cuda_source())
    found = {}
    for tmpl, name, params in re.findall(r"template\s*<([^>]*)>\s*__global__\s+void\s+(\w+)\s*\(([^)]*)\)",
                                         source):
        names = [p.split()[-1] for p in tmpl.split(",")]
        args = []
        for p in params.split(","):
            words = p.replace("*", " * ").split()
            pointer = "*" in words
            ctype = " ".join(w for w in words[:-1] if w not in ("const", "*", "__restrict__"))
            args.append((ctype, pointer))
        found[name] = (names, args)
    return found


SIGNATURES = signatures()


class Device:
    id = 0


class Data:
    def __init__(self, ptr):
        self.ptr = ptr


class DeviceArray:
    """Stands in for a 1-D cupy array: what the GPU paths read (size, dtype, device, pointer)."""

    _next = 1 << 20

    def __init__(self, n, dtype, *, offset=0):
        self.size, self.shape, self.dtype = n, (n,), np.dtype(dtype)
        DeviceArray._next += 1 << 20
        self.data = Data(DeviceArray._next + offset)   # aligned to 16 bytes unless offset
        self.device = Device()


class Launches:
    """Replaces ``kernels.function``: each launch is checked against kernels.cu and recorded."""

    def __init__(self):
        self.kernels = set()

    def __call__(self, device_id, expression):
        name, _, rest = expression.partition("<")
        values = [v.strip() for v in rest.rstrip(">").split(",")]
        assert name in SIGNATURES, f"{expression}: no such kernel in kernels.cu"
        names, params = SIGNATURES[name]
        assert len(values) == len(names), f"{expression}: {len(values)} template arguments, declared {names}"
        template = dict(zip(names, values))

        def launch(grid, block, args):
            assert isinstance(grid, tuple) and isinstance(block, tuple), (grid, block)
            assert all(isinstance(g, int) and 1 <= g <= kernels.MAX_GRID for g in grid), (expression, grid)
            assert all(isinstance(b, int) and 1 <= b <= 1024 for b in block), (expression, block)
            assert len(args) == len(params), (f"{expression}: launched with {len(args)} arguments, kernels.cu "
                                              f"declares {len(params)}: {params}")
            for i, (arg, (ctype, pointer)) in enumerate(zip(args, params)):
                where = f"{expression} argument {i} ({ctype}{' *' if pointer else ''})"
                if pointer:
                    if isinstance(arg, np.uint64):   # a raw device pointer
                        continue
                    assert isinstance(arg, DeviceArray), f"{where}: got {type(arg).__name__}"
                    element = ELEMENTS[template.get(ctype, ctype)]
                    assert arg.dtype == element, f"{where}: an array of {arg.dtype}"
                else:
                    assert type(arg) is SCALARS[ctype], f"{where}: got {type(arg).__name__} {arg!r}"
            self.kernels.add(name)
        return launch


@pytest.fixture
def launches(monkeypatch):
    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(Device=lambda i: contextlib.nullcontext())
    cupy.asarray = lambda a: DeviceArray(a.size, a.dtype)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    recorder = Launches()
    monkeypatch.setattr(kernels, "_function", recorder)
    monkeypatch.setattr(kernels, "function", recorder)
    kernels._device_array.cache_clear()
    yield recorder
    kernels._device_array.cache_clear()


DTYPES = (np.float16, np.float32, np.float64)


@pytest.mark.parametrize("offset", [0, 2], ids=["aligned", "unaligned"])
def test_every_kernel_launch_matches_its_declaration(launches, offset):
    n = 4099
    for dtype in DTYPES:
        def arr():
            return DeviceArray(n, dtype, offset=offset)
        x, out, z = arr(), arr(), arr()
        for k in (0, 1, 3, kernels.MAX_DIRECT_RECVS, kernels.MAX_DIRECT_RECVS + 1, 13):
            recvs = [arr() for _ in range(k)]
            kernels.weighted_sum(out, x, 0.5, recvs, [0.5 / max(k, 1)] * k)
            kernels.weighted_sum(x, x, 0.25, recvs, [0.75 / max(k, 1)] * k, z=z, w=0.5)
        kernels.split_share(x, arr(), 0.5)
        kernels.debias(z, x, 0.3)
        kernels.elastic(x, arr(), 0.1)
        kernels.scale(x, 2.0)
        kernels.outer(arr(), x, arr(), 0.7, 0.9, nesterov=True, w=0.5)
        kernels.outer(arr(), x, arr(), 1.0)
    assert launches.kernels == set(kernels.KERNEL_NAMES)


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "int8"])
def test_every_wire_launch_matches_its_declaration(launches, fmt):
    n = 3 * wire.INT8_BLOCK + 7
    tried = 0
    for dtype in DTYPES:
        try:
            w = wire.Wire(fmt, dtype, seed=5)
        except ValueError:   # a format the dtype does not take
            continue
        tried += 1
        x = DeviceArray(n, dtype)
        packed = DeviceArray(w.nbytes(n), np.uint8)
        w.encode(x, packed, share=0.5, salt=3, offset=1024)
        w.encode(x, packed, scale=0.25)
        for k in (0, 1, kernels.MAX_DIRECT_RECVS, kernels.MAX_DIRECT_RECVS + 3):
            wires = [DeviceArray(w.nbytes(n), np.uint8) for _ in range(k)]
            w.decode_sum(DeviceArray(n, dtype), x, 0.5, wires, [0.5 / max(k, 1)] * k)
            w.decode_sum(x, x, 0.5, wires, [0.5 / max(k, 1)] * k, z=DeviceArray(n, dtype), w=0.5)
    assert tried
    assert launches.kernels == {"encode_int8" if fmt == "int8" else "encode16", "decode_sum"}


def test_the_checker_sees_a_wrong_launch(launches):
    """The check itself: one argument too few, and an int where the kernel takes a double."""
    x = DeviceArray(100, np.float32)
    launch = kernels.function(0, "scale<float, 1>")
    with pytest.raises(AssertionError, match="launched with 2 arguments, kernels.cu declares 3"):
        launch((1,), (256,), (x, np.float64(2.0)))
    with pytest.raises(AssertionError, match="argument 1 .*got int"):
        launch((1,), (256,), (x, 2, np.int64(100)))
    with pytest.raises(AssertionError, match="an array of float64"):
        launch((1,), (256,), (DeviceArray(100, np.float64), np.float64(2.0), np.int64(100)))


def test_every_kernel_in_the_source_is_parsed():
    assert set(SIGNATURES) == set(kernels.KERNEL_NAMES) | {"encode16", "encode_int8", "decode_sum"}
    names, params = SIGNATURES["encode_int8"]
    assert names == ["T"] and len(params) == 7 and params[-1] == ("long long", False)
