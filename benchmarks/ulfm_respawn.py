"""Can the survivors of a killed rank grow the job back to its size under Open MPI's ULFM? A raw
mpi4py reproducer for #45 (a dead rank replaced), measuring each phase.

    mpigossip-mpiexec --with-ft ulfm -n 4 python benchmarks/ulfm_respawn.py [--mode spawn] [--mb 16]
    python benchmarks/ulfm_respawn.py --mode accept --ranks 4 [--mb 16]     # launches both jobs itself

Every rank holds ``--mb`` MB of float64 (rank r: the value r). Rank ``--victim`` (default: the
last) SIGKILLs itself after a first exchange; the survivors meet the failure in an Allreduce,
revoke, shrink (``MPI_Comm_shrink``) and agree, then bring in one new process:

* ``spawn``: ``MPI_Comm_spawn`` from the shrunk communicator (root: its rank 0), the newcomer
  started by the same launcher on a free slot, then ``MPI_Intercomm_merge``;
* ``accept``: the survivors' rank 0 opens a port (``MPI_Open_port``) and writes it to a file;
  a second, separate ``mpiexec -n 1`` starts the newcomer, which ``MPI_Comm_connect``s to it
  while the survivors ``MPI_Comm_accept``; then ``MPI_Intercomm_merge``.

The merged communicator is re-ranked (``MPI_Comm_split`` by key) so the newcomer takes the dead
rank's number; rank 0 broadcasts its buffer to it (the heal: a model and its state), and an
Allreduce over the grown communicator checks the size and the sum. Each rank prints one JSON
line: the phase times (failure seen, revoke + shrink + agree, spawn or accept, merge + split,
heal, check), the final size and whether the check held. A phase that raises is reported with
its error class and the rank exits 1; every MPI call here is under ``timeout`` from the outside
(the runner's ``timeout``): nothing retries.
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import mpi4py

if "--finalize" not in sys.argv:   # survivors of a failure may hang in MPI_Finalize over TCP (ulfm_probe.py)
    mpi4py.rc.finalize = False
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

FAILED = {getattr(MPI, n) for n in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED") if hasattr(MPI, n)}


def report(**fields):
    print(json.dumps(fields), flush=True)


def survivor(args):
    world = MPI.COMM_WORLD
    comm = world.Dup()
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    rank, size = comm.Get_rank(), comm.Get_size()
    victim = args.victim if args.victim >= 0 else size - 1
    x = np.full(int(args.mb * (1 << 20) // 8), float(rank))
    out = np.empty_like(x)
    comm.Allreduce(x, out)
    hosts = comm.allgather(socket.gethostname())
    comm.Barrier()
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    times = {}
    t0 = time.monotonic()
    try:
        for _ in range(100):
            comm.Allreduce(x, out)
            time.sleep(0.01)
        report(rank=rank, error="no failure seen in 100 Allreduces")
        return 1
    except MPI.Exception as exc:
        if exc.Get_error_class() not in FAILED:
            raise
    times["seen_s"] = time.monotonic() - t0
    t = time.monotonic()
    comm.Revoke()
    new = comm.Shrink()
    new.Set_errhandler(MPI.ERRORS_RETURN)
    new.Agree(1)
    times["shrink_s"] = time.monotonic() - t
    dead = sorted(set(range(size)) - set(MPI.Group.Translate_ranks(new.Get_group(), list(range(new.Get_size())),
                                                                       comm.Get_group())))
    phase = args.mode
    try:
        t = time.monotonic()
        if args.mode == "spawn":
            child = [os.path.abspath(__file__), "--child", "--mb", str(args.mb), "--dead", str(dead[0])]
            info = MPI.Info.Create()
            if args.spawn_on != "default":   # where the newcomer goes: the dead rank's host, rank 0's, or a spare
                where = {"dead": hosts[dead[0]], "survivor": hosts[0], "spare": args.spare}[args.spawn_on]
                info.Set("host", where)
                info.Set("map_by", ":OVERSUBSCRIBE")
            times["spawn_host"] = None if args.spawn_on == "default" else info.Get("host")
            inter = new.Spawn(sys.executable, child + (["--finalize"] if args.finalize else []), maxprocs=len(dead),
                              info=info, root=0)
        else:
            port = MPI.Open_port() if new.Get_rank() == 0 else None
            if port is not None:
                with open(args.port_file + ".tmp", "w") as f:
                    f.write(port)
                os.replace(args.port_file + ".tmp", args.port_file)
            inter = new.Accept(port, root=0)
        inter.Set_errhandler(MPI.ERRORS_RETURN)
        times[f"{args.mode}_s"] = time.monotonic() - t
        phase = "merge"
        t = time.monotonic()
        merged = inter.Merge(high=False)
        merged.Set_errhandler(MPI.ERRORS_RETURN)
        times["merge_s"] = time.monotonic() - t
        phase = "heal"
        # survivors keep their old numbers (key = the old rank); the newcomer sorts in at ``dead``
        grown, final, ok = heal(merged, rank, args.mb, times, t0, newcomer=False)
    except MPI.Exception as exc:
        report(rank=rank, role="survivor", mode=args.mode, phase=phase, error_class=exc.Get_error_class(),
               error=exc.Get_error_string(), **times)
        return 1
    report(rank=rank, role="survivor", mode=args.mode, dead=dead, final_size=final, check=ok,
           new_rank=grown.Get_rank(), **times)
    return 0 if ok else 1


def heal(merged, key, mb, times, t0, newcomer):
    """Re-rank (``key``: a survivor's old rank, the dead rank's for the newcomer), broadcast
    rank 0's buffer to the newcomer, check the size with an Allreduce."""
    t = time.monotonic()
    grown = merged.Split(0, key=key)
    grown.Set_errhandler(MPI.ERRORS_RETURN)
    times["split_s"] = time.monotonic() - t
    buf = np.empty(int(mb * (1 << 20) // 8)) if newcomer else np.full(int(mb * (1 << 20) // 8), 7.0)
    t = time.monotonic()
    grown.Bcast(buf, root=0)
    times["heal_s"] = time.monotonic() - t
    one, total = np.array([float(grown.Get_rank())]), np.empty(1)
    t = time.monotonic()
    grown.Allreduce(one, total, op=MPI.SUM)
    times["check_s"] = time.monotonic() - t
    size = grown.Get_size()
    times["total_s"] = time.monotonic() - t0
    ok = bool(buf[0] == 7.0 and buf[-1] == 7.0 and total[0] == size * (size - 1) / 2)
    return grown, size, ok


def newcomer(args):
    t0 = time.monotonic()
    times = {}
    phase = "connect"
    try:
        if args.mode == "spawn" or MPI.Comm.Get_parent() != MPI.COMM_NULL:
            inter = MPI.Comm.Get_parent()
        else:
            deadline = time.monotonic() + 60
            while not os.path.exists(args.port_file):
                if time.monotonic() > deadline:
                    report(role="newcomer", error="no port file within 60 s")
                    return 1
                time.sleep(0.05)
            port = open(args.port_file).read()
            inter = MPI.COMM_WORLD.Connect(port, root=0)
        inter.Set_errhandler(MPI.ERRORS_RETURN)
        times["connect_s"] = time.monotonic() - t0
        phase = "merge"
        merged = inter.Merge(high=True)
        merged.Set_errhandler(MPI.ERRORS_RETURN)
        phase = "heal"
        grown, final, ok = heal(merged, args.dead, args.mb, times, t0, newcomer=True)
    except MPI.Exception as exc:
        report(role="newcomer", phase=phase, error_class=exc.Get_error_class(), error=exc.Get_error_string(), **times)
        return 1
    report(role="newcomer", rank=grown.Get_rank(), final_size=final, check=ok, **times)
    return 0 if ok else 1


def run_accept(args):
    """``--mode accept`` without --child: launch the survivors' job and, once the port file
    appears, the newcomer's own ``mpiexec -n 1``."""
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpigossip-mpiexec")
    port_file = os.path.join(tempfile.mkdtemp(), "port")
    me = [sys.executable, os.path.abspath(__file__), "--mode", "accept", "--mb", str(args.mb), "--port-file", port_file,
          *(["--finalize"] if args.finalize else [])]
    job = subprocess.Popen([mpiexec, "--with-ft", "ulfm", "-n", str(args.ranks), *me, "--victim", str(args.victim)])
    victim = args.victim if args.victim >= 0 else args.ranks - 1
    new = subprocess.Popen([mpiexec, "-n", "1", *me, "--child",
                            "--dead", str(victim)])
    try:
        codes = job.wait(timeout=args.timeout), new.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        job.kill()
        new.kill()
        print(f"ulfm_respawn: accept: no end within {args.timeout} s (killed)", flush=True)
        return 3
    return 0 if codes == (0, 0) else 1


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("spawn", "accept"), default="spawn")
    p.add_argument("--mb", type=float, default=16.0, help="the buffer healed (MB of float64)")
    p.add_argument("--victim", type=int, default=-1, help="default: the last rank")
    p.add_argument("--ranks", type=int, default=4, help="accept mode's launch: the survivors' job size")
    p.add_argument("--timeout", type=float, default=120.0, help="accept mode's launch: seconds before both jobs end")
    p.add_argument("--port-file", default=None)
    p.add_argument("--finalize", action="store_true", help="end with MPI_Finalize (default: without)")
    p.add_argument("--spawn-on", choices=("default", "dead", "survivor", "spare"), default="default",
                   help="spawn mode: where the newcomer goes (MPI_Info host): the launcher's choice, the dead "
                   "rank's host, rank 0's, or --spare (a node of the launch where no rank runs) (across nodes, "
                   "Open MPI 5.0.11: on the dead rank's host, when no other rank of the job lives there, the "
                   "newcomer fails in MPI_Init)")
    p.add_argument("--spare", default=None, help="--spawn-on spare: the host (benchmarks/ulfm_spare.py)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dead", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.spawn_on == "spare" and not args.spare:
        p.error("--spawn-on spare needs --spare HOST")
    if args.child:
        return newcomer(args)
    if args.mode == "accept" and args.port_file is None:
        return run_accept(args)
    return survivor(args)


if __name__ == "__main__":
    sys.exit(main())
