"""One interface for every averaging object: step(), start()/finish(), drain(), the counter
``steps``, state_dict()/load_state_dict(), free(); the one tag scheme; the old names still
work, with a DeprecationWarning."""

import warnings

import numpy as np
import pytest
from mpi4py import MPI

import mpigossip as mg
from mpigossip.core.base import MPIObject, Stateful, Steps, step_tag, tag_bound, tag_period

from .helpers import comm, global_sum

N = 257


def _objects(c, x):
    """(name, factory) of every averaging object over buffer ``x``; each factory returns
    (object, things to free afterwards)."""
    def server_worker(cls, **kw):
        srv = mg.ParameterServer(x.size, x.dtype, comm=c, init=np.zeros_like(x))
        return cls(x, srv, **kw), [srv]
    return [
        ("allreduce", lambda: (mg.AllreduceAverager(x, comm=c), [])),
        ("pushsum", lambda: (mg.PushSum(x, comm=c), [])),
        ("osgp", lambda: (mg.PushSum(x, comm=c, max_delay=2), [])),
        ("agp", lambda: (mg.PushSum(x, comm=c, max_delay=None), [])),
        ("gossip-pull", lambda: (mg.Gossip(x, comm=c, mode="pull"), [])),
        ("gossip-push", lambda: (mg.Gossip(x, comm=c, mode="push"), [])),
        ("every-3-gossip-push", lambda: (mg.Every(mg.Gossip(x, comm=c, mode="push"), 3), [])),
        ("dpsgd", lambda: (mg.DPSGD(x, comm=c, topology=mg.topology.CompleteGraph()), [])),
        ("adpsgd", lambda: (mg.ADPSGD(x, comm=c), [])),
        ("nodemean", lambda: (mg.NodeMean(x, comm=c), [])),
        ("hierarchical-pushsum", lambda: (mg.Hierarchical(x, comm=c, inter=mg.PushSum, node_size=1), [])),
        ("easgd", lambda: server_worker(mg.ElasticAveraging)),
        ("asgd", lambda: server_worker(mg.AsyncSGD, share=0.5)),
        ("outer-localsgd", lambda: (mg.Outer(x, mg.AllreduceAverager(x, comm=c), inner_steps=2), [])),
        ("outer-diloco-sgp", lambda: (mg.Outer(x, mg.PushSum(x, comm=c), inner_steps=2, method="diloco"), [])),
    ]


NAMES = [name for name, _ in _objects(None, np.zeros(1))]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name", NAMES)
def test_every_object_meets_the_interface(name):
    c = comm()
    x = np.arange(N, dtype=np.float64) * (c.rank + 1)
    factory = dict(_objects(c, x))[name]
    obj, extra = factory()
    assert isinstance(obj, Steps)
    for _ in range(3):
        assert obj.step() is None, f"{name}: step() returns None (one convention)"
    for _ in range(2):
        obj.start()
        obj.finish()
    assert obj.steps == 5, f"{name}: steps counts step() and start()/finish() alike"
    state = obj.state_dict()  # drains first (collective where drain is)
    assert state["steps"] == 5
    if name in ("pushsum", "osgp", "agp"):  # after drain all the mass is in (x, w)
        total = global_sum(c, np.ones(1) * obj.weight)[0]
        assert abs(total - c.size) < 1e-12 and "weight" in state
    obj.free()
    for e in extra:
        e.free()
    with pytest.raises(RuntimeError, match="freed"):
        obj.step()

    # A fresh object takes the state back: the counters and the class's own state.
    y = x.copy()
    again, extra = dict(_objects(c, y))[name]()
    again.load_state_dict(state)
    assert again.steps == 5
    if "weight" in state:
        assert again.weight == state["weight"]
    if name == "every-3-gossip-push":
        assert again.exchanges == 1 and state["inner"]["steps"] == 1  # steps 3 only
    if name.startswith("outer"):
        assert again.exchanges == 2 and state["inner"]["steps"] == 2  # steps 2 and 4
    again.step()  # and goes on from there
    assert again.steps == 6
    again.drain()
    again.free()
    for e in extra:
        e.free()


@pytest.mark.mpi(min_size=1)
def test_load_state_dict_says_what_is_missing():
    c = comm()
    with mg.PushSum(np.zeros(N), comm=c) as ps:
        with pytest.raises(ValueError, match="weight"):
            ps.load_state_dict({"steps": 3})


@pytest.mark.mpi(min_size=2)
def test_every_runs_the_inner_step_on_every_kth_step_only():
    c = comm()
    x = np.full(N, float(c.rank))
    total = global_sum(c, x)
    ps = mg.Every(mg.PushSum(x, comm=c), 4)
    ran = []
    for _ in range(10):
        assert ps.step() is None  # one return convention: exchanged says whether it ran
        ran.append(ps.exchanged)
    assert ran == [False, False, False, True] * 2 + [False, False]
    assert ps.steps == 10 and ps.exchanges == 2 and ps.inner.steps == 2
    np.testing.assert_array_equal(global_sum(c, x), total)  # PushSum's mass, through the wrapper
    ps.free()
    with pytest.raises(ValueError, match="k must be an integer >= 1"):
        mg.Every(mg.PushSum(np.zeros(4), comm=c), 0)


@pytest.mark.mpi(min_size=1)
def test_old_names_still_work_with_a_deprecation_warning():
    c = comm()
    x = np.zeros(N)
    with mg.AllreduceAverager(x, comm=c) as avg:
        avg.start()
        with pytest.warns(DeprecationWarning, match="finish"):
            avg.wait()
        with pytest.warns(DeprecationWarning, match="steps"):
            assert avg.rounds == 1
    with mg.PushSum(x, comm=c) as ps:
        ps.step()
        with pytest.warns(DeprecationWarning, match="steps"):
            assert ps.step_count == 1
        with pytest.warns(DeprecationWarning):
            ps.step_count = 7
        assert ps.steps == 7
    with pytest.warns(DeprecationWarning, match="Every"):
        g = mg.Gossip(x, comm=c, mode="push", tau=2)
    assert isinstance(g, mg.Every) and g.k == 2
    g.step()
    g.step()
    with pytest.warns(DeprecationWarning):
        assert g.calls == 2 and g.rounds == 1
    g.free()
    srv = mg.ParameterServer(N, np.float64, comm=c)
    with pytest.warns(DeprecationWarning, match="Every"):
        ea = mg.ElasticAveraging(x, srv, tau=3)
    assert isinstance(ea, mg.Every) and ea.k == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new names warn nothing
        mg.ElasticAveraging(x, srv).step()
    srv.free()


def test_tags_stay_within_the_mpi_bound():
    ub = tag_bound()
    assert ub >= 32767
    for kinds in (1, 2, 3):
        period = tag_period(kinds)
        for step in (0, 1, period - 1, period, 10 * period + 5, 2 ** 40):
            for kind in range(kinds):
                t = step_tag(step, kind, kinds)
                assert 0 <= t <= ub
        assert step_tag(period, 0, kinds) == step_tag(0, 0, kinds)  # the cycle


@pytest.mark.mpi(min_size=1)
def test_max_delay_beyond_the_tag_cycle_is_refused_on_every_rank():
    c = comm()
    with pytest.raises(ValueError, match="tag bound"):
        mg.PushSum(np.zeros(N), comm=c, max_delay=tag_period(2))
    assert c.allreduce(1, op=MPI.SUM) == c.size  # every rank got here


@pytest.mark.mpi(min_size=1)
def test_the_parameter_server_is_no_averaging_object_but_keeps_the_life_cycle():
    """ParameterServer holds the center; its workers step. So it has no step() at all (not one
    that raises), and it keeps state_dict()/load_state_dict(), free() and ``with``."""
    c = comm()
    center = np.arange(N, dtype=np.float64)
    with mg.ParameterServer(N, np.float64, comm=c, init=center) as srv:
        assert isinstance(srv, (MPIObject, Stateful)) and not isinstance(srv, Steps)
        assert not hasattr(srv, "step")
        worker = mg.AsyncSGD(np.zeros(N), srv)
        assert isinstance(worker, Steps)
        c.Barrier()
        state = srv.state_dict()
        np.testing.assert_array_equal(state["center"], center)
    with pytest.raises(RuntimeError, match="freed"):
        srv.pull(np.empty(N))
    with mg.ParameterServer(N, np.float64, comm=c) as again:
        again.load_state_dict(state)
        np.testing.assert_array_equal(again.pull(np.empty(N)), center)


@pytest.mark.mpi(min_size=1)
def test_async_sgd_pushes_its_local_update_and_the_old_form_warns():
    """AsyncSGD.step() takes no argument: the caller updates x, step() pushes share * (what x
    moved since the last pull) and pulls the center. A single worker: the center moves by
    share * update, and x is the center."""
    c = comm()
    x = np.zeros(N)
    with mg.ParameterServer(N, np.float64, comm=c, init=np.zeros(N)) as srv:
        worker = mg.AsyncSGD(x, srv, share=1.0 / c.size)
        x += 4.0 * c.size  # every rank's local update
        worker.step()
        c.Barrier()
        np.testing.assert_array_equal(srv.pull(np.empty(N)), np.full(N, 4.0 * c.size))
        c.Barrier()  # every rank has read the center before anyone pushes again
        with pytest.warns(DeprecationWarning, match="step"):
            worker.step(np.ones(N))
        with pytest.raises(ValueError, match="share"):
            mg.AsyncSGD(x, srv, share=0)
        c.Barrier()
