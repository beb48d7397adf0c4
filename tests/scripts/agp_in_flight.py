"""AGP's and OSGP's survivors keep what they sent each other: a rank dies while messages
between two survivors are still in flight, and none of them is lost.

    mpiexec --with-ft ulfm -n 4 python agp_in_flight.py [--mb 1] [--algo agp|osgp]

A directed ring (rank i sends to i + 1). After a drain (nothing in flight, Σw exact), rank 3
dies at once, holding its weight and nothing else (its in-peer, rank 2, sends nothing now);
rank 2 sleeps, neither stepping nor receiving, while ranks 0 and 1 step: rank 1's shares for
rank 2 pile up in flight (eager sends, complete at the sender). Rank 2 then wakes and meets the
failure. Before the communicator is revoked the survivors receive what they sent each other,
so Σw over the survivors is the world's less exactly the dead rank's weight, and z - base is
one constant on each. (Revoking first lost rank 1's shares for rank 2.) Prints one JSON line
``agp_in_flight: {...}`` per survivor and ends with ``mpigossip.resilience.failures.exit``.
"""

import argparse
import json
import os
import signal
import time

import numpy as np
from mpi4py import MPI

import mpigossip as mg
from mpigossip.resilience import failures

p = argparse.ArgumentParser()
p.add_argument("--mb", type=float, default=1.0)
p.add_argument("--algo", choices=("agp", "osgp"), default="agp")
a = p.parse_args()
world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
other = world.Dup()   # for MPI progress alone
other.Set_errhandler(MPI.ERRORS_RETURN)
n = max(1, int(a.mb * (1 << 20)) // 8)
base = np.arange(n, dtype=np.float64) % 7
w0 = 1.0 + rank
x = (base + rank) * w0
ps = mg.PushSum(x, comm=world, topology=mg.topology.RingGraph(), weight=w0, on_failure="continue", timeout=60,
                max_delay=None if a.algo == "agp" else 1)
total = size * (size + 1) / 2


def step():
    if a.algo == "agp":
        ps.step()
        return
    if ps.started:   # OSGP: this step's share goes out while the next computes
        ps.finish()
    ps.start()


def drain():
    if a.algo == "osgp" and ps.started:
        ps.finish()
    ps.drain()


for _ in range(5):
    step()
drain()
victim_weight = ps.comm.allreduce(ps.weight if rank == size - 1 else 0.0)
ps.comm.Barrier()
if rank == size - 1:
    os.kill(os.getpid(), signal.SIGKILL)
if rank == size - 2:
    time.sleep(1.5)   # neither steps nor receives: what rank size-3 sends it stays in flight
    for _ in range(200):   # then lets MPI learn of the failure before its next step (else its first
        try:               # step may still send a share to the dead rank: in flight to it, lost)
            other.Iprobe(source=MPI.ANY_SOURCE)
        except MPI.Exception:
            break
        time.sleep(0.005)
steps = 0
while not ps.failures or steps < 40:
    step()
    steps += 1
    time.sleep(0.002)
drain()
comm = ps.comm
sum_w = comm.allreduce(ps.weight)
shift = x / ps.weight - base
f = ps.failures[0]
checks = {
    "one failure": len(ps.failures) == 1 and f["ranks"] == [size - 1] and f["size"] == size - 1,
    "lost exactly the dead rank's weight": abs(f["weight_lost"] - victim_weight) < 1e-9,
    "survivors hold the rest": abs(sum_w / f["scaled_by"] - (total - victim_weight)) < 1e-9,
    "z - base constant": float(np.ptp(shift)) < 1e-9 * max(1.0, float(np.abs(shift).max())),
}
print("agp_in_flight: " + json.dumps({"rank": rank, "ok": all(checks.values()), "checks": checks,
                                     "weight_lost": f["weight_lost"], "victim_weight": victim_weight,
                                     "sum_w": sum_w}), flush=True)
failures.exit(0 if all(checks.values()) else 1)
