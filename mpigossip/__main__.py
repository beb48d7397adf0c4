"""Command line: ``python -m mpigossip {info,train,compare,plot} [...]`` (under mpiexec or srun)."""

import argparse
import sys


class _Parser(argparse.ArgumentParser):
    """Prints usage errors on rank 0 only (every rank exits with status 2)."""

    def error(self, message):
        import os
        rank = os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("PMI_RANK") or os.environ.get("SLURM_PROCID")
        if rank in (None, "0"):
            self.print_usage(sys.stderr)
            sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def build_parser():
    parser = _Parser(prog="python -m mpigossip",
                     description="mpigossip: decentralized and asynchronous SGD on MPI")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    info = sub.add_parser("info", help="versions, MPI, CUDA-awareness and per-rank GPU binding")
    info.add_argument("--json", action="store_true", help="print machine-readable JSON")

    from .train import job
    train = sub.add_parser("train", help="train a model with one algorithm (or all)")
    job.add_arguments(train)
    compare = sub.add_parser("compare", help="every algorithm x learning rate in one job, as a table")
    compare.add_argument("--algorithms", nargs="+", default=["all"],
                         help="algorithms to run (default: all)")
    compare.add_argument("--lrs", type=float, nargs="+", default=[0.1], help="learning rates (default: 0.1)")
    job.add_arguments(compare, sweep=True)
    table = sub.add_parser("table", help="one comparison table from finished runs (no MPI)")
    table.add_argument("dirs", nargs="+", metavar="DIR", help="folders searched for summary.json")
    table.add_argument("--out", help="also write compare.json and compare.md there")
    plot = sub.add_parser("plot", help="PNG figures of runs written by train/compare --out")
    plot.add_argument("dirs", nargs="+", metavar="DIR", help="run folders, or folders of runs")
    plot.add_argument("--out", help="where to write the PNGs (default: the first DIR)")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.command == "info":
        from . import info
        return info.main(args)
    if args.command == "train":
        from .train import job
        return job.main(args)
    if args.command == "compare":
        from .train import compare
        return compare.main(args)
    if args.command == "table":
        from .train import compare
        return compare.table_main(args)
    if args.command == "plot":
        from .train import plot
        return plot.main(args)
    return 2  # pragma: no cover - argparse enforces the choices


if __name__ == "__main__":
    sys.exit(main())
