"""Progress of one-sided (RMA) methods across nodes: Open MPI's TCP progress thread, chosen.

Over Open MPI's TCP transport a passive target's gets, locks and accumulates progress only
while the target rank is inside MPI, so a computing rank stalls every exchange aimed at it;
the transport's progress thread serves them meanwhile (docs/RESULTS.md, P4), at the cost of a
core that CPU-bound ranks without cores of their own miss. The thread is read once, in
``MPI_Init``, from ``OMPI_MCA_btl_tcp_progress_thread``, so the choice is made before MPI
starts, from what the launcher tells each process:

* the variable already set (by you, a job script, ``launch --progress-thread on|off``): kept;
* no one-sided method in the run, or every rank on one node (shared memory): left off;
* ranks on this node at most the cores it has (``$MPIGOSSIP_CORES_PER_NODE``, else Slurm's
  ``SLURM_CPUS_ON_NODE``, else the machine's count): on;
* else, or when the launcher says nothing of ranks per node: left off.

:func:`decide` is pure (an environment in, a :class:`Decision` out); :func:`apply` sets the
variable in this process before ``mpi4py.MPI`` is imported. The one-sided communicators warn
once when they run across nodes with the thread off (:mod:`mpigossip.onesided.rma`). Plain Python, no
MPI: the command line calls it before MPI is loaded.
"""

import dataclasses
import os
import re

from ..core import registry

#: Open MPI's setting, read in ``MPI_Init``.
VARIABLE = "OMPI_MCA_btl_tcp_progress_thread"
#: The cores each node gives this job, when neither Slurm nor the machine's count says it right
#: (nodes that share a machine, as the emulated cluster's; a container's CPU quota).
CORES_VARIABLE = "MPIGOSSIP_CORES_PER_NODE"
#: The methods whose exchanges are one-sided (a passive target in an RMA window).
ONE_SIDED = registry.ONE_SIDED
_ON = ("1", "true", "yes", "on", "enabled")


@dataclasses.dataclass(frozen=True)
class Decision:
    """Whether the thread runs (``on``), whether this decision set it (``changed``) and why."""
    on: bool
    changed: bool
    reason: str

    def describe(self):
        state = "on" if self.on else "off"
        return f"one-sided progress: Open MPI's TCP progress thread {state} ({self.reason})"


def is_set(environ=None):
    """Whether ``environ`` (default: this process's) already chose the progress thread, on or off."""
    environ = os.environ if environ is None else environ
    return bool(environ.get(VARIABLE, "").strip())


def is_on(environ=None):
    """Whether ``environ`` (default: this process's) turns the progress thread on."""
    environ = os.environ if environ is None else environ
    return environ.get(VARIABLE, "").strip().lower() in _ON


def expand_counts(text):
    """Slurm's compact per-node counts (``"2(x3),1"``) as a list (``[2, 2, 2, 1]``); [] if unreadable."""
    counts = []
    for part in filter(None, text.split(",")):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            return []
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def placement(environ):
    """``(ranks on this node, ranks in the job)`` from the launcher's variables (Open MPI's
    ``mpirun``, MPICH's Hydra, ``srun``); ``(None, None)`` where none says it."""
    def number(name):
        value = environ.get(name, "").strip()
        return int(value) if value.isdigit() else None
    for local, world in (("OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_SIZE"), ("MPI_LOCALNRANKS", "PMI_SIZE")):
        if number(local) and number(world):
            return number(local), number(world)
    counts = expand_counts(environ.get("SLURM_STEP_TASKS_PER_NODE", ""))
    node = number("SLURM_NODEID")
    if counts and node is not None and node < len(counts):
        return counts[node], sum(counts)
    return None, None


def cores_on_node(environ):
    """The cores this node gives the job: ``$MPIGOSSIP_CORES_PER_NODE``, else
    ``SLURM_CPUS_ON_NODE``, else the machine's count."""
    for name in (CORES_VARIABLE, "SLURM_CPUS_ON_NODE"):
        value = environ.get(name, "").strip()
        if value:
            if not value.isdigit():
                raise ValueError(f"{name}={value!r} is not a whole number of cores")
            return int(value)
    return os.cpu_count() or 1


def decide(algorithms, environ):
    """The progress thread for a run of ``algorithms`` in the process environment ``environ``."""
    if is_set(environ):
        return Decision(is_on(environ), False, f"{VARIABLE}={environ[VARIABLE]} as set")
    one_sided = [a for a in algorithms if a in ONE_SIDED]
    if not one_sided:
        return Decision(False, False, "no one-sided method in this run")
    local, world = placement(environ)
    if local is None:
        return Decision(False, False, "the launcher does not say how many ranks share a node")
    if world <= local:
        return Decision(False, False, "every rank on one node: shared memory")
    cores = cores_on_node(environ)
    where = f"{local} rank{'s' if local > 1 else ''} on a node of {cores} core{'s' if cores != 1 else ''}"
    if local > cores:
        return Decision(False, False, f"{', '.join(one_sided)} across nodes, but {where}: no core for the thread; "
                                      f"{VARIABLE}=1 forces it")
    return Decision(True, True, f"{', '.join(one_sided)} across nodes, {where}; {VARIABLE}=0 turns it off")


def apply(algorithms, environ=None):
    """:func:`decide`, and set the variable in ``environ`` (default: this process's) when it
    turns the thread on. Call before ``mpi4py.MPI`` is imported. Returns the decision."""
    environ = os.environ if environ is None else environ
    decision = decide(algorithms, environ)
    if decision.changed:
        environ[VARIABLE] = "1"
    return decision
