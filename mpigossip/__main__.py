"""Command line: ``python -m mpigossip {info} [...]`` (run it under mpiexec or srun)."""

import argparse
import sys


def build_parser():
    parser = argparse.ArgumentParser(prog="python -m mpigossip",
                                     description="mpigossip: decentralized and asynchronous SGD on MPI")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="versions, MPI, CUDA-awareness and per-rank GPU binding")
    info.add_argument("--json", action="store_true", help="print machine-readable JSON")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.command == "info":
        from . import info
        return info.main(args)
    return 2  # pragma: no cover - argparse enforces the choices


if __name__ == "__main__":
    sys.exit(main())
