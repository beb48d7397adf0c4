"""mpigossip.resilience.heal without a failure: the last ranks play the newcomers of a grown
communicator. A donor's two halves add up to its (x, w) exactly, element by element (odd
integers, a subnormal), z = x / w is the donor's on both, the other ranks are untouched, on
every buffer kind; broadcast gives every rank the root's buffer; misuse raises the same
ValueError on every rank. With a real failure and spawn: tests/test_faults.py (grow.py)."""

import numpy as np
import pytest

from mpigossip.resilience import heal

from .helpers import comm
from .test_kinds import KINDS, make, to_host

TINY = 5e-324   # the smallest subnormal: x * 0.5 rounds it, x - x * 0.5 keeps the sum exact


def test_donors_take_the_largest_weight_and_halve_it():
    assert heal.donors([1.0, 3.0, 2.0, None], [3]) == {3: 1}
    assert heal.donors([1.0, 3.0, 2.0, None, None], [3, 4]) == {3: 1, 4: 2}   # 3 -> 1.5 < 2
    assert heal.donors([2.0, 2.0, None, None], [2, 3]) == {2: 0, 3: 1}        # ties: the lower rank
    assert heal.donors([4.0, 1.0, None, None], [2, 3]) == {2: 0, 3: 0}        # 4 -> 2 > 1
    with pytest.raises(ValueError, match="no survivor"):
        heal.donors([None, None], [0, 1])


def _data(rank, n=1031):
    values = np.random.default_rng(70 + rank).integers(-999, 999, n).astype(np.float64) * 2 + 1   # odd
    values[:3] = [TINY, -3 * TINY, 1e-310]
    return values


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind, stage", KINDS)
def test_split_hands_half_of_a_donor_exactly(kind, stage):
    c = comm()
    newcomers = [c.size - 1] if c.size < 3 else [1, c.size - 1]
    new = c.rank in newcomers
    weight = 0.0 if new else 1.0 + 0.37 * c.rank
    host = np.full(1031, np.nan) if new else _data(c.rank) * weight
    x = make(kind, host)
    before_x, before_w = c.allgather(None if new else host.copy()), c.allgather(None if new else weight)
    after_w = heal.split(x, weight, comm=c, newcomers=newcomers, stage=stage, timeout=60)
    xs, ws = c.allgather(to_host(x).copy()), c.allgather(after_w)
    plan = heal.donors(before_w, newcomers)
    for r in range(c.size):
        if r in newcomers:
            continue
        given = [n for n, d in plan.items() if d == r]
        total_x = xs[r] + sum((xs[n] for n in given), np.zeros_like(xs[r]))
        total_w = ws[r] + sum(ws[n] for n in given)
        np.testing.assert_array_equal(total_x, before_x[r])   # nothing made or lost, element by element
        assert total_w == before_w[r]
        normal = slice(3, None)
        for n in given:
            np.testing.assert_array_equal(xs[n][normal] / ws[n], before_x[r][normal] / before_w[r])
        np.testing.assert_array_equal(xs[r][normal] / ws[r], before_x[r][normal] / before_w[r])
        if not given:
            np.testing.assert_array_equal(xs[r], before_x[r])
            assert ws[r] == before_w[r]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind, stage", KINDS)
def test_broadcast_gives_every_rank_the_roots_buffer(kind, stage):
    c = comm()
    root = 1 % c.size
    x = make(kind, _data(c.rank, n=100_003))
    heal.broadcast(x, comm=c, root=root, stage=stage, timeout=60)
    np.testing.assert_array_equal(to_host(x), _data(root, n=100_003))


@pytest.mark.mpi(min_size=2)
def test_misuse_is_refused_on_every_rank():
    c = comm()
    with pytest.raises(ValueError, match="differs across ranks"):
        heal.split(np.ones(10 + (c.rank == 0)), 1.0, comm=c, newcomers=[c.size - 1], timeout=60)
    with pytest.raises(ValueError, match="newcomers differs"):
        heal.split(np.ones(10), 1.0, comm=c, newcomers=[c.size - 1 - (c.rank == 0)], timeout=60)
    with pytest.raises(ValueError, match=r"rank 0: a survivor's weight must be finite and > 0"):
        heal.split(np.ones(10), 0.0 if c.rank == 0 else 1.0, comm=c, newcomers=[c.size - 1], timeout=60)
    with pytest.raises(ValueError, match="root must be a rank below"):
        heal.broadcast(np.ones(10), comm=c, root=c.size, timeout=60)


@pytest.mark.mpi(min_size=2)
def test_handover_sends_each_tensor_raw_and_only_its_own_elements():
    """A state dict as a training job hands over: a model's parameters viewing one flat buffer
    (as the package's wrappers keep them), an optimizer's state, bfloat16, bool, numpy arrays,
    an empty tensor, a state_dict's ``_metadata``. The newcomer gets equal values and dtypes, and
    no tensor larger than its own elements (pickled, each view carried the whole flat buffer)."""
    import collections

    torch = pytest.importorskip("torch")
    c = comm()
    newcomer, donor = c.size - 1, 0
    flat = torch.arange(6000, dtype=torch.float32)
    model = collections.OrderedDict([("a.weight", flat[:4000].view(40, 100)), ("a.bias", flat[4000:4040]),
                                     ("b.weight", flat[4040:6000].view(49, 40))])
    model._metadata = {"": {"version": 1}}
    state = {"model": model, "optimizer": {"state": {0: {"momentum_buffer": torch.full((7, 3), 0.5)}},
                                           "param_groups": [{"lr": 0.1, "params": [0, 1]}]},
             "half": torch.tensor([1.5, -2.25], dtype=torch.bfloat16), "mask": torch.tensor([True, False, True]),
             "empty": torch.empty(0, 3), "rng": np.arange(5, dtype=np.uint32), "step": 15,
             "record": np.array([(1, 2.5)], dtype=[("n", "i4"), ("x", "f8")]),
             "views": (np.arange(10.0)[::2], [flat[:3]])}
    got = heal.handover(state if c.rank == donor else None, comm=c, plan={newcomer: donor}, timeout=60)
    if c.rank != newcomer:
        assert got is (state if c.rank == donor else None)
        return
    assert list(got["model"]) == list(model) and got["model"]._metadata == {"": {"version": 1}}
    for key, value in model.items():
        assert torch.equal(got["model"][key], value)
        assert got["model"][key].untyped_storage().nbytes() == value.numel() * 4   # its own elements, not 6000
    assert torch.equal(got["optimizer"]["state"][0]["momentum_buffer"], torch.full((7, 3), 0.5))
    assert got["optimizer"]["param_groups"] == [{"lr": 0.1, "params": [0, 1]}]
    assert got["half"].dtype == torch.bfloat16 and torch.equal(got["half"], state["half"])
    assert got["mask"].dtype == torch.bool and torch.equal(got["mask"], state["mask"])
    assert got["empty"].shape == (0, 3)
    assert got["rng"].dtype == np.uint32 and np.array_equal(got["rng"], np.arange(5))
    assert got["record"].dtype.names == ("n", "x") and got["record"]["x"][0] == 2.5
    assert got["step"] == 15 and isinstance(got["views"], tuple)
    assert np.array_equal(got["views"][0], np.arange(0.0, 10.0, 2.0))
    assert torch.equal(got["views"][1][0], flat[:3]) and got["views"][1][0].untyped_storage().nbytes() == 12


@pytest.mark.mpi(min_size=2)
def test_isplit_and_ihandover_send_copies_while_the_donor_goes_on():
    """The heal beside training (AGP): a donor returns from isplit and ihandover with its sends
    under way and goes on changing its x and its optimizer's state at once; the newcomer, which
    posts its receives of the state only later, still gets the values of the moment of the heal,
    and the donor's x plus the newcomer's add up to the donor's before, element by element."""
    import time

    torch = pytest.importorskip("torch")
    c = comm()
    newcomer = c.size - 1
    new = c.rank == newcomer
    weight = 0.0 if new else 1.0 + 0.25 * c.rank
    before = np.zeros(2_000_003) if new else _data(c.rank, n=2_000_003) * weight   # 16 MB: many pieces
    x = before.copy()
    weights = c.allgather(None if new else weight)
    donor = heal.donors(weights, [newcomer])[newcomer]
    w, sending = heal.isplit(x, weight, comm=c, newcomers=[newcomer], timeout=60)
    assert bool(sending) == (c.rank == donor)
    state = {"momentum": torch.full((4_000_000,), 1.5), "step": 7} if c.rank == donor else None
    if new:
        time.sleep(0.5)   # (the donor's state waits for receives not yet posted)
    got, sent = heal.ihandover(state, comm=c, plan={newcomer: donor}, timeout=60)
    if c.rank == donor:
        kept = x.copy()
        x[...] = -1.0                   # it trains on
        state["momentum"].fill_(-1.0)
        assert bool(sent)
        sending.extend(sent)
        assert not sent
    sending.wait(comm=c, timeout=60)
    xs, ws = c.allgather(kept if c.rank == donor else x), c.allgather(w)
    if new:
        assert got["step"] == 7 and torch.equal(got["momentum"], torch.full((4_000_000,), 1.5))
    np.testing.assert_array_equal(xs[donor] + xs[newcomer], _data(donor, n=2_000_003) * weights[donor])
    assert ws[donor] + ws[newcomer] == weights[donor]
    for r in range(c.size - 1):
        if r != donor:
            np.testing.assert_array_equal(xs[r], _data(r, n=2_000_003) * weights[r])
