"""``python -m mpigossip compare``: every algorithm x learning rate in one MPI job, as a table."""

from mpi4py import MPI

from . import data as data_mod
from .cli import UsageError, algorithms_of
from .job import check_world, fail, run_many
from .table import run_dir, write_table


def main(args):
    comm = MPI.COMM_WORLD
    algorithms = algorithms_of(args)
    args.algorithm, args.resume, args.checkpoint_every = algorithms[0], None, 0
    try:
        check_world(args, algorithms, args.lrs, comm)
    except UsageError as exc:
        return fail(comm, str(exc), 2)
    out = args.out

    def out_for(algorithm, lr):
        return run_dir(out, algorithm, lr) if out else None
    try:
        summaries = run_many(args, comm, algorithms, args.lrs, out_for)
    except (data_mod.DataError, ValueError, OSError) as exc:
        return fail(comm, str(exc), 1)
    if comm.Get_rank() == 0:
        table = write_table(out, summaries)
        print(f"\n{len(algorithms)} algorithms x {len(args.lrs)} learning rates, {comm.Get_size()} ranks, "
              f"{args.model} on {summaries[0]['dataset']}:\n{table}", flush=True)
    return 0
