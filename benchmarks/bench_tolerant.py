"""What ``on_failure="continue"`` costs while no rank fails: each communicator's fault-tolerant
step against its default one, on the same bytes, side by side in one run.

    mpiexec --with-ft ulfm -n 4 python benchmarks/bench_tolerant.py [--sizes-mb 4 16] [--repeats 15] [--out FILE]
    bash benchmarks/tolerant.sh     # across 4 emulated nodes at 1 Gbit (root)

Both run the algorithm's one schedule (:mod:`mpigossip.exact.ring`, :mod:`mpigossip.decentralized.
pipeline`, :mod:`mpigossip.decentralized.overlap`); what differs is the request strategy (persistent requests, messages under the eager
limit, PushSum's and D-PSGD's combine once the step's messages have all arrived). Pairs:

* ``AllreduceAverager.average``: continue (the flat ring) / default (``algorithm`` as chosen for
  this layout and size: the flat ring with a rank a node);
* ``AllreduceAverager.start+finish``: the same, nonblocking;
* ``PushSum.step`` (one peer, exponential graph) and ``DPSGD.step`` (undirected ring);
* ``PushSum.start+finish``: overlap mode (OSGP, ``max_delay=1``), one schedule
  (:mod:`mpigossip.decentralized.overlap`) on persistent requests with an alarm against plain ones;
  with ``--compute-ms-per-mb`` the caller's work (a sleep) between the two, on both sides, as in
  training, where the time the calls hold the caller is what overlap mode is for;
* ``AsyncPushSum.start+finish``: AGP (``PushSum(max_delay=None)``), the same call and work; since
  AGP never waits, the row also records the shares each rank combined a step on both sides
  (``ours_shares``, ``other_shares``): what the link delivered, not only what the calls cost;
* ``GradientAllReduce.backward``: a torch MLP of the size's parameters (layers of 1 MB) in
  buckets of a quarter of it, its backward pass with the buckets' means overlapped (the
  continue side: each bucket on the flat ring's persistent requests and one agreement a pass).

Each pair is timed alternately (benchmarks/_timing.py: a round is the slowest rank's time; the
ratio is the median of the per-repeat ratios, with quartiles). Under a launch without ULFM the
fault-tolerant side warns once and runs the same code.
"""

import argparse
import json
import time
import warnings

import numpy as np
from _timing import side_by_side  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
from mpi4py import MPI

import mpigossip as mg
from mpigossip.core import provenance
from mpigossip.resilience import failures


def _pair(comm, what, mb, make, call, repeats):
    n = int(mb * 2 ** 20) // 4
    x = np.random.default_rng(comm.rank).standard_normal(n).astype(np.float32)
    y = x.copy()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # (no ULFM: the same code, warned once)
        ours = make(x, "continue")
    other = make(y, "abort")
    row = side_by_side(comm, what, mb, lambda: call(ours), lambda: call(other), repeats,
                       algorithm=getattr(other, "algorithm", None))
    if hasattr(ours, "received"):   # AGP: what the link delivered on each side
        row.update(ours_shares=_shares(ours), other_shares=_shares(other))
    ours.free()
    other.free()
    return row


def _average(avg):
    avg.average()


def _overlapped(avg):
    avg.start()
    while not avg.test():
        pass
    avg.finish()


def _step(c):
    c.step()


def _start_finish(c, compute_s=0.0):
    c.start()
    if compute_s:   # the caller's work between them (a sleep), as OSGP overlaps its messages with a step
        time.sleep(compute_s)
    c.finish()


def _shares(c):
    """AGP: the shares one rank combined a step (mean over ranks), after its timed steps."""
    return c.comm.allreduce(int(c.received.sum())) / (c.size * max(c.steps, 1))


class _Backward:
    """A torch MLP of about ``n`` float32 parameters (1 MB layers) under ``GradientAllReduce``
    (buckets of a quarter of the model) on ``comm``: ``step()`` is one backward pass."""

    def __init__(self, comm, n, on_failure):
        import torch

        from mpigossip.torch import GradientAllReduce
        width = 512   # a 512 x 512 layer: 1 MiB of float32
        torch.manual_seed(0)
        layers = [torch.nn.Linear(width, width, bias=False) for _ in range(max(1, n // width ** 2))]
        self.model = torch.nn.Sequential(*[m for layer in layers for m in (layer, torch.nn.Tanh())])
        self.input = torch.randn(32, width)
        mb = 4 * n / 2 ** 20
        self.wrapper = GradientAllReduce(self.model, comm=comm, bucket_mb=max(mb / 4, 1), on_failure=on_failure)

    def step(self):
        self.model.zero_grad(set_to_none=False)
        self.model(self.input).square().mean().backward()

    def free(self):
        self.wrapper.free()


def _pairs(comm, compute_s):
    """Each pair's name: (make(buffer, on_failure), call(communicator), the caller's seconds of
    work in a call); the overlap pair does ``compute_s`` between ``start()`` and ``finish()``."""
    def exponential():
        return mg.topology.ExponentialGraph(peers=1)
    return {
        "AllreduceAverager.average": (lambda b, f: mg.AllreduceAverager(b, comm=comm, on_failure=f), _average, 0.0),
        "AllreduceAverager.start+finish": (lambda b, f: mg.AllreduceAverager(b, comm=comm, on_failure=f),
                                           _overlapped, 0.0),
        "PushSum.step": (lambda b, f: mg.PushSum(b, comm=comm, on_failure=f, topology=exponential()), _step, 0.0),
        "PushSum.start+finish": (lambda b, f: mg.PushSum(b, comm=comm, on_failure=f, max_delay=1, topology=exponential()),
                                 lambda c: _start_finish(c, compute_s), compute_s),
        "DPSGD.step": (lambda b, f: mg.DPSGD(b, comm=comm, on_failure=f), _step, 0.0),
        "AsyncPushSum.start+finish": (lambda b, f: mg.PushSum(b, comm=comm, on_failure=f, max_delay=None,
                                                              topology=exponential()),
                                      lambda c: _start_finish(c, compute_s), compute_s),
        "GradientAllReduce.backward": (lambda b, f: _Backward(comm, b.size, f), _step, 0.0),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[4, 16])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rate-gbit", type=float, default=None, help="the link rate (recorded)")
    parser.add_argument("--compute-ms-per-mb", type=float, default=0.0,
                        help="PushSum.start+finish and AsyncPushSum.start+finish: sleep this many ms per MB between "
                             "start() and finish() (both sides; 8 is about a 1 Gbit link's time for the message)")
    parser.add_argument("--only", nargs="+", metavar="WHAT", help="only these pairs (e.g. PushSum.start+finish)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rows = []
    nodes = len(set(comm.allgather(MPI.Get_processor_name())))
    unknown = sorted(set(args.only or []) - set(_pairs(comm, 0.0)))
    if unknown:
        parser.error(f"--only: unknown {unknown}; one of {sorted(_pairs(comm, 0.0))}")
    for mb in args.sizes_mb:
        compute_s = args.compute_ms_per_mb * mb / 1e3
        for what, (make, call, compute) in _pairs(comm, compute_s).items():
            if not args.only or what in args.only:
                rows.append(dict(_pair(comm, what, mb, make, call, args.repeats), compute_ms=1e3 * compute))
    if comm.rank == 0:
        meta = {"commit": provenance.commit(), "versions": provenance.versions(), "ranks": comm.size,
                "nodes": nodes, "rate_gbit": args.rate_gbit, "ulfm": failures.enabled(),
                "chunk_bytes": failures.chunk_bytes()}
        print(f"# {json.dumps(meta)}")
        print(f"{'continue / default':<32} {'MB':>5} {'continue ms':>11} {'default ms':>10} {'ratio':>6} "
              f"{'quartiles':>11}")
        for r in rows:
            print(f"{r['what']:<32} {r['mb']:>5g} {r['ours_ms']:>11.2f} {r['other_ms']:>10.2f} {r['ratio']:>6.3f} "
                  f"{r['q1']:>5.2f}-{r['q3']:<5.2f}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
