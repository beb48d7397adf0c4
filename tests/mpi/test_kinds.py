"""The communicators on every kind of buffer: numpy and torch (CPU) here, and CuPy and torch
CUDA (staged through host memory, and direct when the MPI is CUDA-aware) where a GPU exists.

Each test compares against the same operation on a plain numpy buffer, on integer-valued
float64 data with dyadic shares, where every path's arithmetic is exact: any difference is
a chunk combined twice, a stale slot, a missed device synchronisation or a bad staging copy.
"""

import numpy as np
import pytest

import mpigossip as mg
from mpigossip import topology as T
from mpigossip.core import buffers

from .helpers import comm, global_sum


def _gpu():
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def _torch():
    try:
        import torch  # noqa: F401
        return True
    except ImportError:
        return False


GPU, TORCH = _gpu(), _torch()
NO_GPU = "no CUDA GPU (or CuPy) on this machine: device buffers untested here"
CUDA_AWARE = GPU and buffers.cuda_aware()[0]

KINDS = [
    pytest.param("numpy", None, id="numpy"),
    pytest.param("numpy", True, id="numpy-staged"),
    pytest.param("torch", None, id="torch-cpu", marks=pytest.mark.skipif(not TORCH, reason="torch not installed")),
    pytest.param("cupy", True, id="cupy-staged", marks=pytest.mark.skipif(not GPU, reason=NO_GPU)),
    pytest.param("cupy", None, id="cupy-direct", marks=pytest.mark.skipif(
        not CUDA_AWARE, reason="no GPU with a CUDA-aware MPI here: direct device transfers untested")),
    pytest.param("torch-cuda", True, id="torch-cuda-staged",
                 marks=pytest.mark.skipif(not (GPU and TORCH), reason=NO_GPU)),
    pytest.param("torch-cuda", None, id="torch-cuda-direct", marks=pytest.mark.skipif(
        not (CUDA_AWARE and TORCH), reason="no GPU with a CUDA-aware MPI here: direct device transfers untested")),
]

#: One case per kind, for what takes no ``stage`` (EASGD: the server's windows are in host memory, so a
#: device buffer always goes through it): the same test twice would check nothing more.
KIND_ONLY = [p for p in KINDS if p.id in ("numpy", "torch-cpu", "cupy-staged", "torch-cuda-staged")]


def make(kind, host):
    """A buffer of ``kind`` holding ``host`` (one device per rank, round robin)."""
    if kind == "numpy":
        return host.copy()
    if kind == "torch":
        import torch
        return torch.from_numpy(host.copy())
    import cupy
    device = comm().rank % cupy.cuda.runtime.getDeviceCount()
    if kind == "cupy":
        with cupy.cuda.Device(device):
            return cupy.asarray(host)
    import torch
    return torch.from_numpy(host.copy()).to(f"cuda:{device}")


def to_host(array):
    if isinstance(array, np.ndarray):
        return array
    if hasattr(array, "get"):
        return array.get()
    return array.cpu().numpy()


def integer_data(n=1031):
    return np.random.default_rng(500 + comm().rank).integers(-1000, 1000, n).astype(np.float64)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("kind, stage", KINDS)
@pytest.mark.parametrize("algorithm", ["mpi", "ring", "node-ring"])
def test_average_on_every_kind(kind, stage, algorithm):
    """Every allreduce algorithm on every buffer kind against MPI's on numpy, bit for bit
    (integer data: every order of the additions is exact); the rings in small segments."""
    c = comm()
    host = integer_data()
    ref = host.copy()
    x = make(kind, host)
    with mg.AllreduceAverager(x, comm=c, stage=stage, chunk_bytes=800, algorithm=algorithm,
                              segment_bytes=8 * 37) as avg, \
            mg.AllreduceAverager(ref, comm=c) as plain:
        avg.average()
        plain.average()
        np.testing.assert_array_equal(to_host(x), ref)
        avg.start()
        plain.start()
        avg.finish()
        plain.finish()
        np.testing.assert_array_equal(to_host(x), ref)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind, stage", KINDS)
def test_pushsum_on_every_kind(kind, stage):
    """Synchronous steps in many chunks, with the fused de-bias; then overlap steps."""
    c = comm()
    host = integer_data()
    x, ref = make(kind, host), host.copy()
    z, zref = make(kind, np.zeros_like(host)), np.zeros_like(host)
    topo = T.ExponentialGraph(peers=1)
    ps = mg.PushSum(x, comm=c, topology=topo, z=z, stage=stage, chunk_bytes=800, slots=2)
    plain = mg.PushSum(ref, comm=c, topology=topo, z=zref)
    for _ in range(8):
        ps.step()
        plain.step()
    np.testing.assert_array_equal(to_host(x), ref)
    np.testing.assert_array_equal(to_host(z), zref)
    assert ps.weight == plain.weight
    ps.free()
    plain.free()
    # Overlap mode: arrivals depend on timing, so check the invariant: mass is conserved.
    total = global_sum(c, host)
    ps = mg.PushSum(x, comm=c, topology=topo, stage=stage, max_delay=1)
    for _ in range(6):
        ps.start()
        ps.finish()
    ps.drain()
    assert np.array_equal(global_sum(c, to_host(x)), total)
    assert c.allreduce(ps.weight) == c.size
    ps.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind, stage", KINDS)
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_gossip_on_every_kind(kind, stage, mode):
    """Rank r starts from the constant vector r + 1. Push is deterministic from the seed: equal
    bit for bit to the same rounds on plain numpy buffers. Pull depends on when peers
    published: every rank's vector stays constant (no torn read), a convex combination of the
    starting values, and the rounds did mix (the ranks' spread shrank)."""
    c = comm()
    host = np.full(1031, float(c.rank + 1))
    x = make(kind, host)
    g = mg.Gossip(x, comm=c, mode=mode, seed=5, stage=stage)
    for _ in range(4):
        g.step()
    got = to_host(x)
    g.free()
    if mode == "push":
        ref = host.copy()
        with mg.Gossip(ref, comm=c, mode=mode, seed=5) as r:
            for _ in range(4):
                r.step()
        np.testing.assert_array_equal(got, ref)
    assert np.all(got == got[0]), "a torn vector"
    assert 1.0 <= got[0] <= c.size
    values = c.allgather(float(got[0]))
    assert max(values) - min(values) < c.size - 1, f"no mixing: {values}"


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind, stage", KINDS)
@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_wire_formats_on_every_kind(kind, stage, fmt):
    """Compressed PushSum (sync in many chunks, then overlap) and AllReduce on each kind of
    buffer against the same on numpy buffers: the mass stays exact, the values agree (to the
    last bits: a GPU may fuse a multiply-add where numpy rounds twice), every rank ends
    AllReduce with the same bytes."""
    c = comm()
    host = integer_data() / 7.0
    x, ref = make(kind, host), host.copy()
    total = global_sum(c, host)
    topo = T.ExponentialGraph(peers=1)
    ps = mg.PushSum(x, comm=c, topology=topo, stage=stage, chunk_bytes=4096, wire=fmt)
    plain = mg.PushSum(ref, comm=c, topology=topo, chunk_bytes=4096, wire=fmt)
    for _ in range(6):
        ps.step()
        plain.step()
    np.testing.assert_allclose(to_host(x), ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(global_sum(c, to_host(x)), total, rtol=1e-12, atol=1e-9)
    ps.free()
    plain.free()
    ps = mg.PushSum(x, comm=c, topology=topo, stage=stage, max_delay=1, wire=fmt)
    for _ in range(4):
        ps.start()
        ps.finish()
    ps.drain()
    np.testing.assert_allclose(global_sum(c, to_host(x)), total, rtol=1e-12, atol=1e-9)
    ps.free()
    y, yref = make(kind, host), host.copy()
    with mg.AllreduceAverager(y, comm=c, stage=stage, wire=fmt) as avg, \
            mg.AllreduceAverager(yref, comm=c, wire=fmt) as plain:
        avg.average()
        plain.average()
    got = to_host(y)
    assert all(np.array_equal(got, other) for other in c.allgather(got))
    np.testing.assert_allclose(got, yref, rtol=1e-6, atol=1e-6)
