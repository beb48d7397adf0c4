"""Buffer layer: zero-copy views, clear errors, the staging path, CUDA-aware override, the launcher."""

import os

import numpy as np
import pytest

from mpigossip.core import buffers
from mpigossip.launch import launcher


def test_numpy_is_viewed_zero_copy():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = buffers.as_buffer(a)
    assert b.kind == "numpy" and b.size == 12 and b.dtype == np.float32 and not b.on_device
    assert np.shares_memory(b.array, a)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_torch_cpu_is_viewed_zero_copy(dtype):
    torch = pytest.importorskip("torch")
    t = torch.zeros(10, dtype=getattr(torch, dtype), requires_grad=True)
    b = buffers.as_buffer(t)
    assert b.kind == "torch" and str(b.dtype) == dtype
    b.array[3] = 7
    assert float(t.detach()[3]) == 7.0
    back = b.like(b.array)
    assert isinstance(back, torch.Tensor) and back.data_ptr() == t.data_ptr()


def test_torch_errors():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="bfloat16"):
        buffers.as_buffer(torch.zeros(4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="not contiguous"):
        buffers.as_buffer(torch.zeros(4, 4).t())
    with pytest.raises(TypeError, match="int64"):
        buffers.as_buffer(torch.zeros(4, dtype=torch.int64))


def test_numpy_errors():
    with pytest.raises(ValueError, match="not C-contiguous"):
        buffers.as_buffer(np.zeros((4, 4))[:, 1])
    with pytest.raises(TypeError, match="int32 is not supported"):
        buffers.as_buffer(np.zeros(4, dtype=np.int32))
    with pytest.raises(ValueError, match="empty"):
        buffers.as_buffer(np.zeros(0))
    with pytest.raises(TypeError, match="expected a numpy array"):
        buffers.as_buffer([1.0, 2.0])


def test_staged_transport_round_trip_on_cpu():
    a = np.arange(9, dtype=np.float64)
    t = buffers.Transport(a, stage=True)
    assert t.staged and t.spec[0] is t.host and not np.shares_memory(t.host, a)
    t.before_send()
    assert np.array_equal(t.host, a)
    t.host[:] = -1.0  # as if MPI had received into the staging buffer
    assert a[0] == 0.0
    t.after_recv()
    assert np.array_equal(a, np.full(9, -1.0))
    direct = buffers.Transport(a)
    assert not direct.staged and direct.spec[0] is direct.buffer.array


def test_cuda_aware_detection_and_override(monkeypatch):
    monkeypatch.delenv(buffers.CUDA_AWARE_ENV, raising=False)
    flag, source = buffers.cuda_aware()
    assert flag is False and source == "MPI library"  # the pip Open MPI is built without CUDA
    monkeypatch.setenv(buffers.CUDA_AWARE_ENV, "1")
    assert buffers.cuda_aware() == (True, f"${buffers.CUDA_AWARE_ENV}")
    assert buffers.cuda_aware(False) == (False, "argument")
    monkeypatch.setenv(buffers.CUDA_AWARE_ENV, "maybe")
    with pytest.raises(ValueError, match="expected 1 or 0"):
        buffers.cuda_aware()


def test_launcher_sets_local_defaults_without_overriding():
    env = launcher.local_env({"PATH": "/usr/bin", "OMPI_MCA_osc": "pt2pt"})
    assert env["PRTE_MCA_rmaps_default_mapping_policy"] == ":oversubscribe"
    assert env["OMPI_MCA_osc"] == "pt2pt"
    assert env["PATH"].split(os.pathsep)[1] == "/usr/bin"
    if os.geteuid() == 0:
        assert env["OMPI_ALLOW_RUN_AS_ROOT"] == "1" and env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] == "1"
    assert "OMPI_MCA_coll" not in env
    ft = launcher.local_env({}, argv=["--with-ft", "ulfm", "-n", "4", "p"])
    assert ft["OMPI_MCA_coll"] == "^han" and ft["OMPI_MCA_btl_tcp_eager_limit"] == str(4 << 20)  # pieces eager
    assert launcher.local_env({"OMPI_MCA_coll": "^hcoll"}, argv=["--with-ft=ulfm"])["OMPI_MCA_coll"] == "^hcoll"


@pytest.mark.parametrize("env, count, itemsize, expected", [
    ({}, 40_000, 4, [(0, 16384), (16384, 32768), (32768, 40000)]),           # 64 KiB pieces
    ({"OMPI_MCA_btl_tcp_max_send_size": "1048576"}, 200_000, 8, [(0, 65536), (65536, 131072), (131072, 196608),
                                                                 (196608, 200000)]),  # half the fragment
    ({"MPIGOSSIP_RMA_CHUNK_BYTES": "1000"}, 300, 8, [(0, 125), (125, 250), (250, 300)]),  # whole elements
    ({"MPIGOSSIP_RMA_CHUNK_BYTES": "0"}, 300, 8, [(0, 300)]),               # not cut
    ({"MPIGOSSIP_RMA_CHUNK_BYTES": "3"}, 3, 8, [(0, 1), (1, 2), (2, 3)]),     # at least one element
    ({}, 0, 8, []),
])
def test_one_sided_transfers_are_cut_below_the_fragment(monkeypatch, env, count, itemsize, expected):
    from mpigossip.onesided import rma
    for name in (rma.CHUNK_ENV, "OMPI_MCA_btl_tcp_max_send_size"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    rma.chunk_bytes.cache_clear()
    try:
        assert rma.pieces(count, itemsize) == expected
    finally:
        rma.chunk_bytes.cache_clear()


def test_a_bad_piece_size_is_refused(monkeypatch):
    from mpigossip.onesided import rma
    for value in ("64k", "-1"):
        monkeypatch.setenv(rma.CHUNK_ENV, value)
        rma.chunk_bytes.cache_clear()
        with pytest.raises(ValueError, match=rma.CHUNK_ENV):
            rma.chunk_bytes()
    rma.chunk_bytes.cache_clear()


def test_the_allreduce_algorithm_is_chosen_by_layout_and_size():
    """auto: MPI's on one node and below the measured crossover; across nodes the node-aware
    ring with several (equal) ranks per node, else the flat ring; a forced choice stays, but a
    node-aware ring over unequal nodes falls back to the flat one."""
    from mpigossip.exact.ring import RING_MIN_BYTES, Layout

    class World:
        def __init__(self, size):
            self.size = size

        def Get_size(self):
            return self.size

    def layout(size, local, uniform=True):
        lay = Layout.__new__(Layout)
        lay.comm, lay.local_size, lay.one_node, lay.uniform = World(size), local, local == size, uniform
        return lay

    big, small = RING_MIN_BYTES, RING_MIN_BYTES - 1
    assert layout(4, 4).choose("auto", 1 << 30) == "mpi"           # one node
    assert layout(8, 2).choose("auto", small) == "mpi"             # latency-bound
    assert layout(8, 2).choose("auto", big) == "node-ring"
    assert layout(4, 1).choose("auto", big) == "ring"
    assert layout(6, 2, uniform=False).choose("auto", big) == "ring"
    assert layout(2, 1).choose("auto", big) == "ring"              # two nodes: MPI's Iallreduce took 2x
    assert layout(8, 2).choose("ring", small) == "ring"
    assert layout(6, 2, uniform=False).choose("node-ring", big) == "ring"
