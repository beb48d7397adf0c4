"""Exit with messages in flight and without free(): every rank must exit with status 0.

    mpiexec -n N python tests/scripts/exit_in_flight.py [exit|gc]

Builds every communicator and torch wrapper, leaves each with requests in flight (overlap
PushSum, AGP and OSGP sends and receives posted (AGP's drain at exit is collective: the ranks
complete in construction order), an Iallreduce started, server and gossip
windows locked), then either just ends (``exit``: the interpreter's own shutdown) or drops
every reference and collects garbage first (``gc``). Before the fix, OSGP crashed inside
MPI_Finalize: requests outlived the buffers they send from.
"""

import gc
import sys

import numpy as np
import torch
from mpi4py import MPI

import mpigossip as mg
import mpigossip.torch as mgt

mode = sys.argv[1] if len(sys.argv) > 1 else "exit"
comm = MPI.COMM_WORLD
n = 1 << 18  # 2 MB of float64: large enough to go by rendezvous, not eagerly
keep = []

ps = mg.PushSum(np.full(n, float(comm.rank)), comm=comm, max_delay=2)
for _ in range(3):
    ps.start()
    ps.finish()
ps.start()  # started, never finished
keep.append(ps)

avg = mg.AllreduceAverager(np.ones(n), comm=comm)
avg.start()  # never waited
keep.append(avg)

keep.append(mg.Gossip(np.ones(n), comm=comm, mode="pull"))
server = mg.ParameterServer(n, np.float64, comm=comm)
keep += [server, mg.ElasticAveraging(np.ones(n), server)]

torch.manual_seed(0)
for name in ("gossip-push", "easgd", "agp", "osgp"):  # osgp last: its sends are in flight at exit
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    algo = mgt.make(name, model, comm=comm)
    for _ in range(5):
        optimizer.zero_grad()
        model(torch.randn(32, 1024)).sum().backward()
        optimizer.step()
        algo.step()
    keep.append(algo)

print(f"rank {comm.rank}: {len(keep)} objects in flight, exiting ({mode})", flush=True)
if mode == "gc":
    del ps, avg, server, algo, model, optimizer
    keep.clear()
    gc.collect()
