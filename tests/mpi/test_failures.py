"""PushSum(on_failure="continue") while no rank fails: the same mixing as the default path, bit
for bit, on every buffer kind (its persistent requests and one-piece combine must not change
the arithmetic), and its misuse refused alike on every rank. A rank that does fail: tests/test_faults.py
(launched under ULFM) and the emulated cluster's faults."""

import numpy as np
import pytest

import mpigossip as mg
from mpigossip import failures
from mpigossip import topology as T

from .helpers import comm, global_sum
from .test_kinds import KINDS, integer_data, make, to_host


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("kind, stage", KINDS)
def test_tolerant_step_is_bitwise_the_default_step(kind, stage):
    c = comm()
    topos = [T.ExponentialGraph(peers=1), T.RandomPeers(peers=1, seed=5)]
    if c.size >= 4:
        topos.append(T.ExponentialGraph(peers=2))
    for topo in topos:
        host = integer_data()
        ref, zref = host.copy(), np.zeros_like(host)
        x, z = make(kind, host), make(kind, np.zeros_like(host))
        with pytest.warns(RuntimeWarning, match="without ULFM") if c.rank == 0 and not failures.enabled() else \
                _nothing():
            tolerant = mg.PushSum(x, comm=c, topology=topo, z=z, stage=stage, on_failure="continue")
        plain = mg.PushSum(ref, comm=c, topology=topo, z=zref, chunk_bytes=800)
        total = global_sum(c, ref)
        for _ in range(8):
            tolerant.step()
            plain.step()
            np.testing.assert_array_equal(to_host(x), ref)
            np.testing.assert_array_equal(to_host(z), zref)
            assert tolerant.weight == plain.weight
        np.testing.assert_allclose(global_sum(c, to_host(x)), total, rtol=1e-12, atol=1e-9)  # (exact with shares 1/2)
        assert tolerant.failures == [] and tolerant.steps == 8
        assert abs(c.allreduce(tolerant.weight) - c.size) < 1e-12
        tolerant.free()
        plain.free()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.mpi(min_size=1)
def test_tolerant_misuse_is_refused():
    c = comm()
    x = np.ones(16)
    with pytest.raises(ValueError, match="on_failure must be one of 'abort', 'continue', got 'ignore'"):
        mg.PushSum(x, comm=c, on_failure="ignore")
    with pytest.raises(ValueError, match="on_failure='continue' sends the buffer's own dtype, not wire='bf16'"):
        mg.PushSum(x, comm=c, on_failure="continue", wire="bf16")
    if c.size > 1:
        with pytest.raises(ValueError, match="on_failure"):  # must be the same on every rank
            mg.PushSum(x, comm=c, on_failure="continue" if c.rank == 0 else "abort")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        ps = mg.PushSum(x, comm=c, on_failure="continue")
    with pytest.raises(RuntimeError, match="survives failures in step\\(\\) only"):
        ps.start()
    with pytest.raises(RuntimeError, match="not with on_failure='continue'"):
        ps.join()
    ps.step()
    ps.free()
