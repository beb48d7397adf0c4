"""What one link delivers: raw mpi4py transfers between ranks on different nodes, per size.

    mpiexec -n 2 --map-by node python benchmarks/bench_link.py [--sizes-mb 0.25 1 4 16] [--repeats 9]
        [--rate-gbit 1] [--idle-s 0 0.2] [--out FILE.json]

Rank 0 and rank 1 (on two nodes), per size, repeat after repeat: ``one way`` (rank 0 sends,
rank 1 receives, a 1-byte reply closes the clock) and ``both ways`` (each sends the size to the
other at once with ``Isend``/``Irecv``, as every step of a ring or a swap does). Medians, and a
line ``time = fixed + size / rate`` fitted to them: ``fixed`` is what a transfer costs beyond
its bytes at the fitted rate, the part of an allreduce's time that its bandwidth limit
``2 (N - 1) / N × size / link`` leaves out (a ring pays it at each of its 2 (N - 1) steps
only once per pipeline, so not per segment). ``--idle-s``: each transfer after that long a pause
(both ranks asleep, as a training step's compute leaves the link), one set of rows per value:
``0`` is back to back.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np
from mpi4py import MPI


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[0.25, 1, 2, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--rate-gbit", type=float, default=1.0)
    parser.add_argument("--idle-s", type=float, nargs="+", default=[0.0],
                        help="seconds both ranks sleep before each transfer, one set of rows each (default: 0)")
    parser.add_argument("--out")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    if comm.Get_size() != 2:
        sys.exit("bench_link.py: run it on 2 ranks, one per node")
    peer = 1 - rank
    hosts = comm.allgather(MPI.Get_processor_name())
    if hosts[0] == hosts[1] and rank == 0:
        print(f"bench_link.py: both ranks on {hosts[0]}: this measures shared memory, not a link", flush=True)
    rows = []
    ack = np.zeros(1, np.uint8)
    for idle in args.idle_s:
        for mb in args.sizes_mb:
            n = int(mb * 1e6)
            send, recv = np.ones(n, np.uint8), np.empty(n, np.uint8)
            times = {"one way": [], "both ways": []}
            for _ in range(args.repeats):
                comm.Barrier()
                time.sleep(idle)
                comm.Barrier()
                t0 = time.perf_counter()
                if rank == 0:
                    comm.Send(send, dest=1, tag=1)
                    comm.Recv(ack, source=1, tag=2)
                else:
                    comm.Recv(recv, source=0, tag=1)
                    comm.Send(ack, dest=0, tag=2)
                times["one way"].append(time.perf_counter() - t0)
                comm.Barrier()
                time.sleep(idle)
                comm.Barrier()
                t0 = time.perf_counter()
                MPI.Request.Waitall([comm.Irecv(recv, source=peer, tag=3), comm.Isend(send, dest=peer, tag=3)])
                times["both ways"].append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
            for what, ts in times.items():
                rows.append({"what": what, "mb": mb, "idle_s": idle, "ms": float(np.median(ts)) * 1e3,
                             "link_ms": mb * 1e6 / (args.rate_gbit * 125e6) * 1e3})
    if rank == 0:
        fits = {}
        for idle in args.idle_s:
            for what in ("one way", "both ways"):
                r = [x for x in rows if x["what"] == what and x["idle_s"] == idle]
                slope, fixed = np.polyfit([x["mb"] for x in r], [x["ms"] for x in r], 1)
                fits[f"{what}, idle {idle:g} s" if len(args.idle_s) > 1 or idle else what] = {
                    "fixed_ms": float(fixed), "rate_mb_s": float(1e3 / slope)}
        for x in rows:
            print(f"{x['what']:<10} {x['mb']:>6g} MB after {x['idle_s']:g} s idle: {x['ms']:7.1f} ms "
                  f"(link {x['link_ms']:.1f} ms, {x['ms'] / x['link_ms']:.2f}x)")
        for what, f in fits.items():
            print(f"{what}: time = {f['fixed_ms']:.1f} ms + size / {f['rate_mb_s']:.0f} MB/s")
        if args.out:
            import mpi4py
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
            import mpigossip
            meta = {"commit": commit, "mpigossip": mpigossip.__version__, "command": " ".join(sys.argv),
                    "mpi4py": mpi4py.__version__,
                    "mpi": MPI.Get_library_version().split(",")[0], "numpy": np.__version__, "hosts": hosts}
            with open(args.out, "w") as f:
                json.dump({"meta": meta, "rows": rows, "fits": fits}, f, indent=2)


if __name__ == "__main__":
    main()
