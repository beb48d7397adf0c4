"""A rank is killed (SIGKILL) mid-training; the survivors of PushSum (synchronous, or overlap
mode as OSGP: --algo osgp; Asynchronous Gradient Push: --algo agp; or D-PSGD, AllreduceAverager (average(), or
start()/test()/finish(): --algo allreduce-overlap), gossip push) with on_failure="continue" go on.

    mpiexec --with-ft ulfm -n N python survive.py [--steps 40] [--die 6] [--victim N-1]
        [--kind numpy|torch] [--mb 1] [--mid] [--algo pushsum|osgp|agp|dpsgd|allreduce|allreduce-overlap|gossip-push]
        [--outer localsgd|slowmo|diloco [--inner-steps 3]] [--dump-after 90]

Every rank mixes a buffer of small integers (its rank plus a pattern) with a 10 ms "compute"
per step (--mid: the victim dies 2 ms into its exchange of step --die, with messages in flight,
instead of before it). Each survivor checks, and prints one JSON line ``survive: {...}``:
- it took every step and stands at the same step as the others (the matched-call rule);
- the failure is recorded alike on every survivor: the victim's rank, the size after, the
  weight lost, a recovery time;
- Σx and Σw over the survivors are conserved from a few steps after the failure to the end
  (nothing else lost), and Σw (divided by the recovery's rescale) plus the weight lost is the
  initial Σw (PushSum; D-PSGD has no weight: w = 1; gossip push keeps no sum, and is checked
  for the rest); the rescale is the power of two that brings Σw above half the survivors
  (--w0 0.1 starts every weight at 0.1: it must);
- with --outer (an outer optimizer over the averager, averaging every --inner-steps steps, and
  a local update between, the same on every element): the same, except Σx, convergence and the
  range, which the local updates and the outer step move;
- z = x / w has converged over the survivors (spread below 1e-6; AGP, which mixes only as fast
  as its links free up, 1e-2), inside the range of the initial values;
- z - base is one constant over the elements on every survivor (x = base + rank: every element
  shares one mixing history, so a share added in part, or its x without its w, shows here);
- the survivors' Σw never exceeds the world size less the victim's weight (killed at a step
  boundary: the victim writes its weight to --record before it dies; mid-step, less nothing).
Ends with ``mpigossip.resilience.failures.exit`` (no MPI_Finalize).
"""

import argparse
import faulthandler
import json
import os
import signal
import threading
import time

import numpy as np
from mpi4py import MPI

import mpigossip as mg
from mpigossip.resilience import failures
from mpigossip.resilience.heal import rescale

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40)
p.add_argument("--die", type=int, default=6)
p.add_argument("--victim", type=int, default=-1)
p.add_argument("--kind", choices=("numpy", "torch"), default="numpy")
p.add_argument("--mb", type=float, default=1.0)
p.add_argument("--mid", action="store_true")
p.add_argument("--algo", choices=("pushsum", "osgp", "agp", "dpsgd", "allreduce", "allreduce-overlap", "gossip-push"),
               default="pushsum")
p.add_argument("--compute-ms", type=float, default=10.0, help="sleep per step (0: steps back to back)")
p.add_argument("--peers", type=int, default=1, help="out-peers a step (PushSum, OSGP, AGP)")
p.add_argument("--unequal", action="store_true",
               help="PushSum family: initial weights 1 + rank (x = w (base + rank)), so that mass gained or lost shows")
p.add_argument("--w0", type=float, default=1.0,
               help="PushSum family: every initial weight times this (0.1: the survivors hold Σw far below their "
                    "number, which the recovery's rescale must bring back)")
p.add_argument("--crash-in-recovery", type=int, default=None,
               help="this rank dies too, in the survivors' recovery (mpigossip.resilience.failures.CRASH_IN_RECOVERY)")
p.add_argument("--outer", choices=("localsgd", "slowmo", "diloco"), default=None,
               help="an outer optimizer (mpigossip.Outer) over the averager, averaging every --inner-steps steps")
p.add_argument("--inner-steps", type=int, default=3)
p.add_argument("--receives", type=int, default=None, help="AGP's receive slots (AsyncPushSum(receives=...))")
p.add_argument("--record", default=None, help="file where the victim writes its weight before it dies")
p.add_argument("--dump-after", type=float, default=90.0,
               help="seconds after which every rank still running prints its threads' stacks (a hang's where)")
a = p.parse_args()
faulthandler.dump_traceback_later(a.dump_after, exit=False)

if a.crash_in_recovery is not None:
    os.environ[failures.CRASH_IN_RECOVERY] = str(a.crash_in_recovery)
world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
total = (size * (size + 1) / 2 if a.unequal else size) * a.w0   # Σw at the start
victim = a.victim if a.victim >= 0 else size - 1
lost = sorted({victim} | ({a.crash_in_recovery} if a.crash_in_recovery is not None else set()))
n = max(1, int(a.mb * (1 << 20)) // 8)
base = np.arange(n, dtype=np.float64) % 7
w0 = (1.0 + rank if a.unequal else 1.0) * a.w0
x = (base + rank) * w0
if a.kind == "torch":
    import torch
    x = torch.from_numpy(x)
host = x.numpy() if a.kind == "torch" else x

if a.algo in ("pushsum", "osgp", "agp"):
    ps = mg.PushSum(x, comm=world, on_failure="continue", timeout=60, max_delay=None if a.algo == "agp" else 1,
                    topology=mg.topology.ExponentialGraph(peers=a.peers), weight=w0,
                    **({"receives": a.receives} if a.receives else {}))
elif a.algo == "gossip-push":
    ps = mg.Gossip(x, comm=world, mode="push", seed=3, on_failure="continue", timeout=60)
    ps.weight = 1.0
else:
    cls = mg.DPSGD if a.algo == "dpsgd" else mg.AllreduceAverager
    ps = cls(x, comm=world, on_failure="continue", timeout=60)
    ps.weight = 1.0  # (no weight: the checks below read it as 1)
averager = ps
algorithm = getattr(ps, "algorithm", None)   # (AllreduceAverager: its ring, as chosen for the launch's layout)
if a.outer:   # the outer step moves x (Σx is not kept) but keeps every element's history one
    outer = mg.Outer(x, averager, inner_steps=a.inner_steps, method=a.outer)
mixed_only = not a.outer   # without an outer step (and its local updates) Σx is conserved
mark = None
for i in range(a.steps):
    if rank == victim and i == a.die:
        if a.record:
            with open(a.record, "w") as f:   # AGP: with what accumulates for its out-peers (its own too)
                f.write(repr(float(ps.weight) + sum(o.waccum for o in getattr(ps, "_outs", {}).values())))
        if not a.mid:
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Timer(a.compute_ms / 1e3 + 0.002, os.kill, (os.getpid(), signal.SIGKILL)).start()  # in the step
    time.sleep(a.compute_ms / 1e3)
    if a.algo == "osgp":    # overlap: this step's share goes out while the next step computes
        if ps.started:
            ps.finish()
        ps.start()
    elif a.algo == "agp":   # never waits
        ps.start()
        ps.finish()
    elif a.algo == "allreduce-overlap":   # the ring's first messages, progress while "computing", then the rest
        ps.start()
        for _ in range(4):
            ps.test()
            time.sleep(0.001)
        ps.finish()
    elif a.outer:   # a local update, the same on every element (z += 0.001 (rank + 1)), then the step
        host += ps.weight * 1e-3 * (rank + 1)
        outer.step()
    else:
        ps.step()
    if i == a.die + 3 + (a.inner_steps if a.outer else 0):  # every survivor has recovered and caught up
        if a.algo == "osgp":   # nothing in flight: the sums hold all the mass
            ps.finish()
        if a.algo in ("osgp", "agp"):
            ps.drain()
        # (gossip push keeps no sum, and a survivor that pushed to no one and heard from no one
        # since the failure has not met it yet: a collective here would be the first to)
        mark = () if a.algo == "gossip-push" else (ps.comm.allreduce(float(host.sum())), ps.comm.allreduce(ps.weight))
if a.algo == "osgp":
    ps.finish()
if a.algo in ("osgp", "agp"):
    ps.drain()
comm = ps.comm
sum_x, sum_w = comm.allreduce(float(host.sum())), comm.allreduce(ps.weight)
z = host / ps.weight
zmin, zmax = np.empty(n), np.empty(n)
comm.Allreduce(z, zmin, op=MPI.MIN)
comm.Allreduce(z, zmax, op=MPI.MAX)
steps = comm.allgather((outer if a.outer else ps).steps)
records = comm.allgather(json.dumps(ps.failures and {k: v for k, v in ps.failures[0].items() if k != "seconds"}))
f = ps.failures[0] if ps.failures else {}
scaled = f.get("scaled_by", 1.0)   # (PushSum family: the recovery's rescale of every survivor's (x, w))
shift = z - base
spread_shift = float(np.ptp(shift))
victim_weight = float(open(a.record).read()) if a.record and not a.mid else 0.0
checks = {  # bool() each: numpy booleans do not serialise
    "steps": steps == [a.steps] * comm.Get_size(),
    "one failure": len(ps.failures) == 1 and f["ranks"] == lost and f["size"] == size - len(lost),
    "same record": len(set(records)) == 1,
    "recovered within 15 s": bool(f) and f["seconds"] < 15,
    "mass conserved after": mark is not None and (mark == () or (
        (not mixed_only or np.isclose(mark[0], sum_x, rtol=1e-12)) and np.isclose(mark[1], sum_w, rtol=1e-12))),
    "weight accounted": bool(f) and (a.algo not in ("pushsum", "osgp", "agp")
                                     or abs(sum_w / scaled + f["weight_lost"] - total) < 1e-9),
    # Σw back above half the survivors (SGP's step on z = x / w not grown by a heavy loss), by a power of two
    "weight rescaled": bool(f) and (a.algo not in ("pushsum", "osgp", "agp") or (
        scaled == rescale(sum_w / scaled, comm.Get_size())
        and (scaled == 1.0 or comm.Get_size() / 2 < sum_w <= comm.Get_size()))),
    # AGP mixes only as fast as its links free up: across nodes 200 steps left a spread near 5e-4
    "converged": bool(a.outer) or float(np.max(zmax - zmin)) < (1e-2 if a.algo == "agp" else 1e-6),
    "inside": bool(a.outer) or (float(zmin.min()) >= 0 and float(zmax.max()) <= 6 + size - 1),
    "z - base constant": spread_shift < 1e-9 * max(1.0, float(np.abs(shift).max())),
    "no mass made": sum_w / scaled <= total - victim_weight + 1e-9,
}
checks = {k: bool(v) for k, v in checks.items()}


def peaks():
    """This process's peak resident and virtual memory (MB; Linux), as measured, not checked."""
    try:
        fields = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
        return {k: int(fields[key].split()[0]) // 1024 for k, key in (("rss_peak_mb", "VmHWM"), ("vsz_peak_mb", "VmPeak"))}
    except (OSError, KeyError, ValueError):
        return {}


print("survive: " + json.dumps({"rank": rank, "ok": all(checks.values()), "checks": checks,
                                "spread": float(np.max(zmax - zmin)), "z - base spread": spread_shift,
                                "sum w": sum_w, "victim weight": victim_weight, "weight": ps.weight, "steps": ps.steps,
                                "preposted": getattr(ps, "preposted", None), "algorithm": algorithm,
                                "received": int(ps.received.sum()) if a.algo == "agp" else None, "failure": f, "size": comm.Get_size(),
                                "chunk_bytes": failures.chunk_bytes(), **peaks()}), flush=True)
failures.exit(0 if all(checks.values()) else 1)
