"""The arithmetic of ``train --on-failure replace`` without MPI (mpigossip/train/handover.py):
the heal's rescale and the mass a run's record accounts for. The runs themselves are in
tests/test_faults.py."""

import numpy as np
import pytest

from mpigossip.resilience.heal import rescale
from mpigossip.train.handover import weight_accounted


def test_rescale_is_a_power_of_two_that_leaves_z_unchanged_exactly():
    for total, size, scale in [(4.0, 4, 1.0), (1.46875, 4, 2.0), (0.975, 4, 4.0), (0.78, 4, 4.0), (2.5, 4, 1.0),
                               (2.0, 4, 2.0), (9.0, 4, 1.0), (3.0, 4, 1.0), (1e-300, 4, 2.0 ** 998)]:
        assert rescale(total, size) == scale, (total, size)
        if total < size:
            assert 0.5 < rescale(total, size) * total / size <= 1
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        assert rescale(bad, 4) == 1.0
    rng = np.random.default_rng(0)
    x = rng.standard_normal(10_000).astype(np.float32) * np.float32(1e-3)
    x[:10] = np.float32(1e-40)   # subnormals too
    w = np.float64(0.3671)
    c = rescale(0.3671 * 4 / 5, 4)
    assert c != 1.0 and np.array_equal((x * np.float32(c)) / (w * c), x / w)


def test_weight_accounted_follows_losses_and_heals():
    s = {"initial_world_size": 4, "failures": [
        {"weight_lost": 2.53125, "replaced": {"weight_before": [1.46875], "scaled_by": [2.0]}},
        {"weight_lost": 1.9621582031250004, "replaced": {"weight_before": [0.9753417968749996], "scaled_by": [4.0]}}]}
    assert abs(weight_accounted(s) - 3.9013671875) < 1e-12   # (the OSGP run of test_training_grows_back_twice)
    assert weight_accounted({"initial_world_size": 4, "failures": [{"weight_lost": 1.0}]}) == 3.0   # continue
    assert weight_accounted({"initial_world_size": 4, "failures": [{"weight_lost": 2.5, "scaled_by": 2.0}]}) == 3.0
    assert weight_accounted({"initial_world_size": 4, "failures": [
        {"weight_lost": 1.0, "replaced": {"ranks": [], "refused": True}}]}) == 3.0   # (no record of a heal)
    s["failures"][1]["replaced"]["weight_before"] = [1.5]   # a heal that found mass the record does not hold
    with pytest.raises(ValueError, match="the record before it leaves"):
        weight_accounted(s)
