"""What a spawned process sees on its parent intercommunicator once one of its parents died,
under Open MPI's ULFM: a raw mpi4py reproducer for the newcomer's wait in #45 (``grow.join``).

    mpigossip-mpiexec --with-ft ulfm -n 3 python benchmarks/ulfm_intercomm_probe.py [--seconds 10]

The 3 parents spawn one child. All pass a first barrier over the intercommunicator ("ready");
then the child enters a second ``MPI_Ibarrier`` ("the go", which the parents never enter) and,
for ``--seconds``, tests it and probes for a one-byte note with
``MPI_Iprobe``, from any source and from each parent by rank. Parent 1 SIGKILLs itself; one
second later parents 0 and 2 send the child the note (``MPI_Isend``, completed). The child
prints one JSON line: for each kind of call, how many returned, how many raised and which
error classes, whether a note was ever seen (and from whom), and how the barrier ended. With
Open MPI 5.0.11 (2026-12-07, ``benchmarks/results/ulfm-intercomm-probe.jsonl``): once the
"go" barrier has failed, every probe from any source raises ``MPI_ERR_PROC_FAILED``, while
probes naming a live parent return and find its note. (In the training job, with more traffic,
probes naming live survivors raised too and their notes went unmatched: not reproduced here.)
Every process ends with ``os._exit`` (a survivor's ``MPI_Finalize`` may hang).
"""

import argparse
import json
import os
import signal
import sys
import time

import mpi4py

mpi4py.rc.finalize = False
from mpi4py import MPI  # noqa: E402

TAG = 0x6A02


def parent(seconds):
    world = MPI.COMM_WORLD
    world.Set_errhandler(MPI.ERRORS_RETURN)
    inter = world.Spawn(sys.executable, [os.path.abspath(__file__), "--child", "--seconds", str(seconds)],
                        maxprocs=1, root=0)
    inter.Set_errhandler(MPI.ERRORS_RETURN)
    inter.Ibarrier().Wait()   # the first barrier, which the child enters too ("ready")
    if world.Get_rank() == 1:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(1.5)
    note = bytearray(1)
    request = inter.Isend([note, MPI.BYTE], dest=0, tag=TAG)
    end = time.monotonic() + 5
    done = False
    while not done and time.monotonic() < end:
        try:
            done = request.Test()
        except MPI.Exception as exc:
            print(json.dumps({"parent": world.Get_rank(), "send": exc.Get_error_string()}), flush=True)
            break
        time.sleep(1e-3)
    print(json.dumps({"parent": world.Get_rank(), "note sent": done}), flush=True)
    time.sleep(seconds + 1)   # (the child probes meanwhile; its messages need this process alive)
    os._exit(0)


def child(seconds):
    parent_comm = MPI.Comm.Get_parent()
    parent_comm.Set_errhandler(MPI.ERRORS_RETURN)
    parent_comm.Ibarrier().Wait()   # "ready", with every parent
    barrier = parent_comm.Ibarrier()   # "the go": the parents never enter it
    seen = {}
    found, ended = None, None

    def call(kind, fn):
        entry = seen.setdefault(kind, {"returned": 0, "raised": {}})
        try:
            result = fn()
        except MPI.Exception as exc:
            name = exc.Get_error_string().split(":")[0]
            entry["raised"][name] = entry["raised"].get(name, 0) + 1
            return None
        entry["returned"] += 1
        return result

    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds and found is None:
        if ended is None:
            try:
                if barrier.Test():
                    ended = "completed"
            except MPI.Exception as exc:
                ended = f"{exc.Get_error_string()} after {time.monotonic() - t0:.2f} s"
        if call("probe any source", lambda: parent_comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG)):
            found = f"any source, after {time.monotonic() - t0:.2f} s"
        for source in range(parent_comm.Get_remote_size()):
            if call(f"probe source {source}", lambda s=source: parent_comm.Iprobe(source=s, tag=TAG)):
                found = f"source {source}, after {time.monotonic() - t0:.2f} s"
        time.sleep(1e-3)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from mpigossip.core import provenance
    print(json.dumps({"child": True, "note": found, "barrier": ended, "calls": seen,
                      "commit": provenance.commit(), "versions": provenance.versions()}), flush=True)
    os._exit(0)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=10.0, help="how long the child probes")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    (child if args.child else parent)(args.seconds)


if __name__ == "__main__":
    main()
