"""Command line: ``python -m mpigossip {info,train,compare,table,plot,reproduce,timemodel,launch} [...]``.

Flags are parsed and checked before torch is imported or MPI initialised, so a bad flag is
answered in about a second, by rank 0 only. ``table``, ``plot``, ``timemodel`` and ``launch`` never start MPI. An
exception that escapes on any rank ends the whole job (``MPI_Abort``) with that rank's
traceback, instead of leaving the other ranks waiting.
"""

import argparse
import sys

from .onesided import progress
from .train import cli

#: The time model's calibration in a checkout (``reproduce --calibration``'s default).
CALIBRATION = "benchmarks/results/time-calibration-1gbit.json"


def _print_on_rank0(text):
    if cli.launcher_rank() in (None, 0):
        sys.stderr.write(text)
        sys.stderr.flush()


def _usage_exit():
    """Exit with status 2. The other ranks linger a moment, so that the launcher, which ends
    the job when the first rank exits non-zero, does not cut rank 0 off before it printed."""
    if cli.launcher_rank() not in (None, 0):
        import time
        time.sleep(1.0)
    sys.exit(2)


class _Parser(argparse.ArgumentParser):
    """Prints usage errors on rank 0 only (every rank exits with status 2)."""

    def error(self, message):
        if cli.launcher_rank() in (None, 0):
            self.print_usage(sys.stderr)
        _print_on_rank0(f"{self.prog}: error: {message}\n")
        _usage_exit()


def build_parser():
    """The parser, and its subcommand parsers by name."""
    parser = _Parser(prog="python -m mpigossip",
                     description="mpigossip: decentralized and asynchronous SGD on MPI")
    from . import __version__
    parser.add_argument("--version", action="version", version=f"mpigossip {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    commands = {}
    commands["info"] = info = sub.add_parser("info", help="versions, MPI, CUDA-awareness and per-rank GPU binding")
    info.add_argument("--json", action="store_true", help="print machine-readable JSON")
    commands["train"] = train = sub.add_parser("train", help="train a model with one algorithm (or all)")
    cli.add_arguments(train)
    commands["compare"] = compare = sub.add_parser("compare", help="every algorithm x learning rate in one job, "
                                                   "as a table")
    compare.add_argument("--algorithms", nargs="+", default=["all"],
                         help="algorithms to run (default: all)")
    compare.add_argument("--lrs", type=float, nargs="+", default=[0.1], help="learning rates (default: 0.1)")
    cli.add_arguments(compare, sweep=True)
    commands["table"] = table = sub.add_parser("table", help="one comparison table from finished runs (no MPI)")
    table.add_argument("dirs", nargs="+", metavar="DIR", help="folders searched for summary.json")
    table.add_argument("--out", help="also write the table: a file X.md (its rows in X.json), or a folder that gets "
                       "compare.md and compare.json")
    commands["plot"] = plot = sub.add_parser("plot", help="PNG figures of runs written by train/compare --out")
    plot.add_argument("dirs", nargs="+", metavar="DIR", help="run folders, or folders of runs")
    plot.add_argument("--out", help="where to write the PNGs (default: the first DIR)")
    commands["reproduce"] = rep = sub.add_parser(
        "reproduce", help="run the experiments behind the papers' findings; write a report (markdown + PNG)")
    rep.add_argument("--out", default="reproduce-report", help="report folder (default: %(default)s)")
    rep.add_argument("--quick", action="store_true", help="a small version (1 seed, fewer steps), a few minutes")
    rep.add_argument("--mpiexec", help="launcher of the accuracy runs, e.g. 'srun' or 'mpirun --hostfile H' "
                     "(default: mpigossip-mpiexec, this machine)")
    rep.add_argument("--timed-mpiexec", help="launcher of the timed runs, on a cluster where communication "
                     "counts, e.g. 'tests/cluster/mpiexec --map-by node' (default: as --mpiexec; their timing "
                     "is then reported but not judged)")
    rep.add_argument("--dataset", default="fashion-mnist", choices=["fashion-mnist", "synthetic", "cifar10"],
                     help="the problem: fashion-mnist (MLP; Debian's dataset-fashion-mnist, or --data-dir), "
                     "synthetic (Gaussian clusters, MLP) or cifar10 (small CNN, from --data-dir; needs a cluster's "
                     "compute) (default: %(default)s)")
    rep.add_argument("--data-dir", help="the data set's folder (fashion-mnist: /usr/share/datasets/fashion-mnist; "
                     "cifar10: its python batches)")
    rep.add_argument("--timeout", type=float, default=1800, help="seconds one MPI job may take (default: 1800)")
    rep.add_argument("--resume", action="store_true",
                     help="reuse the jobs already finished in --out (an interrupted reproduction continues)")
    rep.add_argument("--calibration", metavar="COSTS_JSON", default=CALIBRATION,
                     help="the time model's calibration, for the simulator's predicted times to the target in "
                     "finding (d-sim) (default: the repository's %(default)s; 'none' to leave them out)")
    rep.add_argument("--accuracy-from", metavar="RESULTS_JSON",
                     help="take the accuracy runs from an earlier reproduction's results.json (same mode and "
                     "dataset) and run only the timed runs and the simulator: a change to communication re-measured "
                     "without the hour of accuracy runs")
    rep.add_argument("--timed-from", metavar="RESULTS_JSON",
                     help="take the timed runs from an earlier reproduction's results.json (same mode and dataset) "
                     "instead of launching them: with --accuracy-from, only the simulator and the time model run "
                     "(a change to them re-made in minutes, without the cluster)")
    commands["timemodel"] = tm = sub.add_parser(
        "timemodel", help="the time model (mpigossip.sim): validate it against P4, predict at scale")
    from .sim import cli as sim_cli
    sim_cli.add_arguments(tm)
    commands["launch"] = launch = sub.add_parser(
        "launch", help="start a batch job's ranks inside its Slurm allocation (the jobs/ scripts use it)")
    launch.add_argument("--launcher", default="srun", choices=["srun", "mpirun"],
                        help="srun --mpi=pmix, or the MPI's own mpirun inside the allocation (default: srun)")
    launch.add_argument("--retries", type=int, default=1,
                        help="launch again this many times after a crash inside MPI_Init under srun (default: 1)")
    launch.add_argument("--progress-thread", nargs="?", const="on", default="auto", choices=["auto", "on", "off"],
                        help="Open MPI's TCP progress thread (OMPI_MCA_btl_tcp_progress_thread, unless set): on, "
                        "off, or auto: train and compare turn it on for one-sided methods (easgd, asgd, gossip-pull, "
                        "adpsgd) across nodes when each rank has a core (default: %(default)s; bare: on)")
    launch.add_argument("--fault-tolerant", action="store_true",
                        help="Open MPI's fault tolerance (mpirun --with-ft ulfm; not under srun), for train "
                        "--on-failure continue")
    launch.add_argument("--spares", type=int, default=0, metavar="N",
                        help="the allocation's last N nodes start no rank: train --on-failure replace starts its "
                        "newcomers there first (needs --launcher mpirun --fault-tolerant; default: 0)")
    launch.add_argument("program", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                        help="what every task runs")
    return parser, commands


def parse(argv=None):
    """Parse and check the command line; usage errors exit with status 2 (rank 0 prints)."""
    parser, commands = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # name the subcommand's usage, not the top level's
        commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "launch":
        if args.program[:1] == ["--"]:
            args.program = args.program[1:]
        if not args.program:
            commands["launch"].error("no command: python -m mpigossip launch [--launcher L] -- COMMAND ...")
        if args.retries < 0:
            commands["launch"].error("--retries must be >= 0")
    if args.command in ("train", "compare"):
        try:
            cli.precheck(args)
        except cli.UsageError as exc:
            _print_on_rank0(f"python -m mpigossip: error: {exc}\n")
            _usage_exit()
    return args


def abort_on_uncaught(error):
    """An exception escaped on this rank: print its traceback and end the whole MPI job,
    as ``python -m mpi4py`` does, instead of leaving the other ranks waiting for this one."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized() or mpi.COMM_WORLD.Get_size() == 1:
        return
    import traceback
    sys.stderr.write(f"mpigossip: rank {mpi.COMM_WORLD.Get_rank()}: uncaught exception; aborting the job\n")
    traceback.print_exception(error)
    from .core.deadline import abort_job
    abort_job(mpi.COMM_WORLD, 1)   # (under ULFM, MPI_Abort alone ends only this rank)


def main(argv=None):
    args = parse(argv)
    try:
        code = _run(args)
    except (Exception, KeyboardInterrupt) as error:
        abort_on_uncaught(error)
        raise
    survived = sys.modules.get("mpigossip.resilience.failures")
    if survived is not None and survived.seen():  # after a failure MPI_Finalize hangs: end without it
        survived.exit(code or 0)
    return code


def _run(args):
    if args.command == "info":
        from .launch import info
        return info.main(args)
    if args.command in ("train", "compare"):   # before MPI starts: Open MPI reads it in MPI_Init
        decision = progress.apply(cli.algorithms_of(args))
        if decision.changed:
            _print_on_rank0(f"mpigossip: {decision.describe()}\n")
    if args.command == "train":
        # MPI_Init before torch's import: a newcomer spawned by the survivors (--on-failure replace)
        # reaches MPI_Init, where their spawn returns, a second sooner, and learns its place at once
        # (torch is imported, and its data and model built, while the survivors train on)
        from .core.deadline import check_timeout
        from .resilience import grow
        arrival = (grow.arrive(timeout=check_timeout(args.timeout), op="train (--on-failure replace)")
                   if grow.newcomer() else None)
        from .train import job
        return job.main(args, arrival)
    if args.command == "compare":
        from .train import compare
        return compare.main(args)
    if args.command == "table":
        from .train import table
        return table.table_main(args)
    if args.command == "plot":
        from .train import plot
        return plot.main(args)
    if args.command == "timemodel":
        from .reproduce import simulate
        from .sim import cli as sim_cli
        problems = {"digits": simulate.digits_problem, "digits-mlp": simulate.digits_mlp_problem,
                    "synthetic": simulate.problem}
        return sim_cli.main(args, problems=problems)
    if args.command == "launch":
        from .launch import slurm
        return slurm.main(args)
    if args.command == "reproduce":
        from . import reproduce
        return reproduce.main(args)
    return 2  # pragma: no cover - argparse enforces the choices


if __name__ == "__main__":
    sys.exit(main())
