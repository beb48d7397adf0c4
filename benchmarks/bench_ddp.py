"""Training throughput against torch DDP: a synthetic-data benchmark in the style of Horovod's
``pytorch_synthetic_benchmark.py``, ported to ``mpigossip.torch``.

    mpigossip-mpiexec -n 4 python benchmarks/bench_ddp.py [--hidden 1024] [--layers 4] [--batch-size 32]
        [--steps 20] [--rounds 8] [--bucket-mb 25] [--methods allreduce ddp-gloo sgp allreduce-params] [--out FILE]

Every method trains its own copy of the same model (an MLP of ``--layers`` layers of width
``--hidden``) with SGD + momentum on random data for ``--steps`` steps per round; the
methods take turns round after round in the same run, so machine noise hits all alike. A
round's time is the slowest rank's. Reported: steps/s (median over rounds) and, per method,
the median of the per-round ratios of its throughput to DDP's (quartiles in brackets).

* ``allreduce``: :class:`mpigossip.torch.GradientAllReduce` (gradients averaged in buckets
  during backward, the AllReduce baseline of ``compare``);
* ``ddp-gloo``: ``torch.nn.parallel.DistributedDataParallel`` over the gloo backend (TCP);
* ``sgp``: Stochastic Gradient Push, one peer (the exponential graph);
* ``allreduce-params``: parameter averaging after ``optimizer.step()``.
"""

import argparse
import json
import socket
import time

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

import mpigossip.torch as mgt


def build(args):
    torch.manual_seed(0)
    layers, width = [], args.features
    for _ in range(args.layers):
        layers += [torch.nn.Linear(width, args.hidden), torch.nn.ReLU()]
        width = args.hidden
    layers.append(torch.nn.Linear(width, args.classes))
    return torch.nn.Sequential(*layers)


def init_gloo(comm):
    """A gloo process group over TCP, its address chosen by rank 0 and broadcast with MPI."""
    address = None
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            address = (socket.gethostbyname(socket.gethostname()), s.getsockname()[1])
    host, port = comm.bcast(address, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=comm.rank, world_size=comm.size)


class Method:
    def __init__(self, name, args, comm):
        self.name = name
        self.model = build(args)
        if name == "ddp-gloo":
            self.step_model = torch.nn.parallel.DistributedDataParallel(self.model)
            self.algo = None
        else:
            self.step_model = self.model
            options = {"bucket_mb": args.bucket_mb} if name == "allreduce" else {}
            self.algo = mgt.make(name, self.model, comm=comm, **options)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        gen = torch.Generator().manual_seed(comm.rank)
        self.x = torch.randn(args.batch_size, args.features, generator=gen)
        self.y = torch.randint(0, args.classes, (args.batch_size,), generator=gen)

    def run(self, steps):
        for _ in range(steps):
            self.optimizer.zero_grad()
            torch.nn.functional.cross_entropy(self.step_model(self.x), self.y).backward()
            self.optimizer.step()
            if self.algo is not None:
                self.algo.step()
        if self.algo is not None:
            self.algo.drain()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20, help="steps per method per round")
    parser.add_argument("--bucket-mb", type=float, default=25, help="gradient AllReduce bucket size (25, as DDP)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--methods", nargs="+", default=["allreduce", "ddp-gloo", "sgp", "allreduce-params"])
    parser.add_argument("--out", help="write the results as JSON here (and a .md beside it)")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    if "ddp-gloo" in args.methods:
        init_gloo(comm)
    methods = [Method(name, args, comm) for name in args.methods]
    for m in methods:  # warm up
        m.run(2)
    times = {m.name: [] for m in methods}
    for _ in range(args.rounds):
        for m in methods:
            comm.Barrier()
            t0 = time.perf_counter()
            m.run(args.steps)
            times[m.name].append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    params = sum(p.numel() for p in methods[0].model.parameters())
    base = np.array(times["ddp-gloo"]) if "ddp-gloo" in times else None
    rows = []
    for name, t in times.items():
        t = np.array(t)
        row = {"method": name, "ranks": comm.size, "params": params, "model_mb": params * 4 / 2 ** 20,
               "steps_per_s": float(np.median(args.steps / t))}
        if base is not None:
            q1, med, q3 = np.percentile(base / t, [25, 50, 75])  # throughput ratio = DDP time / our time
            row.update(vs_ddp=float(med), q1=float(q1), q3=float(q3))
        rows.append(row)
    if comm.rank == 0:
        lines = [f"{comm.size} ranks, MLP {args.layers}x{args.hidden} ({params * 4 / 2 ** 20:.1f} MB of float32), "
                 f"batch {args.batch_size}, {args.rounds} rounds of {args.steps} steps",
                 "", "| method | steps/s | throughput vs DDP gloo | quartiles |", "|---|---|---|---|"]
        for r in rows:
            vs = f"{r['vs_ddp']:.2f} | {r['q1']:.2f}-{r['q3']:.2f}" if "vs_ddp" in r else "- | -"
            lines.append(f"| {r['method']} | {r['steps_per_s']:.1f} | {vs} |")
        text = "\n".join(lines)
        print(text, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"args": vars(args), "rows": rows}, f, indent=2)
            with open(args.out.rsplit(".", 1)[0] + ".md", "w") as f:
                f.write(text + "\n")
    for m in methods:
        if m.algo is not None:
            m.algo.free()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
