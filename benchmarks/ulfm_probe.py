"""Does Open MPI's ULFM let the survivors of a killed rank go on? A raw mpi4py reproducer.

    mpiexec --with-ft ulfm [--mca btl tcp,self] -n 4 python benchmarks/ulfm_probe.py \
        [--steps 20] [--victim 3] [--die 5] [--mb 1] [--pattern ring|pairs] [--free-old]
        [--requests keep|cancel-recvs|free] [--order all|recvs-first] [--persistent] [--no-finalize]
        [--how kill|stop] [--step-ms 0]

Every rank exchanges ``--mb`` MB with its ring neighbours (``Isend``/``Irecv`` to both, then
``Waitall``) for ``--steps`` steps; rank ``--victim`` kills itself (SIGKILL) at step ``--die``
(``--how stop``: stops itself, SIGSTOP, a hung rank).
Every communicator returns errors (``ERRORS_RETURN``). A survivor whose exchange fails with a
process failure or a revoked communicator revokes it, frees or cancels its pending requests,
shrinks it (``MPI_Comm_shrink``), agrees (``MPI_Comm_agree``) that the shrink is complete and
resumes over the survivors from the earliest step any of them had not finished (a rank whose
exchanges with live peers completed may be a step ahead). Each survivor prints one JSON line: its steps completed,
the final size, when it saw the failure and how long revoke + shrink took, and the error
classes met. The runner (``ulfm_probe.sh``) runs it under several settings and records
which finished.
"""

import argparse
import json
import os
import signal
import sys
import time

import mpi4py
import numpy as np

if "--no-finalize" in sys.argv:  # survivors end without MPI_Finalize (it hangs after a failure, over TCP)
    mpi4py.rc.finalize = False
from mpi4py import MPI  # noqa: E402

FAILURES = {getattr(MPI, n) for n in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
            if hasattr(MPI, n)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--victim", type=int, default=-1, help="default: the last rank")
    p.add_argument("--die", type=int, default=5)
    p.add_argument("--how", choices=("kill", "stop"), default="kill",
                   help="the victim SIGKILLs itself (dead), or SIGSTOPs itself (hung: only ULFM's heartbeat "
                        "detector, --mca mpi_ft_detector true, can report it)")
    p.add_argument("--mb", type=float, default=1.0)
    p.add_argument("--pattern", choices=("ring", "pairs"), default="ring")
    p.add_argument("--step-ms", type=float, default=0.0, help="sleep per step (compute), to give a cut link time")
    p.add_argument("--free-old", action="store_true", help="MPI_Comm_free the revoked communicator")
    p.add_argument("--persistent", action="store_true",
                   help="persistent requests (Recv_init/Send_init + Startall): a completion in error does not "
                        "deallocate them, and they are never freed after a failure")
    p.add_argument("--no-finalize", action="store_true",
                   help="end without MPI_Finalize (survivors of a failure hang in it over TCP)")
    p.add_argument("--order", choices=("all", "recvs-first"), default="all",
                   help="one Waitall of every request, or the receives first and the sends only if they succeeded")
    p.add_argument("--requests", choices=("free", "cancel-recvs", "keep"), default="keep",
                   help="what to do with the failed step's requests: cancel and free all, cancel the "
                        "receives only, or leave them to MPI")
    a = p.parse_args()
    world = MPI.COMM_WORLD
    for c in (MPI.COMM_SELF, world):  # errors of no communicator go to COMM_SELF's handler (MPI 4)
        c.Set_errhandler(MPI.ERRORS_RETURN)
    victim = a.victim if a.victim >= 0 else world.Get_size() - 1
    comm = world.Dup()
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    n = max(1, int(a.mb * (1 << 20) // 8))
    send, recv = np.full(n, float(world.Get_rank())), np.zeros((2, n))
    record = {"rank": world.Get_rank(), "errors": [], "recoveries": []}
    t0 = time.monotonic()
    step = 0
    while step < a.steps:
        if world.Get_rank() == victim and step == a.die:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL if a.how == "kill" else signal.SIGSTOP)
        rank, size = comm.Get_rank(), comm.Get_size()
        if a.step_ms:
            time.sleep(a.step_ms / 1000)
        if a.pattern == "ring":
            peers = [(rank - 1) % size, (rank + 1) % size]
        else:
            peers = [rank ^ 1] if (rank ^ 1) < size else []
        reqs = []
        try:
            if a.persistent:
                reqs = [comm.Recv_init(recv[i], source=src, tag=step % 32000) for i, src in enumerate(peers)]
                reqs += [comm.Send_init(send, dest=dst, tag=step % 32000) for dst in peers]
                MPI.Prequest.Startall(reqs)
            else:
                reqs = [comm.Irecv(recv[i], source=src, tag=step % 32000) for i, src in enumerate(peers)]
                reqs += [comm.Isend(send, dest=dst, tag=step % 32000) for dst in peers]
            statuses = [MPI.Status() for _ in reqs]
            if a.order == "all":
                MPI.Request.Waitall(reqs, statuses)
            else:
                k = len(peers)
                MPI.Request.Waitall(reqs[:k], statuses[:k])
                MPI.Request.Waitall(reqs[k:], statuses[k:])
            if a.persistent:
                for r in reqs:
                    r.Free()
            step += 1
            continue
        except MPI.Exception as exc:
            cls = exc.Get_error_class()
            if cls == MPI.ERR_IN_STATUS:  # the first failed request's own class
                cls = next((MPI.Get_error_class(st.Get_error()) for st in statuses
                            if st.Get_error() not in (MPI.SUCCESS, MPI.ERR_PENDING)), cls)
            record["errors"].append({"step": step, "class": cls, "t": round(time.monotonic() - t0, 3)})
            if cls not in FAILURES:
                raise
        t1 = time.monotonic()
        npeers = len(reqs) // 2
        for i, r in enumerate(reqs):  # the failed step's requests: completed in error, or still pending
            if r == MPI.REQUEST_NULL or a.requests == "keep" or a.persistent or (a.requests == "cancel-recvs" and i >= npeers):
                continue
            try:
                r.Cancel()
                r.Free()
            except MPI.Exception:
                pass
        comm.Revoke()
        new = comm.Shrink()
        ok = new.Agree(1)
        if a.free_old:
            comm.Free()
        comm = new
        comm.Set_errhandler(MPI.ERRORS_RETURN)
        failed_at, step = step, comm.allreduce(step, op=MPI.MIN)  # a rank may have finished the step
        record["recoveries"].append({"step": failed_at, "resumed": step, "size": comm.Get_size(), "agreed": int(ok),
                                     "seconds": round(time.monotonic() - t1, 3)})
        print(f"rank {world.Get_rank()}: recovered at t={time.monotonic() - t0:.2f} s: {record['recoveries'][-1]}",
              flush=True)
    record.update(steps=step, size=comm.Get_size(), seconds=round(time.monotonic() - t0, 3))
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
