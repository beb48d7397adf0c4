"""``python -m mpigossip launch``: start a batch job's ranks inside its Slurm allocation.

The job scripts in ``jobs/`` run their ranks through it::

    python -m mpigossip launch [--launcher srun|mpirun] [--retries 1] -- python -m mpigossip train ...

``srun`` (the default) is ``srun --mpi=pmix --kill-on-bad-exit=1``. Open MPI 5.0.x crashes
inside ``MPI_Init`` in a few per cent of such launches across nodes (a race between a rank's
first message and a peer still in ``MPI_Init``'s PMIx fence, open-mpi/ompi#12495): a launch
whose stderr holds Open MPI's crash backtrace through ``ompi_mpi_init`` is named as that and
made again, up to ``--retries`` times (nothing had run yet, so nothing is lost). Any other
failure is the job's and returns its status. ``mpirun`` is the MPI's own launcher inside the
allocation; Open MPI's starts one daemon per node with srun, and is given the node's GPUs for
them (see :func:`command`). SIGUSR1 and SIGTERM are forwarded to the launcher, which passes
them to every rank (the training job checkpoints on them).

This module starts no MPI and imports nothing heavy: it runs in the batch script's shell.
"""

import os
import re
import signal
import subprocess
import sys

from ..onesided import progress
from .launcher import FAULT_TOLERANT_DEFAULTS, ROOT_DEFAULTS, find_beside_python

LAUNCHERS = ("srun", "mpirun")
#: The nodes kept for newcomers (``--spares``), comma-separated, as the ranks see them.
SPARES = "MPIGOSSIP_SPARE_HOSTS"

#: A frame of Open MPI's crash backtrace inside MPI_Init (``[host:pid] [ 7] .../libmpi.so.40(ompi_mpi_init+0x..)``).
_INIT_FRAME = re.compile(r"\[\s*\d+\]\s.*\((?:ompi_mpi_init|PMPI_Init(?:_thread)?|MPI_Init(?:_thread)?)\+")


#: srun's input variables that narrow a step's GPUs to a task's share (set by sbatch --gpus-per-task).
GPU_STEP_VARIABLES = ("SLURM_GPUS_PER_TASK", "SLURM_GPU_BIND")


class LaunchError(Exception):
    """The launch cannot be built (a bad launcher, no mpirun, outside an allocation)."""


def find_mpirun(environ=None):
    """``$MPIRUN``, else the ``mpirun`` beside the Python, else ``mpirun`` on PATH."""
    environ = os.environ if environ is None else environ
    if environ.get("MPIRUN"):
        return environ["MPIRUN"]
    found = find_beside_python("mpirun", path=environ.get("PATH"))
    if not found:
        raise LaunchError("no mpirun: set MPIRUN, load the MPI module, or use --launcher srun")
    return found


def even_tasks(environ):
    """Whether the allocation has as many tasks on every node (``SLURM_TASKS_PER_NODE`` is one count)."""
    return len(set(progress.expand_counts(environ.get("SLURM_TASKS_PER_NODE", "")))) <= 1


def command(launcher, program, environ=None, *, progress_thread="auto", fault_tolerant=False, spares=0,
            hostnames=None):
    """``(argv, env)`` that start ``program`` on every task of the allocation. ``progress_thread``
    ``"on"`` or ``"off"`` sets Open MPI's TCP progress thread (one-sided methods across nodes,
    :mod:`mpigossip.onesided.progress`) unless the environment already chose; ``"auto"`` leaves it to
    ``train``/``compare`` on each node. ``fault_tolerant``: Open MPI's ULFM on (``mpirun
    --with-ft ulfm``, without the ``han`` collectives: :data:`~mpigossip.launch.launcher.FAULT_TOLERANT_DEFAULTS`), for
    ``--on-failure continue``; Open MPI does not support it under a direct ``srun`` launch.
    ``spares``: the allocation's last ``spares`` nodes start no rank and are named to the ranks in
    :data:`SPARES` (``train --on-failure replace`` starts its newcomers there first); needs
    ``fault_tolerant``. ``hostnames``: the allocation's node names in order (default: ``scontrol
    show hostnames``)."""
    environ = dict(os.environ if environ is None else environ)
    if not program:
        raise LaunchError("no command to launch: python -m mpigossip launch [...] -- COMMAND ...")
    if progress_thread not in ("auto", "on", "off"):
        raise LaunchError(f"progress_thread must be auto, on or off, got {progress_thread!r}")
    if progress_thread != "auto":
        environ.setdefault(progress.VARIABLE, "1" if progress_thread == "on" else "0")
    if fault_tolerant and launcher == "srun":
        raise LaunchError("--fault-tolerant: Open MPI's fault tolerance (ULFM) is not supported under a direct srun "
                          "launch: use --launcher mpirun (it runs inside the allocation)")
    if spares and not (fault_tolerant and launcher == "mpirun"):
        raise LaunchError("--spares: nodes kept for the newcomers of train --on-failure replace need --launcher "
                          "mpirun --fault-tolerant")
    if launcher == "srun":
        return ["srun", "--mpi=pmix", "--kill-on-bad-exit=1"] + list(program), environ
    if not environ.get("SLURM_NTASKS"):
        raise LaunchError("not inside a Slurm allocation (no SLURM_NTASKS): run it from a batch script")
    if hasattr(os, "geteuid") and os.geteuid() == 0:   # containers run jobs as root
        for key, value in ROOT_DEFAULTS.items():
            environ.setdefault(key, value)
    # mpirun starts one daemon per node with srun, which reads these variables as if they were its
    # own options: with --gpus-per-task=1 each daemon, and so every rank on its node, would see
    # one GPU. Asking for the node's GPUs per node instead gives each daemon all of them, and each
    # rank takes GPU (local rank modulo GPUs seen), as srun's per-task binding would have.
    if any(environ.get(name) for name in GPU_STEP_VARIABLES):
        for name in GPU_STEP_VARIABLES:
            environ.pop(name, None)
        if "SLURM_GPUS_ON_NODE" in environ:
            if not even_tasks(environ):
                raise LaunchError(f"mpirun with GPUs per task needs the same tasks on every node (have "
                                  f"{environ.get('SLURM_TASKS_PER_NODE')}): use --ntasks-per-node, or --launcher srun")
            environ["SLURM_GPUS_PER_NODE"] = environ["SLURM_GPUS_ON_NODE"]
    # Binding is left to Slurm's allocation; mpirun reads the node list itself.
    argv = [find_mpirun(environ), "--bind-to", "none", "-n", environ["SLURM_NTASKS"]]
    if spares:
        argv = argv[:-1] + [str(_keep_spares(environ, spares, hostnames))]
        # mpirun's slot mapping fills the nodes in the allocation's order: the last ones stay empty.
        argv += ["--map-by", "slot", "-x", SPARES]
    if fault_tolerant:
        argv += ["--with-ft", "ulfm"]
        for key, value in FAULT_TOLERANT_DEFAULTS.items():
            environ.setdefault(key, value)
    return argv + list(program), environ


def _keep_spares(environ, spares, hostnames=None):
    """The ranks to start when the allocation's last ``spares`` nodes start none; sets
    ``environ[SPARES]`` to their names."""
    if not isinstance(spares, int) or spares < 0:
        raise LaunchError(f"--spares must be a whole number >= 0, got {spares!r}")
    counts = progress.expand_counts(environ.get("SLURM_TASKS_PER_NODE", ""))
    if hostnames is None:
        nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST", "")
        try:
            hostnames = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                                       timeout=60, check=True).stdout.split()
        except (OSError, subprocess.SubprocessError) as exc:
            raise LaunchError(f"--spares: cannot list the allocation's nodes (scontrol show hostnames): {exc}")
    if not counts or len(counts) != len(hostnames):
        raise LaunchError(f"--spares: cannot tell the tasks of each node (SLURM_TASKS_PER_NODE="
                          f"{environ.get('SLURM_TASKS_PER_NODE')!r}, nodes {hostnames})")
    if spares >= len(hostnames):
        raise LaunchError(f"--spares {spares}: the allocation has {len(hostnames)} node(s); at least one must "
                          "start ranks (sbatch --nodes=more)")
    environ[SPARES] = ",".join(hostnames[-spares:])
    return sum(counts[:-spares])


def crashed_in_init(text):
    """Whether ``text`` (the launch's stderr) holds an Open MPI crash backtrace through ``MPI_Init``."""
    return "*** Process received signal ***" in text and any(_INIT_FRAME.search(line) for line in text.splitlines())


class Step:
    """One launch: the launcher as a child process whose stderr is passed through and kept."""

    def __init__(self, argv, env):
        self.proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE)
        self.lines = []

    def signal(self, signum):
        if self.proc.poll() is None:
            self.proc.send_signal(signum)

    def wait(self):
        """Pass stderr through until the launcher ends; its exit status (signal ``s`` as ``128 + s``).
        A forwarded signal interrupts the read only for its handler: the read then goes on."""
        out = sys.stderr.buffer
        for line in self.proc.stderr:
            out.write(line)
            out.flush()
            self.lines.append(line.decode(errors="replace"))
        rc = self.proc.wait()
        return 128 - rc if rc < 0 else rc


def launch(launcher, program, *, retries=1, environ=None, say=None, progress_thread="auto", fault_tolerant=False,
           spares=0):
    """Run ``program`` on the allocation's tasks; returns the exit status. See the module docstring."""
    say = say or (lambda text: print(f"mpigossip launch: {text}", file=sys.stderr, flush=True))
    if launcher not in LAUNCHERS:
        raise LaunchError(f"--launcher must be one of {', '.join(LAUNCHERS)}, got {launcher!r}")
    argv, env = command(launcher, program, os.environ if environ is None else environ,
                        progress_thread=progress_thread, fault_tolerant=fault_tolerant, spares=spares)
    if spares:
        say(f"nodes kept for newcomers: {env[SPARES]}")
    current = None

    def forward(signum, frame):
        if current is not None:
            current.signal(signum)
    old = {s: signal.signal(s, forward) for s in (signal.SIGUSR1, signal.SIGTERM)}
    try:
        for attempt in range(retries + 1):
            if attempt == 0:
                say(f"{' '.join(argv[:len(argv) - len(program)])} ...")
            current = Step(argv, env)
            rc = current.wait()
            if rc == 0 or launcher != "srun" or not crashed_in_init("".join(current.lines)):
                return rc
            if attempt < retries:
                say(f"a rank crashed inside MPI_Init (exit {rc}): the Open MPI 5.0.x race of srun --mpi=pmix "
                    f"launches (open-mpi/ompi#12495); nothing ran yet, launching again ({attempt + 1} of {retries})")
            else:
                say(f"a rank crashed inside MPI_Init (exit {rc}) in all {retries + 1} launches: the Open MPI "
                    "5.0.x race of srun --mpi=pmix launches (open-mpi/ompi#12495); try --launcher mpirun")
        return rc
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def main(args):
    try:
        return launch(args.launcher, args.program, retries=args.retries, progress_thread=args.progress_thread,
                      fault_tolerant=args.fault_tolerant, spares=args.spares)
    except LaunchError as exc:
        print(f"python -m mpigossip launch: error: {exc}", file=sys.stderr, flush=True)
        return 2
