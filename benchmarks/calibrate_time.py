"""Calibrate the time model (:mod:`mpigossip.sim.timing`): the few costs it needs, measured.

    tests/cluster/mpiexec -n 8 --map-by slot python benchmarks/calibrate_time.py [--out FILE.json]
        [--mb 16] [--repeats 7] [--cores N --cores-shared]

Ranks on at least two nodes, as many on each (the emulated cluster: ``bash
tests/cluster/start.sh 4 1gbit 2``; for the P4 rows with Open MPI's TCP progress thread on, as
they ran: ``OMPI_MCA_btl_tcp_progress_thread=1``). Rank 0 and the first rank on another node:

* ``link_rate``: rank 0 sends ``--mb`` MB to rank 1 (a 1-byte reply closes the clock), minus
  the latency; ``latency``: half a round trip of 8 bytes;
* ``rma_rate``: a one-sided read of the same bytes from rank 1's window, in the package's
  pieces (:mod:`mpigossip.onesided.rma`), under a shared lock, as a fraction of ``link_rate``;
  ``rma_lock``: an exclusive lock and unlock on rank 1's window with nothing moved;
  ``gets_shared``: whether the two reading each other's window at once take more than 1.5x one
  read (Open MPI 5's TCP transport: twice; a rank's gets, served and its own, share a link's rate);
* ``wire_cpu``: every rank sends ``--mb`` MB to its counterpart on the next node at once; where
  that takes longer than the links allow and the nodes share the cores, the cores held it: CPU
  seconds per byte on each side (0 otherwise);
* on rank 0 alone (the others wait): ``pass_rate``, a fused kernel pass (``weighted_sum`` of one
  received buffer into x) over ``--mb`` MB; ``shm_rate``, half a copy's rate (shared memory
  copies in and out); ``message_cpu``, an 8-byte ``Isend``/``Irecv`` to itself; ``step_cpu0``
  and ``step_cpu``, the CPU seconds (all threads: torch's own count) of the P4 benchmark's
  forward, backward and optimizer step (one square ``nn.Linear``, batch 8) at 1 and ``--mb`` MB,
  fitted as ``a + b * MB``;
* ``method_cpu``: on the ranks of rank 0's node, through shared memory, the CPU seconds (all
  threads) of a whole P4 step of each method's torch wrapper (forward, backward, optimizer, the
  method's step; no sleep) at 1 and ``--mb`` MB, fitted as ``[a, b]``: the package's own work
  per step (its copies, passes, Python and MPI calls), which the model charges instead of its
  structural passes and ``step_cpu``.

Medians of ``--repeats``. ``cores``/``cores_shared`` describe where the ranks run (default:
this machine's cores, shared when ``MPIGOSSIP_CORES_PER_NODE=0``, which tests/cluster/mpiexec
exports). Writes ``{"meta": ..., "costs": ..., "raw": ...}``: what ``Costs.load`` reads.
"""

import argparse
import json
import os
import sys
import time

import numpy as np
from mpi4py import MPI

from mpigossip.core import kernels, provenance
from mpigossip.onesided import rma


def _quiet_barrier(comm):
    """A barrier whose waiting ranks sleep between polls: ranks not in a measurement must not
    take the cores from the ones measured (MPI's own barrier spins)."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.001)


def _median(fn, repeats):
    out = []
    for _ in range(repeats):
        out.append(fn())
    return float(np.median(out))


def _network(comm, nbytes, repeats, peer):
    """(latency, one-way send, one-sided read, lock) seconds between rank 0 and ``peer``."""
    rank = comm.Get_rank()
    data, ack = np.ones(nbytes, np.uint8), np.zeros(1, np.uint8)
    small = np.zeros(8, np.uint8)

    def ping():
        _quiet_barrier(comm)
        t0 = time.perf_counter()
        for _ in range(20):
            if rank == 0:
                comm.Send(small, dest=peer)
                comm.Recv(small, source=peer)
            elif rank == peer:
                comm.Recv(small, source=0)
                comm.Send(small, dest=0)
        return (time.perf_counter() - t0) / 40

    def one_way():
        _quiet_barrier(comm)
        t0 = time.perf_counter()
        if rank == 0:
            comm.Send(data, dest=peer)
            comm.Recv(ack, source=peer)
        elif rank == peer:
            comm.Recv(data, source=0)
            comm.Send(ack, dest=0)
        return time.perf_counter() - t0

    latency = _median(ping, repeats)
    send_s = _median(one_way, repeats)
    win = rma.allocate(comm, nbytes if rank in (0, peer) else 0, 1, what="calibrate_time")
    out = np.empty(nbytes, np.uint8)

    def read():
        _quiet_barrier(comm)
        t0 = time.perf_counter()
        if rank == 0:
            win.Lock(peer, MPI.LOCK_SHARED)
            MPI.Request.Waitall(rma.rget(win, out, MPI.BYTE, peer))
            win.Unlock(peer)
        return time.perf_counter() - t0

    def both():   # rank 0 and the peer read each other's window at once
        _quiet_barrier(comm)
        t0 = time.perf_counter()
        if rank in (0, peer):
            target = peer if rank == 0 else 0
            win.Lock(target, MPI.LOCK_SHARED)
            MPI.Request.Waitall(rma.rget(win, out, MPI.BYTE, target))
            win.Unlock(target)
        return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)

    def lock():
        _quiet_barrier(comm)
        t0 = time.perf_counter()
        if rank == 0:
            win.Lock(peer, MPI.LOCK_EXCLUSIVE)
            win.Unlock(peer)
        return time.perf_counter() - t0

    read_s = _median(read, repeats)
    both_s = _median(both, repeats)
    lock_s = _median(lock, repeats)
    _quiet_barrier(comm)
    win.Free()
    return latency, send_s, read_s, both_s, lock_s


def _all_exchange(comm, nbytes, repeats, hosts):
    """Every rank sends ``nbytes`` to the rank of the same local index on the next node and
    receives from the previous one, all at once: (seconds, the slowest rank's; ranks per node)."""
    nodes = sorted(set(hosts), key=hosts.index)
    mine = [r for r, h in enumerate(hosts) if h == hosts[comm.Get_rank()]]
    local = mine.index(comm.Get_rank())
    per_node = [[r for r, h in enumerate(hosts) if h == n] for n in nodes]
    if len({len(p) for p in per_node}) != 1:
        return None, len(mine)
    node = nodes.index(hosts[comm.Get_rank()])
    dst = per_node[(node + 1) % len(nodes)][local]
    src = per_node[(node - 1) % len(nodes)][local]
    data, got = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)

    def once():
        _quiet_barrier(comm)
        t0 = time.perf_counter()
        MPI.Request.Waitall([comm.Irecv(got, source=src), comm.Isend(data, dest=dst)])
        return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    return _median(once, repeats), len(mine)


def _cpu(nbytes, mb, repeats):
    # Four buffers of each kind in turn: a step's buffers are not in the cache when it combines them.
    xs = [np.ones(nbytes // 4, np.float32) for _ in range(4)]
    rs = [np.ones_like(xs[0]) for _ in range(4)]
    turn = iter(range(10 ** 9))

    def one_pass():
        i = next(turn) % 4
        kernels.weighted_sum(xs[i], xs[i], 0.5, [rs[i]], [0.5], keep_recvs=True)

    def one_copy():
        i = next(turn) % 4
        np.copyto(rs[i], xs[i])
    pass_s = _median(lambda: _timed(one_pass), repeats)
    copy_s = _median(lambda: _timed(one_copy), repeats)
    comm = MPI.COMM_SELF
    small, got = np.zeros(1), np.zeros(1)
    message_s = _median(lambda: _timed(lambda: MPI.Request.Waitall([comm.Irecv(got, 0), comm.Isend(small, 0)])),
                        repeats * 10)
    steps = {}
    for size in sorted({1.0, float(mb)}):
        step, _ = _p4_step(size)
        step()
        steps[size] = _median(lambda: _cpu_timed(step), repeats)
    step_cpu0, step_cpu = _fit(steps)
    return {"pass_s": pass_s, "copy_s": copy_s, "message_s": message_s, "steps": steps,
            "step_cpu": step_cpu, "step_cpu0": step_cpu0}


def _p4_step(size, method=None, comm=None):
    """(one step of the P4 benchmark's trainer at ``size`` MB, its wrapper or None): one square
    ``nn.Linear`` without bias, batch 8, forward, backward, SGD, and ``method``'s step."""
    import torch
    k = max(2, int((size * 2 ** 20 / 4) ** 0.5))
    torch.manual_seed(0)
    model = torch.nn.Linear(k, k, bias=False)
    algo = None
    if method is not None:
        import mpigossip.torch as mgt
        algo = mgt.make(method, model, comm=comm)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    batch = torch.randn(8, k)

    def step():
        loss = model(batch).square().mean()
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        if algo is not None:
            algo.step()
    return step, algo


#: The methods whose step's CPU is measured (the P4 benchmark's wrappers).
METHODS = ("allreduce", "sgp", "osgp", "agp", "gossip-pull", "easgd", "adpsgd")


def _method_cpu(local, sizes, steps):
    """{method: {MB: CPU seconds of one whole P4 step (forward, backward, optimizer and the
    method's step; no sleep), median over ``steps``}} on the ranks of one node (``local``), which
    move their messages through shared memory: the package's own work per step, without the
    network's."""
    out = {}
    for name in METHODS:
        out[name] = {}
        for size in sizes:
            step, algo = _p4_step(size, name, local)
            for _ in range(2):
                step()
            _quiet_barrier(local)
            out[name][size] = _median(lambda: _cpu_timed(step), steps)
            algo.drain()
            algo.free()
            _quiet_barrier(local)
    return out


def _timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _fit(per_size):
    """``[fixed, per MB]`` of a line through {MB: seconds} at its smallest and largest size."""
    (a, sa), (b, sb) = sorted(per_size.items())[0], sorted(per_size.items())[-1]
    per_mb = (sb - sa) / (b - a) if b > a else sb / b
    return [max(0.0, sa - per_mb * a), max(0.0, per_mb)]


def _cpu_timed(fn):
    """CPU seconds of ``fn`` over all of this process's threads (torch's intra-op threads count:
    the model's cores are shared by every rank's)."""
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=16.0)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--cores", type=int, default=os.cpu_count())
    parser.add_argument("--cores-shared", action="store_true",
                        default=os.environ.get("MPIGOSSIP_CORES_PER_NODE") == "0", help="the nodes share the cores (default: when MPIGOSSIP_CORES_PER_NODE=0)")
    parser.add_argument("--out")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    hosts = comm.allgather(MPI.Get_processor_name())
    others = [r for r, h in enumerate(hosts) if h != hosts[0]]
    if not others:
        sys.exit("calibrate_time.py: every rank is on one node: run it across nodes")
    nbytes = int(args.mb * 2 ** 20)
    latency, send_s, read_s, both_s, lock_s = _network(comm, nbytes, args.repeats, others[0])
    exchange_s, per_node = _all_exchange(comm, nbytes, args.repeats, hosts)
    cpu = _cpu(nbytes, args.mb, args.repeats) if comm.Get_rank() == 0 else None
    _quiet_barrier(comm)
    local = comm.Split(0 if hosts[comm.Get_rank()] == hosts[0] else MPI.UNDEFINED, comm.Get_rank())
    methods = None
    if local != MPI.COMM_NULL:
        if local.Get_size() > 1:
            methods = _method_cpu(local, sorted({1.0, args.mb}), args.repeats)
        local.Free()
    _quiet_barrier(comm)
    if comm.Get_rank() != 0:
        return
    link_rate = nbytes / max(1e-9, send_s - 2 * latency)
    # The exchange puts per_node messages through every node's link each way: beyond that
    # link time, the machine's cores were what held it (the TCP stack's work on both sides).
    link_s = per_node * nbytes / link_rate
    wire_cpu = 0.0
    if exchange_s is not None and exchange_s > 1.05 * link_s and args.cores_shared:
        wire_cpu = args.cores * exchange_s / (2 * comm.Get_size() * nbytes)
    costs = {
        "link_rate": link_rate,
        "latency": latency,
        "rma_rate": min(1.0, nbytes / max(1e-9, read_s - 2 * latency) / link_rate),
        "rma_lock": lock_s,
        "gets_shared": both_s > 1.5 * read_s,
        "shm_rate": nbytes / cpu["copy_s"] / 2,
        "pass_rate": nbytes / cpu["pass_s"],
        "message_cpu": cpu["message_s"] / 2,
        "wire_cpu": wire_cpu,
        "step_cpu": cpu["step_cpu"],
        "step_cpu0": cpu["step_cpu0"],
        "method_cpu": {m: _fit(per) for m, per in methods.items()} if methods else {},
        "cores": args.cores,
        "cores_shared": bool(args.cores_shared),
    }
    meta = {"commit": provenance.commit(), "versions": provenance.versions(), "command": " ".join(sys.argv),
            "hosts": hosts, "mb": args.mb, "repeats": args.repeats,
            "mpi": MPI.Get_library_version().splitlines()[0].rstrip("\x00"),
            "progress_thread": os.environ.get("OMPI_MCA_btl_tcp_progress_thread", "unset")}
    raw = {"method_cpu_s": {m: {str(k): v for k, v in per.items()} for m, per in (methods or {}).items()},
           "send_s": send_s, "read_s": read_s, "gets_both_ways_s": both_s, "lock_s": lock_s, "exchange_s": exchange_s, "per_node": per_node,
           "exchange_link_s": link_s, **{k: v for k, v in cpu.items() if k != "steps"},
           "step_s": {str(k): v for k, v in cpu["steps"].items()}}
    text = json.dumps({"meta": meta, "costs": costs, "raw": raw}, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
