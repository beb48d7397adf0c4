"""AGP's cost in steps, measured by the package and predicted by the accuracy simulator, on one problem.

    python benchmarks/agp_penalty.py [--ranks 8] [--steps 1000] [--seeds 0 1 2] [--out benchmarks/results/agp-penalty]

The time model's maps charge AGP for the weight it has in flight (``mpigossip.sim.AsyncPushSumSim``): how many
more steps than AllReduce it needs to reach a target. This runs the package itself on one node
(``python -m mpigossip train`` under ``mpigossip-mpiexec``: AllReduce SGD, SGP and AGP, softmax regression on the
digits, plain SGD at the simulator's lr 0.05, batch 16 a rank, weight decay 1e-4 as the simulator's L2) and the
simulator on its own digits problem with the same ranks, lr, batch and steps (AGP's shares combined in the step
they left or the next, 1 step late as the time model's large messages are at best, and 1-3), several seeds each. For each: the mean accuracy of the ranks' own models at the evaluated steps, and the
steps to the target (AllReduce's best in its first half of the steps less 0.01, on each side its own). The row to
read is AGP's steps over AllReduce's, measured against simulated. Writes OUT.json and OUT.md.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from mpigossip import sim  # noqa: E402
from mpigossip.core import provenance  # noqa: E402
from mpigossip.reproduce import simulate  # noqa: E402
from mpigossip.reproduce.experiments import load_curve  # noqa: E402

SCHEMES = ("allreduce", "sgp", "agp")
DELAYS = {"agp (0-1 steps late)": [0, 1], "agp (1 step late)": [1], "agp (1-3 steps late)": [1, 2, 3]}


def measured(ranks, steps, seed, lr, every, folder):
    """Each scheme's curve from the package (one node)."""
    curves = {}
    for scheme in SCHEMES:
        out = os.path.join(folder, f"{scheme}-{seed}")
        cmd = ["timeout", "900", os.path.join(os.path.dirname(sys.executable), "mpigossip-mpiexec"), "-n", str(ranks),
               sys.executable, "-m", "mpigossip", "train", "--algorithm", scheme, "--dataset", "digits",
               "--model", "logreg", "--lr", str(lr), "--momentum", "0", "--weight-decay", "1e-4",
               "--batch-size", "16", "--steps", str(steps), "--eval-every", str(every), "--seed", str(seed),
               "--out", out, "--quiet"]
        subprocess.run(cmd, check=True)
        curves[scheme] = [(p["steps"], p["rank_accuracy"]) for p in load_curve(out)]
    return curves


def simulated(ranks, steps, seed, lr, every):
    """Each scheme's curve from the accuracy simulator."""
    problem = simulate.digits_problem(seed)
    curves = {}
    for name in ("allreduce", "sgp", *DELAYS):
        scheme = name.split(" ")[0]
        run = sim.run_sgd(problem, scheme, ranks, steps=steps, lr=lr, seed=seed, eval_every=every,
                          delays=DELAYS.get(name))
        curves[name] = list(zip(run["steps"], run["rank_accuracy"]))
    return curves


def steps_to(curve, target):
    return next((s for s, a in curve if a >= target), None)


def summarize(runs, steps):
    """Per scheme: mean rank accuracy at each evaluated step over seeds, and the median steps to
    the target (AllReduce's best in its first half less 0.01, per seed)."""
    out = {}
    for name in runs[0]:
        at = {}
        for run in runs:
            for s, a in run[name]:
                at.setdefault(s, []).append(a)
        hits = []
        for run in runs:
            target = max(a for s, a in run["allreduce"] if s <= steps // 2) - 0.01
            hits.append(steps_to(run[name], target))
        out[name] = {"accuracy": {str(s): float(np.mean(v)) for s, v in sorted(at.items())},
                     "steps_to_target": hits,
                     "median_steps": (float(np.median(hits)) if all(h is not None for h in hits) else None)}
    base = out["allreduce"]["median_steps"]
    for row in out.values():
        row["over_allreduce"] = row["median_steps"] / base if row["median_steps"] and base else None
    return out


def markdown(result):
    lines = [f"AGP's steps to the target against AllReduce's, measured and simulated ({result['setting']}).", "",
             "| side | scheme | steps to target (per seed) | / AllReduce | rank accuracy at 100, 300, end |",
             "|---|---|---|---|---|"]
    for side in ("measured", "simulated"):
        for name, row in result[side].items():
            acc = row["accuracy"]
            keys = [k for k in ("100", "300") if k in acc] + [max(acc, key=int)]
            ratio = "-" if row["over_allreduce"] is None else f"{row['over_allreduce']:.2f}"
            lines.append(f"| {side} | {name} | {row['steps_to_target']} | {ratio} | "
                         f"{', '.join(f'{acc[k]:.3f}' for k in keys)} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "agp-penalty"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        real = [measured(args.ranks, args.steps, s, args.lr, args.every, folder) for s in args.seeds]
    model = [simulated(args.ranks, args.steps, s, args.lr, args.every) for s in args.seeds]
    result = {"commit": provenance.commit(), "versions": provenance.versions(),
              "command": "python benchmarks/agp_penalty.py " + " ".join(sys.argv[1:]),
              "setting": (f"{args.ranks} ranks on one node, softmax regression on the digits, plain SGD, lr {args.lr:g}, "
                          f"batch 16 a rank, {args.steps} steps, seeds {args.seeds}; target: AllReduce's best rank "
                          f"accuracy in its first {args.steps // 2} steps less 0.01, each side its own"),
              "measured": summarize(real, args.steps), "simulated": summarize(model, args.steps),
              "curves": {"measured": real, "simulated": model}}
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
