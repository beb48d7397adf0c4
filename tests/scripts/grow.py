"""A killed rank replaced (mpigossip.resilience.grow) and healed (mpigossip.resilience.heal):
4 ranks under ULFM, the last one kills itself; the survivors meet the failure, spawn a
replacement (this script again, which finds itself a newcomer) and merge; the newcomer then
gets its state from a survivor, and an Allreduce of the ranks checks the size and numbering.

    mpigossip-mpiexec --with-ft ulfm -n 4 python tests/scripts/grow.py [--mb 4] [--argv-missing]
        [--heal broadcast|pushsum|agp]

--heal broadcast (default; the exact methods' heal): the survivors hold one model (x = base +
3.25), the last one dies after a first Allreduce, and heal.broadcast gives it to the newcomer.
--heal pushsum|agp (the PushSum family's): x = base + rank, w = 1 mixed by PushSum (synchronous,
or Asynchronous Gradient Push) with on_failure="continue"; the victim dies at the start of step
4 of 12; after the survivors' recovery, heal.split hands the newcomer half a donor's (x, w), a
PushSum over the grown communicator takes 30 more steps, and each rank checks: the donor's two
halves add up to its (x, w) exactly; Σx and Σw over the four ranks equal the survivors' before
the heal (right after it and at the end); z - base is one constant over the elements (every
element shares one mixing history, the newcomer's included); z has converged over the four.

Each process prints one line ``grow: {json}`` and ends without MPI_Finalize (failures.exit).
``--argv-missing``: the survivors spawn a program that does not exist: they must go on at 3
ranks with one warning, not hang.
"""

import argparse
import json
import os
import signal
import time
import warnings

import numpy as np
from mpi4py import MPI

import mpigossip as mg
from mpigossip.resilience import failures, grow, heal

p = argparse.ArgumentParser()
p.add_argument("--mb", type=float, default=4.0)
p.add_argument("--argv-missing", action="store_true")
p.add_argument("--heal", choices=("broadcast", "pushsum", "agp"), default="broadcast")
a = p.parse_args()
n = int(a.mb * (1 << 20)) // 8
TIMEOUT = 60.0
base = np.arange(n, dtype=np.float64) % 7
mixing = a.heal in ("pushsum", "agp")
checks = {}


def pushsum(x, comm, weight):
    return mg.PushSum(x, comm=comm, weight=weight, on_failure="continue", timeout=TIMEOUT,
                      max_delay=None if a.heal == "agp" else 1, topology=mg.topology.ExponentialGraph(peers=1))


def run(ps, steps, victim=None):
    for i in range(steps):
        if ps.comm.Get_rank() == victim and i == 4:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.005)
        if a.heal == "agp":
            ps.start()
            ps.finish()
        else:
            ps.step()
    ps.drain()


def sums(comm, x, w):
    return comm.allreduce(float(x.sum())), comm.allreduce(float(w))


if grow.newcomer():
    t0 = time.monotonic()
    comm, taken = grow.join(timeout=TIMEOUT, op="grow.py")
    role, failure, grown_s = "newcomer", None, time.monotonic() - t0
    x, weight, mark, before = np.zeros(n), 0.0, None, None
elif mixing:
    world = MPI.COMM_WORLD
    x, weight = base + world.Get_rank(), 1.0
    ps = pushsum(x, world, weight)
    run(ps, 12, victim=world.Get_size() - 1)
    f = ps.failures[0] if ps.failures else {}
    mark = sums(ps.comm, x, ps.weight)   # the survivors' mass, after their recovery
    before, weight = (x.copy(), ps.weight), ps.weight
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grown = grow.replace(ps.comm, f.get("ranks", []), timeout=TIMEOUT, op="grow.py")
    role, failure = "survivor", {"lost": f.get("ranks"), "warnings": [str(w.message) for w in caught],
                                 "weight_lost": f.get("weight_lost")}
    comm, taken = (grown.comm, grown.newcomers) if grown is not None else (ps.comm, [])
    grown_s = grown.seconds if grown is not None else None
    if grown is not None:
        ps.free()
else:
    world = MPI.COMM_WORLD.Dup()
    world.Set_errhandler(MPI.ERRORS_RETURN)
    one = np.ones(1)
    world.Allreduce(MPI.IN_PLACE, one)
    if world.Get_rank() == world.Get_size() - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        for _ in range(1000):
            world.Allreduce(MPI.IN_PLACE, one)
            time.sleep(0.01)
        print("grow: " + json.dumps({"error": "no failure seen"}), flush=True)
        failures.exit(1)
    except MPI.Exception as exc:
        if exc.Get_error_class() not in failures.FAILED:
            raise
    rec = failures.shrink(world, 1, timeout=TIMEOUT, op="grow.py")
    argv = ["/nonexistent/python"] if a.argv_missing else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grown = grow.replace(rec.comm, rec.lost, argv=argv, timeout=TIMEOUT, op="grow.py")
    role, failure = "survivor", {"lost": rec.lost, "warnings": [str(w.message) for w in caught]}
    comm, taken = (grown.comm, grown.newcomers) if grown is not None else (rec.comm, [])
    grown_s = grown.seconds if grown is not None else None

rank, size = comm.Get_rank(), comm.Get_size()
healed_s = None
if mixing:
    mark = comm.bcast(mark, root=0)
    t0 = time.monotonic()
    new_weight = heal.split(x, weight, comm=comm, newcomers=taken, timeout=TIMEOUT, op="grow.py")
    healed_s = time.monotonic() - t0
    donor = heal.donors(comm.allgather(None if rank in taken else weight), taken) if taken else {}
    for newcomer, giver in donor.items():   # the donor's two halves add up to what it held, exactly
        if rank == newcomer:
            comm.Send(x, dest=giver, tag=7)
            comm.send(new_weight, dest=giver, tag=8)
        elif rank == giver:
            other = np.empty(n)
            comm.Recv(other, source=newcomer, tag=7)
            other_w = comm.recv(source=newcomer, tag=8)
            checks["halves exact"] = bool(np.array_equal(x + other, before[0]) and new_weight + other_w == before[1])
    weight = new_weight
    checks["mass kept by the heal"] = bool(np.allclose(sums(comm, x, weight), mark, rtol=1e-12, atol=0))
    shift = x / weight - base
    checks["z - base constant after the heal"] = bool(np.ptp(shift) <= 1e-9 * max(1.0, np.abs(shift).max()))
    ps = pushsum(x, comm, weight)
    run(ps, 30)
    weight = ps.weight
    checks["mass kept after"] = bool(np.allclose(sums(comm, x, weight), mark, rtol=1e-12, atol=0))
    z = x / weight
    shift = z - base
    checks["z - base constant"] = bool(np.ptp(shift) <= 1e-9 * max(1.0, np.abs(shift).max()))
    zmin, zmax = np.empty(n), np.empty(n)
    comm.Allreduce(z, zmin, op=MPI.MIN)
    comm.Allreduce(z, zmax, op=MPI.MAX)
    checks["converged"] = float(np.max(zmax - zmin)) < (1e-2 if a.heal == "agp" else 1e-6)
    checks["no failure after"] = not ps.failures
else:
    buf = base + 3.25 if role == "survivor" else np.zeros(n)
    t0 = time.monotonic()
    heal.broadcast(buf, comm=comm, root=0, timeout=TIMEOUT, op="grow.py")
    healed_s = time.monotonic() - t0
    checks["model equal"] = bool(np.array_equal(buf, base + 3.25))
total = np.array([float(rank)])
comm.Allreduce(MPI.IN_PLACE, total)
checks["numbering"] = bool(total[0] == size * (size - 1) / 2)
ok = all(checks.values())
try:   # every rank is done with the checks before any ends: a rank still inside the last collective
    comm.Barrier()   # when another has ended (os._exit: no MPI_Finalize) may see it as failed
except MPI.Exception as exc:   # (then the others have all entered the barrier: their checks are done)
    if exc.Get_error_class() not in failures.FAILED:
        raise
print("grow: " + json.dumps({"role": role, "rank": rank, "size": size, "taken": taken, "ok": ok, "failure": failure,
                             "checks": checks, "grown_s": grown_s, "healed_s": healed_s,
                             "weight": weight if mixing else None}), flush=True)
failures.exit(0 if ok else 1)
