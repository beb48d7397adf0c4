import numpy as np
import pytest

import mpigossip as mg

from .helpers import comm, global_sum, one_node, same_on_all_ranks


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("servers", [1, 2, 3])
@pytest.mark.parametrize("atomicity", [None, "lock"])
def test_thousands_of_accumulates_give_the_exact_sum(servers, atomicity):
    c = comm()
    if servers > c.size:
        pytest.skip("more servers than ranks")
    n, pushes = 1001, 2000 if atomicity is None else 500
    if not one_node(c):  # over TCP each accumulate waits for its target's progress: 26-35 s at 8 ranks
        pushes //= 4
    srv = mg.ParameterServer(n, np.float64, comm=c, servers=servers, atomicity=atomicity)
    delta = np.arange(n, dtype=np.float64) % 7 + c.rank
    for _ in range(pushes):
        srv.push(delta)
    c.Barrier()
    out = np.empty(n)
    srv.pull(out)
    expected = global_sum(c, delta) * pushes
    assert np.array_equal(out, expected)
    assert srv.pushes == pushes and f"pushes={pushes}" in repr(srv)
    srv.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("atomicity", [None, "lock"])
def test_pull_never_returns_a_torn_element(atomicity):
    """Workers add 1.0 to every element while rank 0 pulls; each element read must be an
    integer count in range: a torn double would not be. With locks a pull also never sees
    a push half done: all elements are equal."""
    c = comm()
    n, pushes = 4096, 300
    srv = mg.ParameterServer(n, np.float64, comm=c, servers=min(2, c.size),
                             init=np.full(n, 2.0 ** 40), atomicity=atomicity)
    total = 2.0 ** 40 + pushes * (c.size - 1)
    out = np.empty(n)
    if c.rank == 0:
        for _ in range(pushes):
            srv.pull(out)
            assert np.all(out == np.floor(out)) and out.min() >= 2.0 ** 40 and out.max() <= total
            if srv.atomicity == "lock" and srv.servers == 1:
                assert out.min() == out.max()
    else:
        ones = np.ones(n)
        for _ in range(pushes):
            srv.push(ones)
    c.Barrier()
    srv.pull(out)
    assert np.all(out == total)
    srv.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("atomicity, servers", [(None, 1), ("lock", 1), ("lock", 2)])
def test_easgd_conserves_mass_and_converges(atomicity, servers):
    """Exact mass over concurrent exchanges: in lock mode each exchange is one read-modify-write
    (pull(for_update=True), then a push that writes without reading again)."""
    c = comm()
    n = 64
    x = np.full(n, float(4 * c.rank))  # dyadic data, alpha = 1/2: exact arithmetic
    center0 = np.full(n, 1.0)
    srv = mg.ParameterServer(n, np.float64, comm=c, servers=min(servers, c.size), init=center0,
                             atomicity=atomicity)
    total = global_sum(c, x) + center0
    ea = mg.Every(mg.ElasticAveraging(x, srv, beta=0.5, workers=1), 2)
    # Every exchange, by anyone, may halve the center's denominator: keep the total number
    # of exchanges within float64's 53 bits so that any drift is a real loss of mass.
    exchanges = max(2, 40 // c.size)
    for _ in range(2 * exchanges):
        ea.step()  # no gradient: pure elastic averaging
    c.Barrier()
    center = srv.pull(np.empty(n))
    assert np.array_equal(global_sum(c, x) + center, total), "elastic exchange lost mass"
    assert ea.exchanges == exchanges and ea.steps == 2 * exchanges
    # Convergence, in lockstep (so that no worker stops while others still pull) with the
    # EASGD rate beta/P: the per-worker rate 1/2 used above for exact arithmetic is unstable
    # when every worker pulls the same center before anyone pushes (P >= 3), which lockstep
    # across nodes makes the rule.
    ea = mg.ElasticAveraging(x, srv, beta=0.5)
    for _ in range(200):
        ea.step()
        c.Barrier()
    center = srv.pull(np.empty(n))
    spread = max(c.allgather(float(np.abs(x - center).max())))
    assert spread < 1e-3 * float(np.abs(total).max())
    np.testing.assert_allclose(center, total / (c.size + 1), rtol=1e-3)
    srv.free()


@pytest.mark.mpi(min_size=2)
def test_dedicated_server_and_async_sgd():
    c = comm()
    n = 32
    workers = c.Split(0 if c.rank == 0 else 1)
    srv = mg.ParameterServer(n, np.float32, comm=c, servers=1)
    if c.rank == 0:
        assert srv.is_server
        srv.serve()  # dedicated: stays in MPI until the workers free
        workers.Free()
        return
    x = np.zeros(n, np.float32)
    worker = mg.AsyncSGD(x, srv)
    for k in range(10):
        worker.step(np.full(n, -0.5, np.float32))  # e.g. -lr * grad
        assert x.max() <= -0.5 * (k + 1), x  # every element holds at least this worker's own pushes
    workers.Barrier()  # every worker's pushes have landed: the center holds all of them, exactly
    srv.pull(x)
    np.testing.assert_array_equal(x, np.full(n, -5.0 * (c.size - 1), np.float32))
    workers.Free()
    srv.free()


@pytest.mark.mpi(min_size=2)
def test_bad_arguments_raise_everywhere():
    c = comm()
    with pytest.raises(ValueError) as err:
        mg.ParameterServer(10, np.float64, comm=c, servers=c.size + 1)
    assert "servers must be" in str(err.value) and same_on_all_ranks(c, str(err.value))
    with pytest.raises(ValueError, match="differ across ranks"):
        mg.ParameterServer(10 + c.rank, np.float64, comm=c)
    srv = mg.ParameterServer(10, np.float64, comm=c)
    for beta in (0, 1.5, -0.1):
        with pytest.raises(ValueError, match="beta"):
            mg.ElasticAveraging(np.zeros(10), srv, beta=beta)
    with pytest.raises(ValueError, match="tau"):
        mg.ElasticAveraging(np.zeros(10), srv, tau=0)
    for workers in (0, c.size + 1, 1.5):
        with pytest.raises(ValueError, match="workers"):
            mg.ElasticAveraging(np.zeros(10), srv, workers=workers)
    with pytest.raises(ValueError, match="server holds"):
        mg.ElasticAveraging(np.zeros(11), srv)
    srv.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("atomicity", [None, "lock"])
def test_update_is_a_read_modify_write_per_shard(atomicity):
    """Every rank adds 1 to what it read, 20 times, all at once: in lock mode an update lost
    between a read and its write would show as a count short of 20 x size."""
    c = comm()
    n = 5000
    srv = mg.ParameterServer(n, np.float64, comm=c, servers=min(2, c.size), atomicity=atomicity)
    seen = []

    def add_one(lo, hi, shard):
        seen.append((lo, hi))
        shard += 1.0
    for _ in range(20):
        srv.update(add_one)
    c.Barrier()
    assert np.array_equal(srv.pull(np.empty(n)), np.full(n, 20.0 * c.size))
    assert sorted(seen[:srv.servers]) == srv.bounds and (srv.pushes, srv.pulls) == (20, 21)
    assert seen[0] == srv.bounds[c.rank % srv.servers]   # each rank starts at its own shard
    srv.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("atomicity, servers", [(None, 1), ("lock", 1), ("lock", 2)])
def test_async_sgd_pushes_its_update_and_pulls_a_center_holding_it(atomicity, servers):
    """AsyncSGD.step() (in lock mode one read-modify-write per shard): every push lands exactly
    once, and the x it returns holds at least this rank's own pushes."""
    c = comm()
    n = 40
    srv = mg.ParameterServer(n, np.float64, comm=c, servers=min(servers, c.size), atomicity=atomicity)
    x = np.zeros(n)
    worker = mg.AsyncSGD(x, srv)
    for k in range(10):
        x -= 0.5                     # the local optimizer's update
        worker.step()
        assert x.max() <= -0.5 * (k + 1), x
    c.Barrier()
    assert np.array_equal(srv.pull(np.empty(n)), np.full(n, -5.0 * c.size))
    worker.free()
    srv.free()
