"""The flags of ``train`` and ``compare`` and their checks.

Imports neither torch nor MPI, so that a bad flag is answered at once (about a second),
before any rank loads torch or initialises MPI. Checks that need the world size run here
when the launcher tells it (Open MPI, MPICH/PMI, Slurm) and again after ``MPI_Init``.
"""

import math
import os

from .. import topology as topo_mod
from ..core.registry import (
    ALGORITHMS,
    DEFAULT_TOPOLOGY,
    FAULT_TOLERANT,
    HIERARCHICAL,
    INNER_MIXING_FAILURE,
    NOT_YET_FAILURE,
    ONE_SIDED,
    ONE_SIDED_FAILURE,
    OPTION_DEFAULTS,
    OUTER,
    OUTER_BASES,
    PARAMS_WIRE_REFUSED,
    WIRE,
    WIRE_FORMATS,
)

DEFAULTS = {"algorithm": "sgp", "model": "mlp", "dataset": "digits", "lr": 0.1, "momentum": 0.9,
            "batch_size": 32, "steps": 300}


#: Models ``--model`` accepts (built by :mod:`mpigossip.train.models`).
MODEL_NAMES = ("logreg", "mlp", "cnn", "resnet18")


class UsageError(ValueError):
    """A bad flag value, reported on rank 0, exit code 2 on every rank."""


def add_arguments(parser, *, sweep=False):
    """The training flags (shared by ``train`` and ``compare``)."""
    if not sweep:
        parser.add_argument("--algorithm", default=DEFAULTS["algorithm"],
                            help="one of " + ", ".join(ALGORITHMS) + ", or 'all' to run each in turn "
                            "(default: %(default)s)")
        parser.add_argument("--lr", type=float, default=DEFAULTS["lr"], help="learning rate (default: %(default)s)")
    parser.add_argument("--model", default=DEFAULTS["model"], choices=MODEL_NAMES,
                        help="model (default: %(default)s)")
    parser.add_argument("--width", type=int, default=None,
                        help="mlp hidden units (default 128) or cnn channels (default 32): a larger model "
                        "makes communication count")
    parser.add_argument("--dataset", default=DEFAULTS["dataset"],
                        help="digits (bundled with scikit-learn), fashion-mnist (Debian's dataset-fashion-mnist, "
                        "or --data-dir), synthetic, cifar10 (from --data-dir) or a path to a .npz file "
                        "(default: %(default)s)")
    parser.add_argument("--data-dir", help="folder holding CIFAR-10's python batches or Fashion-MNIST's idx files "
                        "(fashion-mnist default: " + "/usr/share/datasets/fashion-mnist)")
    parser.add_argument("--data-seed", type=int, default=0,
                        help="seed of the data: the synthetic problem and the held-out split of digits and .npz "
                        "x, y files; --seed does not change the data (default: %(default)s)")
    parser.add_argument("--samples", type=int, default=None,
                        help="synthetic: number of samples (20000); fashion-mnist: only the first N training images")
    parser.add_argument("--features", type=int, default=64, help="synthetic: input dimension")
    parser.add_argument("--classes", type=int, default=10, help="synthetic: number of classes")
    parser.add_argument("--clusters", type=int, default=1,
                        help="synthetic: Gaussian clusters per class (> 1: not linearly separable) (default: 1)")
    parser.add_argument("--label-noise", type=float, default=0.0,
                        help="synthetic: fraction of training labels replaced at random (default: 0)")
    parser.add_argument("--topology", default=None, choices=topo_mod.NAMES,
                        help="sgp/osgp/agp/dpsgd graph (default: exponential for sgp/osgp/agp, undirected-ring for "
                        "dpsgd, which needs a doubly stochastic one: " + ", ".join(topo_mod.UNDIRECTED) + ")")
    parser.add_argument("--peers", type=int, default=OPTION_DEFAULTS["peers"], help="sgp/osgp/agp out-peers per step (default: %(default)s)")
    parser.add_argument("--hierarchical", action="store_true",
                        help="exact mean inside each node (shared memory), the algorithm between nodes: "
                        + ", ".join(HIERARCHICAL))
    parser.add_argument("--node-size", type=int, default=None,
                        help="with --hierarchical: ranks per node (default: the ranks sharing memory; a "
                        "divisor splits a node, e.g. to try the hierarchy on one machine)")
    parser.add_argument("--momentum", type=float, default=None,
                        help="SGD momentum (default: 0.9; diloco: 0, its momentum is the outer Nesterov step's)")
    parser.add_argument("--nesterov", action="store_true", help="Nesterov momentum")
    parser.add_argument("--weight-decay", type=float, default=0.0, help="L2 weight decay (default: 0)")
    parser.add_argument("--batch-size", type=int, default=DEFAULTS["batch_size"],
                        help="per-rank batch size (default: %(default)s)")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--steps", type=int, help=f"training steps (default: {DEFAULTS['steps']})")
    group.add_argument("--epochs", type=float, help="training epochs: each rank takes EPOCHS x (training "
                       "samples / ranks) samples, the same number of steps on every rank")
    parser.add_argument("--tau", type=int, default=OPTION_DEFAULTS["tau"],
                        help="easgd/gossip communication period (default: %(default)s)")
    parser.add_argument("--beta", type=float, default=OPTION_DEFAULTS["beta"],
                        help="easgd moving rate of the center; each of P workers moves by beta/P (default: %(default)s)")
    parser.add_argument("--servers", type=int, default=OPTION_DEFAULTS["servers"],
                        help="easgd/asgd parameter-server ranks (default: %(default)s)")
    parser.add_argument("--max-delay", type=int, default=OPTION_DEFAULTS["max_delay"],
                        help="osgp bound on message delay in steps (default: %(default)s)")
    parser.add_argument("--base", default=OPTION_DEFAULTS["base"], choices=OUTER_BASES,
                        help="localsgd/slowmo/diloco: the algorithm that averages at an outer step (default: %(default)s)")
    parser.add_argument("--inner-steps", type=int, default=OPTION_DEFAULTS["inner_steps"],
                        help="localsgd/slowmo/diloco: local steps between outer steps (default: %(default)s)")
    parser.add_argument("--outer-lr", type=float, default=None,
                        help="slowmo/diloco outer learning rate (default: slowmo 1.0, diloco 0.7)")
    parser.add_argument("--outer-momentum", type=float, default=None,
                        help="slowmo/diloco outer momentum (default: slowmo 0.5, diloco 0.9 Nesterov)")
    parser.add_argument("--warmup-steps", type=int, default=0,
                        help="localsgd/slowmo/diloco: average every step for the first N steps (post-local SGD) "
                        "(default: 0)")
    parser.add_argument("--inner-mixing", action="store_true",
                        help="localsgd/slowmo/diloco: the base also mixes every step, and an outer step takes the "
                        "exact mean first (SlowMo's setting over sgp) (default: nothing sent between outer steps)")
    parser.add_argument("--wire", default=None, choices=WIRE_FORMATS,
                        help="send the model compressed: bf16, fp16 or int8 with a scale per 512 values; "
                        + ", ".join(WIRE) + " (default: the model's dtype)")
    parser.add_argument("--seed", type=int, default=OPTION_DEFAULTS["seed"], help="seed of the initialisation, the batches and the gossip targets; not of the data (--data-seed) (default: 0)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cpu, or cuda (GPU bound by local rank) (default: cpu)")
    parser.add_argument("--eval-every", type=int, default=0,
                        help="evaluate every N steps (default: about 10 times per run)")
    parser.add_argument("--straggler", action="append", default=[], metavar="RANK:FACTOR",
                        help="that rank's compute takes FACTOR times longer (repeatable)")
    parser.add_argument("--compute-ms", type=float, default=0.0,
                        help="a fixed compute model: every step also sleeps this many ms, times the rank's "
                        "--straggler factor; the same for every algorithm (default: 0, off)")
    parser.add_argument("--delay-prob", type=float, default=0.0, help="probability of a random slowdown per step")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="length of a random slowdown, ms")
    parser.add_argument("--out", help="output folder (config, metrics, summary, checkpoints)")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="checkpoint every N steps into --out")
    parser.add_argument("--resume", metavar="DIR", help="resume from the latest checkpoint in DIR")
    if not sweep:
        parser.add_argument("--overwrite", action="store_true",
                            help="start over in an --out folder that holds another run's checkpoints (deletes them)")
    parser.add_argument("--on-failure", default=OPTION_DEFAULTS["on_failure"], choices=("abort", "continue", "replace"),
                        help="a rank that dies: abort ends the job (then Slurm's requeue resumes it from the last "
                        "checkpoint); continue: the survivors train on (sgp, osgp, agp, dpsgd, gossip-push, allreduce, "
                        "allreduce-params and the outer methods over them; launch with mpiexec --with-ft ulfm or 'launch --fault-tolerant'; "
                        "evaluates at the end only); replace: as continue, and the survivors start a new rank in the "
                        f"dead one's place, which takes its state from a live one ({', '.join(REPLACEABLE)}) "
                        "(default: %(default)s)")
    parser.add_argument("--kill", action="append", default=[], metavar="RANK:STEP",
                        help="fault injection: rank RANK kills itself (SIGKILL) before step STEP (repeatable), to "
                        "try --on-failure")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--timeout", type=float, default=None,
                        help="deadline of every wait in seconds (default: $MPIGOSSIP_TIMEOUT or 300)")


def check_arguments(args, algorithms, lrs, size):
    """Raise :class:`UsageError` for bad values (every rank sees the same arguments).
    ``size`` is the world size, or None if not known yet (its checks are then skipped)."""
    for a in algorithms:
        if a not in ALGORITHMS:
            raise UsageError(f"--algorithm {a!r}: choose from {', '.join(ALGORITHMS)} or all")
    for lr in lrs:
        if not (lr > 0 and math.isfinite(lr)):
            raise UsageError(f"--lr must be > 0, got {lr}")
    positive = {"--batch-size": args.batch_size, "--tau": args.tau, "--servers": args.servers,
                "--peers": args.peers, "--inner-steps": args.inner_steps}
    for flag, value in positive.items():
        if value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    if args.steps is not None and args.steps < 1:
        raise UsageError(f"--steps must be >= 1, got {args.steps}")
    if args.epochs is not None and not args.epochs > 0:
        raise UsageError(f"--epochs must be > 0, got {args.epochs}")
    if args.width is not None and args.width < 1:
        raise UsageError(f"--width must be >= 1, got {args.width}")
    if args.clusters < 1:
        raise UsageError(f"--clusters must be >= 1, got {args.clusters}")
    if not 0 <= args.label_noise < 1:
        raise UsageError(f"--label-noise must be in [0, 1), got {args.label_noise}")
    if not 0 < args.beta <= 1:
        raise UsageError(f"--beta must be in (0, 1], got {args.beta}")
    if size is not None and args.servers > size:
        raise UsageError(f"--servers {args.servers} exceeds the world size {size}")
    if args.max_delay < 0:
        raise UsageError(f"--max-delay must be >= 0, got {args.max_delay}")
    if args.outer_lr is not None and not (args.outer_lr > 0 and math.isfinite(args.outer_lr)):
        raise UsageError(f"--outer-lr must be > 0, got {args.outer_lr}")
    if args.outer_momentum is not None and not 0 <= args.outer_momentum < 1:
        raise UsageError(f"--outer-momentum must be in [0, 1), got {args.outer_momentum}")
    if args.warmup_steps < 0:
        raise UsageError(f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    if args.momentum is not None and not 0 <= args.momentum < 1:
        raise UsageError(f"--momentum must be in [0, 1), got {args.momentum}")
    if not args.compute_ms >= 0:
        raise UsageError(f"--compute-ms must be >= 0, got {args.compute_ms}")
    if not 0 <= args.delay_prob <= 1 or args.delay_ms < 0:
        raise UsageError("--delay-prob must be in [0, 1] and --delay-ms >= 0")
    if args.checkpoint_every < 0 or args.eval_every < 0:
        raise UsageError("--checkpoint-every and --eval-every must be >= 0")
    if args.checkpoint_every and not args.out:
        raise UsageError("--checkpoint-every needs --out")
    for spec in args.straggler:
        parse_straggler(spec, size)
    for spec in getattr(args, "kill", None) or []:
        parse_kill(spec, size)
    if args.inner_mixing and not all(a in OUTER for a in algorithms):
        raise UsageError(f"--inner-mixing is for {', '.join(OUTER)}")
    if args.wire is not None:
        unsupported = [a for a in algorithms if (args.base if a in OUTER else a) not in WIRE]
        if any((args.base if a in OUTER else a) == "allreduce-params" for a in unsupported):
            raise UsageError(f"--wire: {', '.join(unsupported)}: {PARAMS_WIRE_REFUSED}")
        if unsupported:
            raise UsageError(f"--wire: {', '.join(unsupported)} cannot send compressed messages; "
                             f"choose from {', '.join(WIRE)} (or an outer optimizer over one)")
    if getattr(args, "on_failure", "abort") in ("continue", "replace"):
        check_on_failure(args, algorithms)
    if args.hierarchical:
        unsupported = [a for a in algorithms if a not in HIERARCHICAL]
        if unsupported:
            raise UsageError(f"--hierarchical: {', '.join(unsupported)} cannot run hierarchically; "
                             f"choose from {', '.join(HIERARCHICAL)}")
    if args.node_size is not None:
        if not args.hierarchical:
            raise UsageError("--node-size needs --hierarchical")
        if args.node_size < 1 or (size is not None and size % args.node_size):
            raise UsageError(f"--node-size must be a positive divisor of the world size, got {args.node_size}")
    nodes = size // args.node_size if size is not None and args.node_size else None
    for a in algorithms:
        graph = args.base if a in OUTER else a
        if graph in DEFAULT_TOPOLOGY:
            check_topology(args, graph, nodes if args.hierarchical else size)


def check_on_failure(args, algorithms):
    """``--on-failure continue`` and ``replace``: the algorithms and flags they cover."""
    if args.on_failure == "replace":
        if any(a in OUTER for a in algorithms) and args.base not in ("sgp", "allreduce-params", "dpsgd"):
            raise UsageError(f"--on-failure replace: an outer optimizer over {args.base}: not yet (over sgp, "
                             f"allreduce-params or dpsgd)")
        if len(algorithms) > 1:
            raise UsageError("--on-failure replace: one --algorithm at a time (a newcomer joins the run under way)")
        others = [a for a in algorithms if a not in REPLACEABLE]
        if others:
            raise UsageError(f"--on-failure replace: {', '.join(others)}: not yet (it takes "
                             f"{', '.join(REPLACEABLE)}; --on-failure continue trains on without the dead rank)")
    one_sided = [a for a in algorithms if a in ONE_SIDED]
    if one_sided:
        raise UsageError(f"--on-failure continue: {', '.join(one_sided)}: {ONE_SIDED_FAILURE}")
    others = [a for a in algorithms if a not in FAULT_TOLERANT or (a in OUTER and args.base not in FAULT_TOLERANT)]
    if others:
        raise UsageError(f"--on-failure continue: {', '.join(others)}: {NOT_YET_FAILURE}")
    if args.inner_mixing and args.base != "allreduce-params" and any(a in OUTER for a in algorithms):
        raise UsageError(f"--on-failure continue: --inner-mixing over {args.base}: {INNER_MIXING_FAILURE}")
    for flag, value in (("--hierarchical", args.hierarchical), ("--wire", args.wire),
                        ("--eval-every", args.eval_every)):
        if value:
            raise UsageError(f"--on-failure continue does not take {flag} yet (the survivors evaluate at the end, "
                             f"over a communicator of their own)")


#: The algorithms ``--on-failure replace`` grows back: the PushSum family heals a newcomer with half a
#: donor's mass (Σx, Σw exact), the others hand it a survivor's model and optimizer state.
REPLACEABLE = ("sgp", "osgp", "agp", "dpsgd", "allreduce", "allreduce-params", "localsgd", "slowmo", "diloco")


def topology_name(args, algorithm):
    """The ``--topology`` an algorithm uses: the flag, or that algorithm's default."""
    return args.topology or DEFAULT_TOPOLOGY.get(algorithm, "exponential")


def check_topology(args, algorithm, size):
    """The graph must bind to ``size`` (the world, or the nodes when hierarchical), and be
    doubly stochastic for D-PSGD."""
    name = topology_name(args, algorithm)
    if algorithm == "dpsgd" and name not in topo_mod.UNDIRECTED:
        raise UsageError(f"--topology {name}: dpsgd needs a doubly stochastic graph: "
                         + ", ".join(topo_mod.UNDIRECTED))
    try:
        graph = topo_mod.make(name, peers=args.peers, seed=args.seed)
        if size is not None:
            graph.bind(size)
    except ValueError as exc:
        raise UsageError(f"--topology {name} --peers {args.peers}: {exc}") from None


def parse_straggler(spec, size):
    try:
        rank, factor = spec.split(":")
        rank, factor = int(rank), float(factor)
    except ValueError:
        raise UsageError(f"--straggler {spec!r}: expected RANK:FACTOR, e.g. 1:3") from None
    if not factor >= 1 or rank < 0 or (size is not None and rank >= size):
        raise UsageError(f"--straggler {spec!r}: rank must be in [0, {size if size is not None else 'size'}) "
                         "and factor >= 1")
    return rank, factor


def parse_kill(spec, size):
    """``RANK:STEP`` of ``--kill``: ``(rank, step)``."""
    try:
        rank, step = (int(v) for v in spec.split(":"))
    except ValueError:
        raise UsageError(f"--kill {spec!r}: expected RANK:STEP, e.g. 3:20") from None
    if rank < 0 or (size is not None and rank >= size) or step < 0:
        raise UsageError(f"--kill {spec!r}: rank must be in [0, {size if size is not None else 'size'}) "
                         f"and step >= 0")
    return rank, step


#: Set in a process that ``MPI_Comm_spawn`` started (Open MPI; MPICH's PMI): a newcomer of
#: ``--on-failure replace``, whose own launch is one process and which joins a run of its size.
SPAWNED = ("OMPI_PARENT_PORT", "PMI_SPAWNED")


def spawned():
    """Whether this process was spawned into a running job (read before MPI starts)."""
    return any(os.environ.get(key) for key in SPAWNED)


def launcher_world_size():
    """The world size the launcher announces in the environment, or None (also in a spawned
    process: its launch of one is not the run's size)."""
    if spawned():
        return None
    for key in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"):
        value = os.environ.get(key)
        if value and value.isdigit():
            return int(value)
    return None


def launched_tasks():
    """``(count, variable)``: how many tasks the launcher says it started in this step, or None.
    Set by ``mpiexec``/``mpirun`` and by ``srun`` for its steps, not in a batch script itself
    (where one process may run alone in a larger allocation)."""
    for key in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS"):
        value = os.environ.get(key)
        if value and value.isdigit():
            return int(value), key
    return None


def check_launch(world_size):
    """Raise :class:`UsageError` when the launcher started several tasks but MPI gave this one a
    world of its own: N separate one-rank jobs would train side by side into one ``--out``."""
    launched = launched_tasks()
    if launched and launched[0] > 1 and world_size == 1:
        count, key = launched
        raise UsageError(f"the launcher started {count} tasks ({key}={count}) but MPI gives this one a world of 1 "
                         "rank: MPI did not reach the launcher's process manager, so every task would train "
                         "alone. Launch with `srun --mpi=pmix` (`srun --mpi=list` shows what this Slurm offers) "
                         "or with the mpirun/mpiexec of the MPI that mpi4py was built with "
                         "(`python -m mpigossip info` names it)")


def alone_in_allocation(world_size):
    """The warning (one line) for a world of one rank started in a Slurm allocation of several
    tasks without ``srun`` (the batch script's own shell runs ``python -m mpigossip train``):
    legitimate for a one-rank try, but most likely a forgotten ``srun``. None otherwise."""
    tasks = os.environ.get("SLURM_NTASKS", "")
    if world_size != 1 or launched_tasks() or not tasks.isdigit() or int(tasks) <= 1:
        return None
    return (f"python -m mpigossip: warning: training alone (1 rank) in a Slurm allocation of {tasks} tasks "
            f"(SLURM_NTASKS={tasks}): launch with `srun --mpi=pmix python -m mpigossip ...` (or mpirun) "
            "to train on all of them")


def launcher_rank():
    """This process's rank as the launcher announces it, or None when not launched by MPI."""
    for key in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"):
        value = os.environ.get(key)
        if value and value.isdigit():
            return int(value)
    return None


def check_out_folders(args, folders):
    """Raise :class:`UsageError` where an output folder holds another run's checkpoints that
    this run would neither resume nor delete (a later ``--resume`` would pick up a mix)."""
    overwrite = getattr(args, "overwrite", False)
    if overwrite and args.resume:
        raise UsageError("--overwrite and --resume: choose one (--overwrite deletes the checkpoints --resume reads)")
    for folder in folders:
        pointer = os.path.join(folder, "checkpoints", "latest.json") if folder else None
        if overwrite or not pointer or not os.path.isfile(pointer):
            continue
        if args.resume and os.path.realpath(args.resume) == os.path.realpath(folder):
            continue
        raise UsageError(f"--out {folder} holds another run's checkpoints: continue that run with --resume "
                         f"{folder}, start over there with --overwrite (deletes them), or choose another --out")


def algorithms_of(args):
    """The algorithms a ``train`` or ``compare`` command line asks for."""
    names = getattr(args, "algorithms", None) or [args.algorithm]
    return list(ALGORITHMS) if names in (["all"], "all") else list(names)


def precheck(args):
    """Check the flags before torch and MPI load; raise :class:`UsageError`."""
    lrs = getattr(args, "lrs", None) or [args.lr]
    check_arguments(args, algorithms_of(args), lrs, launcher_world_size())
