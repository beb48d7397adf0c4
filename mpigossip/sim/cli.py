"""``python -m mpigossip timemodel {validate,predict,accuracy}``: the time model from its
calibration (no MPI).

* ``validate P4.json ...``: the P4 rows predicted beside their measurements
  (:mod:`.validation`), nothing refitted;
* ``predict``: steps per second per rank of each method as ranks and link rate grow
  (:mod:`.scaling`);
* ``accuracy``: time to a target accuracy, the accuracy simulator joined to the predictions
  (:mod:`.accuracy_time`), with a map of the method first to the target (``--out``).

Each prints markdown and, with ``--out DIR``, writes ``DIR/timemodel-WHAT.{md,json}`` recording
the commit, the versions and the calibration used.
"""

import json
import os
import sys

from ..core import provenance
from . import accuracy_time, scaling
from .timing import Costs


def add_arguments(parser):
    parser.add_argument("--costs", required=True, help="the calibration (benchmarks/calibrate_time.py --out FILE)")
    parser.add_argument("--out", help="folder for timemodel-{validate,predict,accuracy}[-TAG].{md,json}")
    parser.add_argument("--tag", help="appended to the files' names (timemodel-accuracy-TAG.md, ...)")
    sub = parser.add_subparsers(dest="what", required=True)
    val = sub.add_parser("validate", help="predict the P4 benchmark's rows and set them beside the measurements")
    val.add_argument("p4", nargs="*", metavar="P4.json", help="result files of bench_network.py --parts p4")
    val.add_argument("--reproduction", metavar="RESULTS_JSON",
                     help="also a reproduction's timed runs (docs/reproduce/results.json), with their workload:")
    val.add_argument("--reproduction-mb", type=float, default=1.03, help="their model in MB (default: 1.03)")
    val.add_argument("--reproduction-compute-ms", type=float, default=200, help="their compute (default: 200)")
    val.add_argument("--reproduction-nodes", type=int, nargs=2, default=[4, 2], metavar=("NODES", "PER_NODE"),
                     help="where they ran (default: 4 2)")
    val.add_argument("--outer", metavar="OUTER_JSON",
                     help="also bench_outer.py's runs (benchmarks/results/outer.json), at their link rates")
    val.add_argument("--outer-mb", type=float, default=1.03, help="their model in MB (default: 1.03)")
    pre = sub.add_parser("predict", help="steps/s per rank of each method as ranks and link rate grow")
    _cluster_arguments(pre, scaling.DEFAULT_METHODS)
    acc = sub.add_parser("accuracy", help="time to a target accuracy as ranks and link rate grow, and a map of "
                         "the method first to it")
    _cluster_arguments(acc, ("allreduce", "sgp", "osgp:2", "agp", "gossip-pull", "easgd"))
    acc.add_argument("--problem", choices=("digits", "digits-mlp", "synthetic"), default="digits",
                     help="the accuracy simulator's problem: softmax regression on scikit-learn's digits (convex; "
                          "its accuracy rises for hundreds of steps; default), an MLP with 32 tanh units on the "
                          "same digits (non-convex), or softmax regression on the reproduction's synthetic data")
    acc.add_argument("--skew", type=float, default=0.0,
                     help="fraction of each rank's minibatch drawn from one class of its own (default: 0, i.i.d.)")
    acc.add_argument("--evaluate", choices=("ranks", "mean"), default="ranks",
                     help="the ranks' own models (default; EASGD's center) or their exact mean")
    acc.add_argument("--sim-steps", type=int, default=1000,
                     help="SGD steps of the accuracy simulator (default: 1000)")
    acc.add_argument("--lr", type=float, default=0.05, help="the accuracy simulator's step size (default: 0.05)")
    acc.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    acc.add_argument("--drop", type=float, default=0.01,
                     help="target: AllReduce's best accuracy in its first half of the steps at that p less this "
                          "(default: 0.01)")
    acc.add_argument("--stragglers", type=float, nargs="+", default=[1.0, 2.0],
                     help="rank 1's compute factors (default: 1 2)")
    acc.add_argument("--measured", metavar="RESULTS_JSON",
                     help="a reproduction's results.json whose timed runs (measured on a cluster: pass the "
                          "same --mb and --compute-ms as theirs) put the method first to their target on the map")
    acc.add_argument("--measured-gbit", type=float, default=1.0, help="the link rate they ran at (default: 1)")
    acc.add_argument("--predictions", metavar="PREDICT_JSON", nargs="+",
                     help="`timemodel predict` result files to take the time model's rows from instead of "
                          "simulating again (every cell asked for must be in them, made with the same --mb, "
                          "--compute-ms and --per-node)")


def _cluster_arguments(parser, methods):
    """The predicted clusters and workload (``predict`` and ``accuracy``)."""
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--per-node", type=int, default=8, help="ranks per node, a core each (default: 8)")
    parser.add_argument("--rate-gbit", type=float, nargs="+", default=[1, 10, 100])
    parser.add_argument("--mb", type=float, default=100, help="model size in MB (default: 100)")
    parser.add_argument("--compute-ms", type=float, default=100, help="compute per step, a GPU's (default: 100)")
    parser.add_argument("--methods", nargs="+", default=list(methods), help="default: " + " ".join(methods))
    parser.add_argument("--steps", type=int, default=10,
                        help="the least timed steps of the time model per rank: each method runs on until its pace "
                        "and the models it moves per step are steady (default: 10)")


def _meta(costs_path):
    with open(costs_path) as f:
        calibration = json.load(f)
    return {"commit": provenance.commit(), "versions": provenance.versions(),
            "command": "python -m mpigossip " + " ".join(sys.argv[1:]),
            "calibration": costs_path, "calibration_meta": calibration.get("meta", {})}


def main(args, problems=None):
    """``problems``: ``{name: problem_for(seed)}``, the accuracy simulator's problems
    (``accuracy --problem``; the command line passes the digits and the reproduction's
    synthetic data)."""
    costs = Costs.load(args.costs)
    progress = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    extra = {}
    if args.what == "validate":
        from . import validation
        if not (args.p4 or args.reproduction or args.outer):
            raise SystemExit("timemodel validate: give P4 result files, --reproduction RESULTS_JSON and/or "
                             "--outer OUTER_JSON")
        rows = validation.p4_table(args.p4, costs)
        if args.reproduction:
            nodes, per_node = args.reproduction_nodes
            rows += validation.reproduction_table(args.reproduction, costs, mb=args.reproduction_mb,
                                                  compute=args.reproduction_compute_ms / 1e3, nodes=nodes,
                                                  per_node=per_node)
        if args.outer:
            rows += validation.outer_table(args.outer, costs, mb=args.outer_mb)
        text = validation.markdown(rows)
    elif args.what == "accuracy":
        rows, accuracy = accuracy_time.time_to_accuracy(
            costs, problems[args.problem], ranks=args.ranks, rates_gbit=args.rate_gbit, per_node=args.per_node,
            mb=args.mb, compute=args.compute_ms / 1e3, methods=args.methods, stragglers=tuple(args.stragglers),
            time_steps=args.steps, sim_steps=args.sim_steps, lr=args.lr, seeds=tuple(args.seeds), drop=args.drop,
            skew=args.skew, evaluate=args.evaluate, progress=progress,
            predictions=_predictions(args.predictions) if args.predictions else None)
        name = problems[args.problem](args.seeds[0]).name
        text = (f"Accuracy simulator: {name} on the {args.problem.split('-')[0]} data, plain SGD, batch 16 per rank, "
                f"lr {args.lr:g}, {args.sim_steps} steps, seeds {', '.join(map(str, args.seeds))}, "
                + (f"{args.skew:g} of each rank's batch from its own class" if args.skew else "i.i.d. batches")
                + "; evaluated: " + ("the ranks' own models (EASGD: its center)" if args.evaluate == "ranks"
                                     else "the exact mean of the ranks' models") + "; "
                f"target: AllReduce's best accuracy in its first {args.sim_steps // 2} steps less {args.drop:g}.\n\n" + accuracy_time.markdown(rows, accuracy))
        extra = {"accuracy": {str(p): a for p, a in accuracy.items()},
                 "accuracy_setting": {"problem": args.problem, "skew": args.skew, "evaluate": args.evaluate,
                                      "sim_steps": args.sim_steps, "lr": args.lr, "seeds": args.seeds,
                                      "drop": args.drop}}
    else:
        rows = scaling.predict(costs, ranks=args.ranks, rates_gbit=args.rate_gbit, per_node=args.per_node,
                               mb=args.mb, compute=args.compute_ms / 1e3,
                               methods=tuple(args.methods), steps=args.steps, progress=progress)
        text = scaling.markdown(rows)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        meta = _meta(args.costs)
        base = os.path.join(args.out, f"timemodel-{args.what}" + (f"-{args.tag}" if args.tag else ""))
        with open(base + ".json", "w") as f:
            json.dump({"meta": meta, "rows": rows, **extra}, f, indent=1)
        figure = ""
        if args.what == "accuracy":
            from .figures import winner_map
            measured = measured_firsts(args.measured, args.measured_gbit) if args.measured else []
            winner_map(rows, base + ".png", measured)
            if measured:
                text += "\n\nMeasured (stars on the map): " + "; ".join(
                    f"{p} ranks at {rate:g} Gbit, {'no straggler' if f == 1.0 else f'rank 1 {f:g}x slow'}: {label}"
                    for f, p, rate, _, label in measured)
            figure = f"![the method first to the target]({os.path.basename(base)}.png)\n\n"
        with open(base + ".md", "w") as f:
            f.write(f"Time model ({args.what}) at {meta['commit']} ({meta['versions']}), calibration "
                    f"`{args.costs}` (measured at {meta['calibration_meta'].get('commit', '?')}): "
                    f"`{meta['command']}`\n\n{figure}{text}\n")
    return 0


def _predictions(paths):
    rows = []
    for path in paths:
        with open(path) as f:
            rows += json.load(f)["rows"]
    return rows


#: The reproduction's timed cases, as the time model's straggler factors.
_CASES = {"normal": 1.0, "straggler": 2.0}


def measured_firsts(path, rate_gbit):
    """``(factor, ranks, rate, method, label)`` per timed case of a reproduction's results.json:
    the method first to the target (95% of the lowest final accuracy without a straggler, the
    reproduction's), by the median over repeats of its training time to it."""
    import numpy as np
    with open(path) as f:
        timed = json.load(f)["timed_runs"]
    normal = [r for r in timed if r["case"] == "normal"]
    if not normal:
        return []
    target = 0.95 * min(r["final_accuracy"] for r in normal)
    out = []
    for case, factor in _CASES.items():
        times = {}
        for r in (r for r in timed if r["case"] == case):
            t = next((c["time_s"] for c in r["curve"] if c["accuracy"] >= target), None)
            times.setdefault(r["algorithm"], []).append(np.inf if t is None else t)
        medians = {m: float(np.median(v)) for m, v in times.items()}
        if medians and min(medians.values()) < np.inf:
            first = min(medians, key=medians.get)
            label = f"{first} {medians[first]:.1f} s" + (
                f", AllReduce {medians['allreduce']:.1f} s" if "allreduce" in medians and first != "allreduce" else "")
            out.append((factor, timed[0]["world_size"], rate_gbit, first, label))
    return out
