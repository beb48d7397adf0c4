"""``python -m mpigossip compare``: every algorithm x learning rate in one MPI job, as a table."""

import json
import os

from mpi4py import MPI

from .. import torch as mgt
from . import data as data_mod
from .job import UsageError, check_arguments, fail, run_many

COLUMNS = [("algorithm", "algorithm", "{}"), ("lr", "lr", "{:g}"), ("final_accuracy", "test accuracy", "{:.4f}"),
           ("final_loss", "test loss", "{:.4f}"), ("time_per_step_s", "ms/step", "{:.2f}"),
           ("comm_time_s", "comm s", "{:.2f}"), ("consensus_distance", "consensus dist.", "{:.2e}")]


def markdown(summaries):
    def cell(s, key, fmt):
        value = s[key] * 1e3 if key == "time_per_step_s" else s[key]
        return fmt.format(value)
    lines = ["| " + " | ".join(title for _, title, _ in COLUMNS) + " |",
             "|" + "|".join("---" for _ in COLUMNS) + "|"]
    lines += ["| " + " | ".join(cell(s, k, f) for k, _, f in COLUMNS) + " |" for s in summaries]
    return "\n".join(lines)


def main(args):
    comm = MPI.COMM_WORLD
    algorithms = list(mgt.ALGORITHMS) if args.algorithms == ["all"] else args.algorithms
    args.algorithm, args.resume, args.checkpoint_every = algorithms[0], None, 0
    try:
        check_arguments(args, algorithms, args.lrs, comm.Get_size())
    except UsageError as exc:
        return fail(comm, str(exc), 2)
    out = args.out

    def out_for(algorithm, lr):
        return os.path.join(out, f"{algorithm}-lr{lr:g}") if out else None
    try:
        summaries = run_many(args, comm, algorithms, args.lrs, out_for)
    except (data_mod.DataError, ValueError, OSError) as exc:
        return fail(comm, str(exc), 1)
    if comm.Get_rank() == 0:
        table = markdown(summaries)
        print(f"\n{len(algorithms)} algorithms x {len(args.lrs)} learning rates, {comm.Get_size()} ranks, "
              f"{args.model} on {summaries[0]['dataset']}:\n{table}", flush=True)
        if out:
            os.makedirs(out, exist_ok=True)
            with open(os.path.join(out, "compare.json"), "w") as f:
                json.dump(summaries, f, indent=2)
            with open(os.path.join(out, "compare.md"), "w") as f:
                f.write(table + "\n")
    return 0
