"""Network benchmark: the communicators against raw MPI on the same bytes along the same
edges, and the fraction of the link's bandwidth each achieves. Meant for ranks on several
nodes (the emulated cluster: ``benchmarks/network.sh`` runs it at 4 and 8 ranks).

    mpiexec -n 4 python benchmarks/bench_network.py [--sizes-mb 4 16] [--repeats 9] [--rate-gbit 1]
        [--label NAME] [--parts p1 p2] [--out FILE]

* P1 ``AllreduceAverager.average`` / raw ``Allreduce`` (``MPI.IN_PLACE``) under the launch's
  Allreduce algorithm (``--label`` names it: ``network.sh`` launches once per Open MPI tuned
  algorithm and reports the best raw one);
* P2 ``PushSum.step`` / raw ``Isend`` + ``Irecv`` of the same buffer to the same peers, step
  for step (exponential graph, one peer);
* P3 a training step through the torch wrappers, SGP / AllReduce, same model (one square
  ``nn.Linear`` of S bytes, batch 8), timed side by side in blocks of ``--p3-steps`` steps;
* P4 a straggler: every step sleeps ``--compute-ms`` (rank 1: twice that) before a tiny
  forward/backward, then the algorithm's step. Throughput = the sum over ranks of steps per
  second of each rank's own run (an asynchronous rank is not held back by a slow one); the
  figure is throughput with the straggler / without (``keep``), and with the straggler against
  AllReduce's with the straggler (``vs_allreduce``), for every algorithm (each communicates
  every step). ``--p4-repeats`` runs every algorithm that many times, interleaved, and gives
  medians (ratios paired within a repeat) with their range. ``exchange_ms``: the mean time a
  rank spends inside the algorithm's ``step()`` without a straggler, beside ``link_ms``, one
  model's bytes at the link's rate. Modelling compute as a sleep keeps the ranks from
  competing for cores, so the straggler does not free CPU for the others.

Link limit: the bytes the busiest node link must carry in one direction divided by the
rate: ``2 (N-1)/N x S`` for an Allreduce over N nodes (each node's data must leave and the
result come back), and for PushSum the most bytes any node sends or receives across nodes
in a step (ranks on the same node talk through shared memory), averaged over the graph's
period. ``link`` = limit / measured time: 1.0 = the wire is full.
"""

import argparse
import json
import os
import sys
import time

import numpy as np
from mpi4py import MPI

import mpigossip as mg

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _p4_probe import Probe  # noqa: E402
from _timing import side_by_side  # noqa: E402


def node_map(comm):
    """The node index of every rank (by host name, in order of first appearance)."""
    names = comm.allgather(MPI.Get_processor_name())
    order = list(dict.fromkeys(names))
    return [order.index(n) for n in names], len(order)


def pushsum_link_bytes(topology, nodes, steps):
    """Mean over ``steps`` of the most bytes (in buffers) any node sends or receives across
    nodes in one PushSum step."""
    worst = []
    for k in range(steps):
        out = [0] * (max(nodes) + 1)
        inn = [0] * (max(nodes) + 1)
        for r in range(len(nodes)):
            for d in topology.out_peers(r, k):
                if nodes[d] != nodes[r]:
                    out[nodes[r]] += 1
                    inn[nodes[d]] += 1
        worst.append(max(out + inn))
    return float(np.mean(worst))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[4, 16])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--rate-gbit", type=float, default=1.0, help="each node's link rate (default: 1)")
    parser.add_argument("--label", default="default", help="the Allreduce algorithm of this launch")
    parser.add_argument("--parts", nargs="+", default=["p1", "p2"], choices=["p1", "p2", "p3", "p4"])
    parser.add_argument("--p3-steps", type=int, default=3, help="P3: training steps per timed block (3)")
    parser.add_argument("--compute-ms", type=float, default=100.0, help="P4: one step's computation, ms (100)")
    parser.add_argument("--p4-steps", type=int, default=30, help="P4: steps per run (30)")
    parser.add_argument("--p4-repeats", type=int, default=1, help="P4: runs of every algorithm, interleaved (1)")
    parser.add_argument("--p4-algorithms", nargs="+",
                        default=["allreduce", "sgp", "osgp", "osgp:4", "agp", "gossip-pull", "easgd", "adpsgd"],
                        help="P4 algorithms; osgp:D = OSGP with max_delay D (default max_delay 1); easgd:S = EASGD with its "
                        "center sharded over S server ranks (default 1)")
    parser.add_argument("--p2-chunk-kb", type=int, help="P2: PushSum's chunk_bytes / 1024 (default: its own)")
    parser.add_argument("--p2-slots", type=int, help="P2: PushSum's slots (default: its own)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    nodes, n_nodes = node_map(comm)
    rate = args.rate_gbit * 1e9 / 8  # bytes per second
    rows = []
    for mb in args.sizes_mb:
        n = int(mb * 2 ** 20) // 4
        nbytes = n * 4
        x = np.random.default_rng(rank).standard_normal(n).astype(np.float32)
        raw = x.copy()

        def allreduce():
            comm.Allreduce(MPI.IN_PLACE, raw, MPI.SUM)

        if "p1" in args.parts:
            with mg.AllreduceAverager(x, comm=comm) as avg:
                row = side_by_side(comm, "P1 AllreduceAverager.average / Allreduce", mb, avg.average, allreduce,
                                   args.repeats, algorithm=args.label, nodes=n_nodes)
            limit = 2 * (n_nodes - 1) / n_nodes * nbytes / rate if n_nodes > 1 else 0.0
            rows.append(dict(row, limit_ms=limit * 1e3, link_ours=limit * 1e3 / row["ours_ms"],
                             link_other=limit * 1e3 / row["other_ms"]))

        if size > 1 and "p2" in args.parts:
            pipeline = {k: v for k, v in (("chunk_bytes", args.p2_chunk_kb and args.p2_chunk_kb << 10),
                                          ("slots", args.p2_slots)) if v}
            with mg.PushSum(x, comm=comm, topology=mg.topology.ExponentialGraph(peers=1), **pipeline) as ps:
                bound = ps.topology
                recv = np.empty_like(raw)
                step = [0]

                def exchange():  # the messages PushSum.step sends (and its weight), no arithmetic
                    k = step[0]
                    step[0] += 1
                    reqs = [comm.Irecv(recv, source=s, tag=7) for s in bound.in_peers(rank, k)]
                    reqs += [comm.Isend(raw, dest=d, tag=7) for d in bound.out_peers(rank, k)]
                    MPI.Request.Waitall(reqs)

                row = side_by_side(comm, "P2 PushSum.step / Isend+Irecv", mb, ps.step, exchange, args.repeats,
                                   algorithm=args.label, nodes=n_nodes)
                row.update(chunk_bytes=ps._pipeline.chunk * x.itemsize, slots=ps._pipeline.slots)
                period = max(1, (size - 1).bit_length())
                limit = pushsum_link_bytes(bound, nodes, period) * nbytes / rate
                rows.append(dict(row, limit_ms=limit * 1e3, link_ours=limit * 1e3 / row["ours_ms"],
                                 link_other=limit * 1e3 / row["other_ms"]))
    if "p3" in args.parts or "p4" in args.parts:
        rows += training_rows(comm, args, n_nodes)
    if rank == 0:
        for r in rows:
            if "keep" in r:
                print(f"{r['what']:<42} {r['mb']:>4g} MB {r['ranks']} ranks/{r['nodes']} nodes: "
                      f"{r['algorithm']}: {r['steps_per_s']:.2f} -> {r['steps_per_s_straggler']:.2f} steps/s, "
                      f"keeps {r['keep']:.3f}, x{r.get('vs_allreduce_straggler', float('nan')):.2f} AllReduce's "
                      f"with the straggler, in step {r['exchange_ms']:.0f} ms", flush=True)
                continue
            print(f"{r['what']:<42} {r['mb']:>4g} MB {r['ranks']} ranks/{r['nodes']} nodes [{r['algorithm']}]: "
                  f"ours {r['ours_ms']:.1f} ms, raw {r['other_ms']:.1f} ms, ratio {r['ratio']:.3f} "
                  f"({r['q1']:.2f}-{r['q3']:.2f})" + (f", link {r['link_ours']:.2f} / {r['link_other']:.2f}"
                                                   if "link_ours" in r else ""), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=2)


def _model(mb, seed):
    """One square ``nn.Linear`` with about ``mb`` MB of float32 weights (no bias)."""
    import torch
    k = max(2, int((mb * 2 ** 20 / 4) ** 0.5))
    torch.manual_seed(seed)
    return torch.nn.Linear(k, k, bias=False), k


def _trainer(name, mb, comm, seed=0, **options):
    """(step function, algorithm, list of seconds spent in ``algo.step()``) of one torch
    wrapper over a fresh model."""
    import torch

    import mpigossip.torch as mgt
    model, k = _model(mb, seed)
    algo = mgt.make(name, model, comm=comm, **options)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(8, k)
    spent = []

    def step(sleep_s=0.0):
        if sleep_s:
            time.sleep(sleep_s)
        loss = model(x).square().mean()
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        t0 = time.perf_counter()
        algo.step()
        spent.append(time.perf_counter() - t0)
    return step, algo, spent


def _own_rate(comm, step, steps, sleep_s, spent, probe):
    """(steps per second of this rank's own run of ``steps`` steps after 2 warm-up steps,
    mean seconds of those steps spent in the algorithm's step, the probe's parts of them)."""
    for _ in range(2):
        step(sleep_s)
    comm.Barrier()
    del spent[:]
    probe.start()
    t0 = time.perf_counter()
    for _ in range(steps):
        step(sleep_s)
    rate = steps / (time.perf_counter() - t0)
    return rate, float(np.mean(spent)), dict(probe.result(steps), step_ms=float(np.mean(spent)) * 1e3)


def _p4_runs(comm, args, mb, n_nodes):
    """P4 rows for one size: every algorithm ``--p4-repeats`` times, interleaved."""
    runs = {label: [] for label in args.p4_algorithms}  # label -> [(rate, rate_straggler, exchange_s)]
    by_rank = {label: [] for label in args.p4_algorithms}  # label -> [(each rank's rate, ... straggler)]
    parts = {label: [] for label in args.p4_algorithms}  # label -> [(each rank's parts, ... straggler)]
    for _ in range(args.p4_repeats):
        for label in args.p4_algorithms:
            name, _, delay = label.partition(":")
            options = {"max_delay": int(delay or 1)} if name == "osgp" else {"servers": int(delay)} \
                if name == "easgd" and delay else {}
            rates, own_rates, own_parts, exchange = [], [], [], 0.0
            for slow in (1.0, 2.0):
                factor = slow if comm.rank == 1 else 1.0
                step, algo, spent = _trainer(name, mb, comm, **options)
                probe = Probe(algo)
                own, in_step, mine = _own_rate(comm, step, args.p4_steps, factor * args.compute_ms / 1e3, spent, probe)
                probe.detach()
                algo.drain()
                algo.free()
                rates.append(comm.allreduce(own))
                own_rates.append(comm.allgather(own))
                own_parts.append(comm.allgather(mine))
                if slow == 1.0:
                    exchange = comm.allreduce(in_step) / comm.size
            runs[label].append((rates[0], rates[1], exchange))
            by_rank[label].append(own_rates)
            parts[label].append(own_parts)
    base = runs.get("allreduce")
    rows = []
    for label, got in runs.items():
        a = np.array(got)
        row = {"what": "P4 straggler throughput (rank 1 2x slow)", "mb": mb, "ranks": comm.size,
               "nodes": n_nodes, "algorithm": label, "compute_ms": args.compute_ms, "steps": args.p4_steps,
               "repeats": len(got), "steps_per_s": float(np.median(a[:, 0])),
               "steps_per_s_straggler": float(np.median(a[:, 1])), "keep": float(np.median(a[:, 1] / a[:, 0])),
               "keep_range": [float(v) for v in (np.min(a[:, 1] / a[:, 0]), np.max(a[:, 1] / a[:, 0]))],
               "runs": [[float(v) for v in r] for r in got],
               "rank_steps_per_s": [[float(v) for v in r[0]] for r in by_rank[label]],
               "rank_steps_per_s_straggler": [[float(v) for v in r[1]] for r in by_rank[label]],
               # each repeat's, each rank's parts of a step (_p4_probe): CPU, locks and reads, AGP's counts
               "rank_parts": [r[0] for r in parts[label]], "rank_parts_straggler": [r[1] for r in parts[label]],
               "exchange_ms": float(np.median(a[:, 2])) * 1e3,
               "link_ms": mb * 2 ** 20 / (args.rate_gbit * 1e9 / 8) * 1e3, "rate_gbit": args.rate_gbit,
               "cores": os.cpu_count(), "cores_per_node": os.environ.get("MPIGOSSIP_CORES_PER_NODE")}
        if base is not None:
            b = np.array(base)
            row["vs_allreduce"] = float(np.median(a[:, 0] / b[:, 0]))
            row["vs_allreduce_straggler"] = float(np.median(a[:, 1] / b[:, 1]))
        rows.append(row)
    return rows


def training_rows(comm, args, n_nodes):
    """P3 and P4 rows (torch wrappers)."""
    rows = []
    for mb in args.sizes_mb:
        if "p3" in args.parts and comm.size > 1:
            sgp_step, sgp, _ = _trainer("sgp", mb, comm)
            ar_step, ar, _ = _trainer("allreduce", mb, comm)
            k = args.p3_steps
            row = side_by_side(comm, "P3 SGP step / AllReduce step (torch)", mb,
                               lambda: [sgp_step() for _ in range(k)], lambda: [ar_step() for _ in range(k)],
                               args.repeats, algorithm="torch wrappers", nodes=n_nodes)
            rows.append(dict(row, ours_ms=row["ours_ms"] / k, other_ms=row["other_ms"] / k))
            sgp.free()
            ar.free()
        if "p4" in args.parts and comm.size > 1:
            rows += _p4_runs(comm, args, mb, n_nodes)
    return rows


if __name__ == "__main__":
    main()
