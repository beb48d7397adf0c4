"""Outer optimizers and compressed messages, trained side by side on the emulated cluster.

    python benchmarks/bench_outer.py [--rates 1gbit 100mbit] [--seeds 0 1 2] [--steps 400]
        [--compute-ms 30] [--out benchmarks/results] [--runs DIR] [--only ROW ...] [--name outer]

As root: for each link rate, starts 4 emulated nodes (``tests/cluster/start.sh 4 RATE 1``, one
rank each) and trains Fashion-MNIST's MLP (width 256: two hidden layers, 1.08 MB of parameters) with every
configuration below, seed after seed (the configurations of one seed run back to back, so
machine noise hits all alike); every step first sleeps ``--compute-ms`` (the fixed compute
model of the network benchmark's P4 and the reproduction's timed runs). Writes
``OUT/outer.json`` (every run's summary and curve, the commit and versions) and
``OUT/outer.md``: per rate and configuration, the final test accuracy (mean and range over
seeds), training time (evaluations excluded) and its ratio to AllReduce's, the time to
reach AllReduce's final accuracy less one point, and the bytes one rank sends per step,
counted from the algorithm (ring-equivalent 2 (P-1)/P of the model for an AllReduce, one
model per out-peer for SGP, per outer step for the outer methods, times the wire format's
bytes ratio), not measured on the wire.

``--only`` runs some rows (also those past the default ten: SGP fp16) and ``--name`` writes
them to ``OUT/NAME.{json,md}`` (merged into it if it exists).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from mpigossip.core.wire import INT8_BLOCK  # noqa: E402
from mpigossip.reproduce import experiments, findings, setup  # noqa: E402

INNER = 32  # the outer methods' inner steps (OPTION_DEFAULTS)
#: (row, algorithm, extra flags, steps as a multiple of --steps): the issue's list. The outer
#: methods that send only every INNER steps run twice as many steps (their time to the target
#: is what counts); DiLoCo's inner optimizer is plain SGD (its outer Nesterov momentum is the
#: momentum: with inner momentum 0.9 as well it fell to chance on this problem, 0.10 after 1000
#: steps, measured before choosing).
CONFIGS = (
    ("AllReduce", "allreduce", (), 1),
    ("SGP", "sgp", (), 1),
    (f"local SGD (H={INNER})", "localsgd", (), 2),
    (f"DiLoCo (H={INNER}, inner SGD without momentum)", "diloco", ("--momentum", "0"), 2),
    (f"gossip outer step: DiLoCo over gossip-push (H={INNER}, inner momentum 0)", "diloco",
     ("--momentum", "0", "--base", "gossip-push"), 2),
    (f"SlowMo over SGP (H={INNER}, SGP every step)", "slowmo", ("--base", "sgp", "--inner-mixing"), 1),
    ("AllReduce bf16", "allreduce", ("--wire", "bf16"), 1),
    ("SGP bf16", "sgp", ("--wire", "bf16"), 1),
    ("AllReduce int8", "allreduce", ("--wire", "int8"), 1),
    ("SGP int8", "sgp", ("--wire", "int8"), 1),
    ("SGP fp16", "sgp", ("--wire", "fp16"), 1),  # (with --only)
)
#: The rows of the default run (the others with --only).
DEFAULT_ROWS = tuple(row for row, *_ in CONFIGS[:10])
EVAL_EVERY = 50
RANKS = 4


#: Parameters of ``train --dataset fashion-mnist --model mlp --width 256`` (784-256-256-10).
MLP_PARAMETERS = 784 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10


def wire_ratio(flags):
    fmt = flags[flags.index("--wire") + 1] if "--wire" in flags else None
    return {None: 1.0, "bf16": 0.5, "fp16": 0.5, "int8": (1 + 4 / INT8_BLOCK) / 4}[fmt]


def bytes_per_step(algorithm, flags, model_bytes, p=RANKS):
    """Bytes one rank sends per step, from the algorithm (not measured)."""
    base = flags[flags.index("--base") + 1] if "--base" in flags else "allreduce-params"
    ring = 2 * (p - 1) / p
    if "--inner-mixing" in flags:  # the base every step, an exact mean at each outer step
        return (1.0 + ring / INNER) * model_bytes * wire_ratio(flags)
    if algorithm in ("allreduce", "allreduce-params"):
        per = ring
    elif algorithm in ("sgp", "gossip-push"):
        per = 1.0
    else:  # an outer method: its base's exchange every INNER steps
        per = (ring if base == "allreduce-params" else 1.0) / INNER
    return per * model_bytes * wire_ratio(flags)


def groups(only=None):
    """Configurations that share flags, so that one ``compare`` launch runs them (those whose
    row is in ``only``, if given)."""
    out = {}
    for row, algorithm, flags, times in CONFIGS:
        if row not in (only or DEFAULT_ROWS):
            continue
        out.setdefault((flags, times), []).append((row, algorithm))
    return list(out.items())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", nargs="+", default=["1gbit", "100mbit"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--compute-ms", type=float, default=30.0)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--runs", default=None, help="where the runs go (default: a temporary folder)")
    parser.add_argument("--only", nargs="+", metavar="ROW", help="run only these rows (names as in the table) and "
                        "replace them in OUT/NAME.json if it exists, keeping the other rows (a rerun after a fix)")
    parser.add_argument("--name", default="outer", help="result files OUT/NAME.json and .md (default: %(default)s)")
    args = parser.parse_args()
    runs = args.runs or tempfile.mkdtemp(prefix="bench-outer-")
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(runs, exist_ok=True)
    mpiexec = [os.path.join(ROOT, "tests/cluster/mpiexec"), "--map-by", "node"]
    records = []
    log = open(os.path.join(runs, "launches.log"), "a")
    try:
        for rate in args.rates:
            subprocess.run(["bash", os.path.join(ROOT, "tests/cluster/start.sh"), str(RANKS), rate, "1"], check=True)
            launcher = experiments.Launcher(mpiexec, log, timeout=1800)
            for seed in args.seeds:
                for g, ((flags, times), members) in enumerate(groups(args.only)):
                    out = os.path.join(runs, rate, f"seed{seed}", f"group{g}")
                    print(f"{rate}, seed {seed}: {', '.join(r for r, _ in members)}", flush=True)
                    steps = args.steps * times
                    extra = experiments.FASHION + ("--width", "256", "--seed", str(seed),
                                                   "--compute-ms", f"{args.compute_ms:g}") + tuple(flags)
                    try:
                        summaries = launcher.compare(RANKS, out, [a for _, a in members], (args.lr,), steps,
                                                     extra=extra, evals=max(1, steps // EVAL_EVERY))
                    except RuntimeError as exc:  # e.g. a loss gone to NaN: recorded, the others go on
                        print(f"  failed: {exc}", flush=True)
                        summaries = []
                    for row, algorithm in members:
                        s = next((s for s in summaries if s["algorithm"] == algorithm), None)
                        if s is None:
                            records.append({"rate": rate, "seed": seed, "row": row, "flags": list(flags),
                                            "failed": True, "steps": steps, "curve": []})
                            continue
                        records.append({"rate": rate, "seed": seed, "row": row, "flags": list(flags),
                                        **experiments._record(s), "curve": experiments.load_curve(
                                            experiments.run_dir(out, algorithm, s["lr"]))})
    finally:
        subprocess.run(["bash", os.path.join(ROOT, "tests/cluster/stop.sh")])
        log.close()
    meta = {"commit": setup.commit(), "versions": setup.versions(),
            "command": " ".join(sys.argv), "ranks": RANKS, "steps": args.steps, "compute_ms": args.compute_ms,
            "lr": args.lr, "inner_steps": INNER, "machine": setup.machine()}
    path = os.path.join(args.out, args.name)
    if args.only and os.path.exists(path + ".json"):  # the other rows from the earlier run, same settings
        with open(path + ".json") as f:
            earlier = json.load(f)
        for key in ("steps", "compute_ms", "lr", "inner_steps"):
            if earlier["meta"][key] != meta[key]:
                raise SystemExit(f"--only: the earlier run had {key} {earlier['meta'][key]}, this one {meta[key]}")
        meta = dict(earlier["meta"], reruns=earlier["meta"].get("reruns", []) + [
            {"rows": args.only, "commit": meta["commit"], "command": meta["command"]}])
        records = [r for r in earlier["runs"] if r["row"] not in args.only] + records
    with open(path + ".json", "w") as f:
        json.dump({"meta": meta, "runs": records}, f, indent=1)
    with open(path + ".md", "w") as f:
        f.write(table(meta, records))
    print(table(meta, records))


def table(meta, records):
    import numpy as np
    model_bytes = 4 * MLP_PARAMETERS
    lines = [f"Fashion-MNIST, MLP width 256 ({model_bytes / 1e6:.2f} MB), {meta['ranks']} ranks on 4 emulated nodes "
             f"(one each), {meta['steps']} steps (x2 where marked), lr {meta['lr']:g} (SGD, momentum 0.9 unless "
             f"marked), evaluations every {EVAL_EVERY} steps, every step sleeps "
             f"{meta['compute_ms']:g} ms; `{meta['command']}` at {meta['commit']} ({meta['versions']}).",
             "Time: training time (evaluations excluded), mean over seeds; ratio: to AllReduce's in the same "
             "seed, median; to target: the time until the mean model first reached AllReduce's mean final "
             "accuracy less one point (runs that reached it / seeds); bytes: sent per rank per step, counted "
             "from the algorithm."]
    for rerun in meta.get("reruns", []):
        lines.append(f"Rerun at {rerun['commit']}: {', '.join(rerun['rows'])} (`{rerun['command']}`).")
    lines.append("")
    for rate in dict.fromkeys(r["rate"] for r in records):
        at = [r for r in records if r["rate"] == rate]
        ar = {r["seed"]: r for r in at if r["row"] == "AllReduce"}
        target = float(np.mean([r["final_accuracy"] for r in ar.values()])) - 0.01 if ar else None
        lines += [f"**{rate}** (target accuracy {target:.4f})" if target else f"**{rate}**", "",
                  "| configuration | steps | final accuracy (min-max) | time s | time / AllReduce | ms/step "
                  "| to target s (reached) | bytes/step |", "|---|---|---|---|---|---|---|---|"]
        for row, algorithm, flags, times in CONFIGS:
            every = [r for r in at if r["row"] == row]
            rs = [r for r in every if not r.get("failed")]
            if len(rs) < len(every):
                lines.append(f"| {row} | {meta['steps'] * times} | failed in {len(every) - len(rs)} of {len(every)} "
                             "seeds (loss NaN) | | | | | |")
            if not rs:
                continue
            acc = [r["final_accuracy"] for r in rs]
            seconds = [r["curve"][-1]["time_s"] if r["curve"] else r["wall_time_s"] for r in rs]
            ratios = [t / (ar[r["seed"]]["curve"][-1]["time_s"]) for r, t in zip(rs, seconds) if r["seed"] in ar]
            reach = [findings.time_to_accuracy(r["curve"], target) for r in rs] if target else []
            got = [t for t in reach if t is not None]
            ms = [1e3 * r["time_per_step_s"] for r in rs if "time_per_step_s" in r]
            lines.append(f"| {row} | {rs[0]['steps']} | {np.mean(acc):.4f} ({min(acc):.4f}-{max(acc):.4f}) | "
                         f"{np.mean(seconds):.1f} | {np.median(ratios):.2f} | {np.mean(ms):.1f} | "
                         f"{np.mean(got) if got else float('nan'):.1f} ({len(got)}/{len(rs)}) | "
                         f"{bytes_per_step(algorithm, flags, model_bytes) / 1e6:.3f} MB |")
        lines.append("")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
