"""``python -m mpigossip info``: what this MPI job runs on, gathered from every rank."""

import importlib.metadata
import json
import os
import socket
import sys

from mpi4py import MPI

import mpigossip

from ..core import buffers, deadline, nodes
from ..onesided import progress

_THREAD_LEVELS = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
                  MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}


def _version(distribution):
    """Installed version of a distribution, without importing it (torch takes seconds)."""
    for name in (distribution,) if distribution != "cupy" else ("cupy", "cupy-cuda12x", "cupy-cuda13x"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def gpu_count():
    """Number of CUDA devices visible to this process (CuPy, else torch if imported), 0 if none."""
    try:
        import cupy
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        pass
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            return int(torch.cuda.device_count())
        except Exception:
            pass
    return 0


def one_sided_progress():
    """How a passive target's one-sided operations progress across nodes, from this process's
    settings: Open MPI's TCP progress thread on or off, or unknown for another MPI."""
    if "Open MPI" not in MPI.Get_library_version():
        return "unknown (not Open MPI: see the README's notes on one-sided progress)"
    if progress.is_on():
        return "on (Open MPI TCP progress thread)"
    return "off: across nodes over TCP a computing rank stalls one-sided exchanges aimed at it " \
           "(OMPI_MCA_btl_tcp_progress_thread=1 turns Open MPI's progress thread on)"


def placement(comm):
    """Where this rank runs (collective: the node split): host, local rank, the GPU it would use
    (local rank modulo the GPUs it sees), what the launcher set for GPUs and threads."""
    ngpu = gpu_count()
    lrank, lsize = nodes.local_rank(comm)
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count()
    return {
        "rank": comm.Get_rank(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "local_rank": lrank,
        "local_size": lsize,
        "gpus_visible": ngpu,
        "gpu": (lrank % ngpu) if ngpu else None,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "cpus": cpus,
    }


def collect(comm=None, *, timeout=60.0):
    """Collective: a dict with job-wide facts and one entry per rank (every rank gets it)."""
    comm = MPI.COMM_WORLD if comm is None else comm
    aware, source = buffers.cuda_aware()
    ranks = deadline.allgather(comm, placement(comm), timeout=timeout, op="info")
    import mpi4py
    import numpy
    return {
        "mpigossip": mpigossip.__version__,
        "python": sys.version.split()[0],
        "mpi4py": mpi4py.__version__,
        "mpi_library": MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0],
        "mpi_standard": "%d.%d" % MPI.Get_version(),
        "thread_level": _THREAD_LEVELS.get(MPI.Query_thread(), str(MPI.Query_thread())),
        "one_sided_progress": one_sided_progress(),
        "cuda_aware_mpi": aware,
        "cuda_aware_source": source,
        "numpy": numpy.__version__,
        "cupy": _version("cupy"),
        "torch": _version("torch"),
        "world_size": comm.Get_size(),
        "ranks": ranks,
    }


def format_text(info):
    lines = [f"mpigossip {info['mpigossip']} (Python {info['python']}, numpy {info['numpy']}, "
             f"cupy {info['cupy'] or 'not installed'}, torch {info['torch'] or 'not installed'})",
             f"mpi4py {info['mpi4py']}, MPI {info['mpi_standard']}: {info['mpi_library']}",
             f"thread level: {info['thread_level']}; CUDA-aware MPI: "
             f"{'yes' if info['cuda_aware_mpi'] else 'no'} (from {info['cuda_aware_source']})",
             f"one-sided progress across nodes: {info['one_sided_progress']}",
             f"world size: {info['world_size']}",
             f"{'rank':>5} {'host':<20} {'local':>5} {'gpus':>5} {'gpu':>4} {'CUDA_VISIBLE_DEVICES':>20} "
             f"{'OMP_NUM_THREADS':>15} {'cpus':>4}"]
    for r in info["ranks"]:
        gpu = "-" if r["gpu"] is None else str(r["gpu"])
        lines.append(f"{r['rank']:>5} {r['host']:<20} {r['local_rank']:>5} {r['gpus_visible']:>5} {gpu:>4} "
                     f"{r['cuda_visible_devices'] or '-':>20} {r['omp_num_threads'] or '-':>15} {r['cpus']:>4}")
    return "\n".join(lines)


def main(args):
    info = collect(MPI.COMM_WORLD)
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(json.dumps(info, indent=2) if args.json else format_text(info), flush=True)
    return 0
