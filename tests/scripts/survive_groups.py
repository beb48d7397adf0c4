"""A rank is killed (SIGKILL) while a torch wrapper with several parameter groups steps; the
survivors go on with every group (on_failure="continue", several groups recover together).

    mpiexec --with-ft ulfm -n N python survive_groups.py [--algo sgp|dpsgd|gossip-push|allreduce-params]
        [--steps 30] [--die 6] [--victim N-1] [--mb 2] [--mid]

The model has three parameter groups' worth of communicators: a float32 layer of about --mb
MB, a float64 layer (a second dtype: a second group), and, for allreduce-params, BatchNorm's
floating-point statistics (averaged too). No training: the parameters start at each rank's
own values and the algorithm averages them, 10 ms of "compute" a step; --mid kills the victim
2 ms into its exchange of step --die (some survivors are then past the first group and inside
the second). Each survivor checks, and prints one JSON line ``survive_groups: {...}``:
- it took every step, and every group stands at the same step on every survivor;
- the failure is recorded once by the wrapper and once by every group, alike on every survivor;
- SGP: per group, Σw over the survivors plus the weight lost is the initial world size;
- the survivors' consensus models (a collective over the wrapper's shrunk communicator) are
  equal on every survivor, and every group of every survivor has converged to it
  (AllReduce: equal; SGP, D-PSGD, gossip: within 1e-6; gossip, one random target a round,
  needs --steps 100 for that).
Ends with ``mpigossip.resilience.failures.exit`` (no MPI_Finalize).
"""

import argparse
import faulthandler
import json
import os
import signal
import threading
import time

import torch
from mpi4py import MPI

import mpigossip.torch as mgt
from mpigossip.resilience import failures

p = argparse.ArgumentParser()
p.add_argument("--algo", choices=("sgp", "dpsgd", "gossip-push", "allreduce-params"), default="sgp")
p.add_argument("--steps", type=int, default=30)
p.add_argument("--die", type=int, default=6)
p.add_argument("--victim", type=int, default=-1)
p.add_argument("--mb", type=float, default=2.0)
p.add_argument("--mid", action="store_true")
a = p.parse_args()
faulthandler.dump_traceback_later(90, exit=False)

world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
victim = a.victim if a.victim >= 0 else size - 1
width = max(1, int(a.mb * (1 << 20) / 4 / 64))
layers = [torch.nn.Linear(64, width, bias=False), torch.nn.Linear(4, 3).double()]
if a.algo == "allreduce-params":
    layers.append(torch.nn.BatchNorm1d(5))
model = torch.nn.Sequential(*layers)
make = {"sgp": mgt.SGP, "dpsgd": mgt.DPSGD, "gossip-push": mgt.GossipPush, "allreduce-params": mgt.AllReduce}
algo = make[a.algo](model, comm=world, on_failure="continue", timeout=60)
groups = algo._tolerant_groups()
with torch.no_grad():  # each rank's own values (the wrapper made them equal): a local update to average
    for i, t in enumerate(list(model.parameters()) + [b for b in model.buffers() if b.is_floating_point()]):
        t.copy_(torch.arange(t.numel(), dtype=t.dtype).reshape(t.shape) % 7 + rank + i)
for i in range(a.steps):
    if rank == victim and i == a.die:
        if not a.mid:
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Timer(0.012, os.kill, (os.getpid(), signal.SIGKILL)).start()  # inside the step
    time.sleep(0.01)
    algo.step()
comm = algo.comm
f = algo.failures[0] if algo.failures else {}
steps = comm.allgather([algo.steps] + [g.steps for g in groups])
records = comm.allgather(json.dumps([{k: v for k, v in r.items() if k != "seconds"}
                                     for r in [f] + [g.failures[0] for g in groups if g.failures]]))
consensus = algo.consensus_model()
flat = torch.cat([t.detach().double().flatten() for t in consensus.parameters()])
spread = max(float(torch.max(torch.abs(t.detach().double() - c.detach().double())))
             for t, c in zip(model.parameters(), consensus.parameters()))
firsts = comm.allgather(float(flat.sum()))
checks = {
    "steps": steps == [[a.steps] * (1 + len(groups))] * comm.Get_size(),
    "one failure": len(algo.failures) == 1 and f["ranks"] == [victim] and f["size"] == size - 1
                   and all(len(g.failures) == 1 for g in groups),
    "same record": len(set(records)) == 1,
    "recovered within 15 s": bool(f) and all(g.failures[0]["seconds"] < 15 for g in groups),
    "weight accounted": a.algo != "sgp" or all(
        abs(comm.allreduce(g.weight) + g.failures[0]["weight_lost"] - size) < 1e-9 for g in groups),
    "same consensus": max(firsts) - min(firsts) <= 1e-9 * max(1.0, abs(firsts[0])),
    "converged": spread < (1e-9 if a.algo == "allreduce-params" else 1e-6),
}
checks = {k: bool(v) for k, v in checks.items()}
print("survive_groups: " + json.dumps({"rank": rank, "ok": all(checks.values()), "checks": checks,
                                       "groups": len(groups), "steps": steps[comm.Get_rank()], "spread": spread,
                                       "failure": f,
                                       "size": comm.Get_size()}), flush=True)
failures.exit(0 if all(checks.values()) else 1)
