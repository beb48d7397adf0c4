"""A rank is killed (SIGKILL) while a torch wrapper with several parameter groups steps; the
survivors go on with every group (on_failure="continue", several groups recover together).

    mpiexec --with-ft ulfm -n N python survive_groups.py [--algo sgp|dpsgd|gossip-push|allreduce-params|allreduce]
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
--algo allreduce: AllReduce SGD on gradients (``GradientAllReduce``, buckets of --mb / 4 MB, so
the float32 layer's gradients go in several buckets started during the backward pass): each
step a backward pass of a loss whose gradients are the rank's own (rank + 1 times a pattern)
and an SGD step; --mid kills the victim inside its backward pass, with buckets in flight,
--between-buckets as it would finish its second bucket, once the first had completed with it. Its
checks: every group (each bucket's averager) recorded the failure alike, the survivors' models
stay equal, and every step's gradients are the exact mean of the ranks' own (from the step that
met the failure on: the survivors').
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
p.add_argument("--algo", choices=("sgp", "dpsgd", "gossip-push", "allreduce-params", "allreduce"), default="sgp")
p.add_argument("--steps", type=int, default=30)
p.add_argument("--die", type=int, default=6)
p.add_argument("--victim", type=int, default=-1)
p.add_argument("--mb", type=float, default=2.0)
p.add_argument("--mid", action="store_true")
p.add_argument("--between-buckets", action="store_true",
               help="--algo allreduce: the victim dies as it would finish its second bucket (the first complete)")
a = p.parse_args()
faulthandler.dump_traceback_later(90, exit=False)

world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
victim = a.victim if a.victim >= 0 else size - 1
width = max(1, int(a.mb * (1 << 20) / 4 / 64))
layers = [torch.nn.Linear(64, width, bias=False), torch.nn.Linear(4, 3).double()]
if a.algo == "allreduce":   # the float32 MBs in four layers: four buckets of them, and the float64 layer's
    layers = [torch.nn.Linear(64, max(1, width // 4), bias=False) for _ in range(4)] + [torch.nn.Linear(4, 3).double()]
if a.algo == "allreduce-params":
    layers.append(torch.nn.BatchNorm1d(5))
model = torch.nn.Sequential(*layers)
make = {"sgp": mgt.SGP, "dpsgd": mgt.DPSGD, "gossip-push": mgt.GossipPush, "allreduce-params": mgt.AllReduce,
        "allreduce": mgt.GradientAllReduce}
options = {"bucket_mb": a.mb / 4} if a.algo == "allreduce" else {}
algo = make[a.algo](model, comm=world, on_failure="continue", timeout=60, **options)
groups = algo._tolerant_groups()
gradients = a.algo == "allreduce"
if gradients:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    pattern32 = (torch.arange(64, dtype=torch.float32) % 5 + 1).repeat(2, 1)
    pattern64 = (torch.arange(4, dtype=torch.float64) % 3 + 1).repeat(2, 1)
    inexact = []   # the steps whose averaged gradients were not the exact mean of the ranks' own
else:
    with torch.no_grad():  # each rank's own values (the wrapper made them equal): a local update to average
        for i, t in enumerate(list(model.parameters()) + [b for b in model.buffers() if b.is_floating_point()]):
            t.copy_(torch.arange(t.numel(), dtype=t.dtype).reshape(t.shape) % 7 + rank + i)
for i in range(a.steps):
    if rank == victim and i == a.die and a.between_buckets:   # a bucket averaged with the victim, the next not
        algo.buckets[1].averager.finish = lambda: os.kill(os.getpid(), signal.SIGKILL)
    elif rank == victim and i == a.die:
        if not a.mid:
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Timer(0.012, os.kill, (os.getpid(), signal.SIGKILL)).start()  # inside the step
    time.sleep(0.01)
    if gradients:   # this rank's own gradients: (rank + 1) times the pattern, averaged in buckets in backward
        optimizer.zero_grad()
        loss = sum(layer(pattern32 * (rank + 1)).sum() for layer in layers[:-1]) + layers[-1](pattern64 * (rank + 1)).sum()
        loss.backward()
        alive = [r for r in range(size) if r != victim or i < a.die]   # (the step that met it: the survivors')
        expected = (pattern32 * (sum(r + 1 for r in alive) / len(alive))).sum(0)
        if not all(torch.allclose(layer.weight.grad, expected.expand_as(layer.weight), rtol=1e-6, atol=0)
                   for layer in layers[:-1]):
            inexact.append(i)
        optimizer.step()
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
    # (AllReduce SGD on gradients: a pass that met the failure means again over the survivors, one more
    # average for every bucket)
    "steps": (len({json.dumps(s) for s in steps}) == 1 if gradients
              else steps == [[a.steps] * (1 + len(groups))] * comm.Get_size()),
    "one failure": len(algo.failures) == 1 and f["ranks"] == [victim] and f["size"] == size - 1
                   and all(len(g.failures) == 1 for g in groups),
    "same record": len(set(records)) == 1,
    "recovered within 15 s": bool(f) and all(g.failures[0]["seconds"] < 15 for g in groups),
    "weight accounted": a.algo != "sgp" or all(
        abs(comm.allreduce(g.weight) / g.failures[0]["scaled_by"] + g.failures[0]["weight_lost"] - size) < 1e-9
        for g in groups),
    "same consensus": max(firsts) - min(firsts) <= 1e-9 * max(1.0, abs(firsts[0])),
    "converged": spread < (1e-9 if a.algo in ("allreduce-params", "allreduce") else 1e-6),
    "exact gradients": not gradients or not inexact,
    "several buckets": not gradients or len(groups) >= 3,
}
checks = {k: bool(v) for k, v in checks.items()}
print("survive_groups: " + json.dumps({"rank": rank, "ok": all(checks.values()), "checks": checks,
                                       "groups": len(groups), "steps": steps[comm.Get_rank()], "spread": spread,
                                       "failure": f,
                                       "size": comm.Get_size()}), flush=True)
failures.exit(0 if all(checks.values()) else 1)
