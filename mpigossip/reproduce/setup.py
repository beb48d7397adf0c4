"""What a report states about where it was made: commit, library versions, machine, cluster."""

import os
import platform

from ..core.provenance import commit, versions  # noqa: F401  (re-exported: reports and benchmarks use them here)


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
