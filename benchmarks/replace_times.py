"""How long a training job takes to grow back after a failure (#45): ``train --on-failure replace``
with one rank killed, at model sizes where the heal's transfer counts.

    python benchmarks/replace_times.py [--widths 2000 5000] [--algorithms sgp allreduce]
        [--ranks 4] [--steps 40] [--kill-at 15] [--victim 2] [--compute-ms 0]
        [--mpiexec "tests/cluster/mpiexec --map-by node"] [--heal-modes beside wait]
        [--out benchmarks/results] [--name replace-times]

Each run trains the digits MLP (two hidden layers of ``--widths`` units: 2000 is 16 MB of float32
parameters, 5000 is 100 MB) under ``MPIEXEC --with-ft ulfm`` (default: the venv's
``mpigossip-mpiexec``, one node; ``tests/cluster/mpiexec --map-by node`` across the emulated
nodes) and kills rank ``--victim`` at step ``--kill-at``. From each run's ``summary.json``: the
survivors' recovery, the spawn, the heal (from the rebuilt algorithm to every rank loaded:
the PushSum family sends half the numerators, then the donor's optimizer state, raw after a
pickled skeleton; AllReduce and D-PSGD the state with the model; with its parts: split, handover,
load), and from the recovery to the job back at full size;
every run must end at its size with its mass exact (PushSum family) and only the victim failed
(``--repeats``: runs of each). The survivors train on while the newcomer starts: the table gives
the steps they took meanwhile and the seconds they did not train (``idle``); with
``--compute-ms`` (every step's fixed compute, a sleep) the steps left after the kill last long enough
for the newcomer to start before the end. An asynchronous method (AGP) heals beside training:
its donor trains on while its sends go (the table's "donor sending": their seconds and the steps it
took meanwhile); ``--heal-modes beside wait`` runs it both ways, alternated (``wait``:
``MPIGOSSIP_HEAL_BESIDE=0``, the heal that waits for its transfers, as every other method's).
``idle`` is rank 0's time not training from the growth's start to its return to training. Writes ``OUT/NAME.json``
(the summaries, the commit and versions) and ``OUT/NAME.md``; exits 1 if a run failed.
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from mpigossip.core import provenance  # noqa: E402
from mpigossip.train.handover import HEAL_BESIDE, weight_accounted  # noqa: E402


def model_mb(width, inputs=64, classes=10):
    """The MLP's parameters in MB of float32 (two hidden layers of ``width``)."""
    return 4 * (inputs * width + width + width * width + width + width * classes + classes) / 2 ** 20


def run(args, algorithm, width, folder, mode="beside"):
    launcher = shlex.split(args.mpiexec) if args.mpiexec else [
        os.path.join(os.path.dirname(sys.executable), "mpigossip-mpiexec")]
    cmd = [*launcher[:1], "--with-ft", "ulfm", *launcher[1:], "-n", str(args.ranks), sys.executable, "-m", "mpigossip",
           "train", "--algorithm", algorithm, "--width", str(width), "--steps", str(args.steps),
           "--on-failure", "replace", "--kill", f"{args.victim}:{args.kill_at}", "--quiet", "--timeout", "120",
           *(["--compute-ms", str(args.compute_ms)] if args.compute_ms else []),
           "--out", folder]
    t0 = time.monotonic()
    env = dict(os.environ, **{HEAL_BESIDE: "0" if mode == "wait" else "1"})
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    path = os.path.join(folder, "summary.json")
    summary = json.load(open(path)) if proc.returncode == 0 and os.path.exists(path) else None
    return proc, summary, time.monotonic() - t0


def row(algorithm, width, summary):
    f = summary["failures"][0]
    r = f["replaced"]
    exact = "weight_sum" not in summary or abs(summary["weight_sum"][0] - weight_accounted(summary)) < 1e-9
    return {"algorithm": algorithm, "width": width, "model_mb": round(model_mb(width), 1),
            "failed_ranks": [r for f in summary["failures"] for r in f["ranks"]],
            "world_size": summary["world_size"], "recovery_s": f["recovery_s"], "spawn_s": r["spawn_s"],
            "heal_s": r["heal_s"], "heal_parts": r.get("heal_parts", {}), "back_after_recovery_s": r["back_at_s"] - f["recovered_at_s"],
            "steps_beside": r.get("steps_beside", 0), "pause_s": r.get("pause_s"),
            # rank 0's time not training (recorded since the heal beside training; before, the first
            # survivor's time before the heal's closing gather)
            "idle_s": r.get("idle_s", r["total_s"] - r.get("beside_s", 0.0)),
            "beside_heal": bool(r.get("beside_heal")), "stream_s": r.get("heal_parts", {}).get("stream_s"),
            "stream_steps": r.get("heal_parts", {}).get("stream_steps"), "ready_s": r.get("ready_s"),
            "pause_parts": r.get("pause_parts"),
            "newcomer_host": r["hosts"].get(str(r["ranks"][0])) if r["ranks"] else None,
            "final_accuracy": summary["final_accuracy"], "mass_exact": exact}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--widths", type=int, nargs="+", default=[2000, 5000])
    p.add_argument("--algorithms", nargs="+", default=["sgp", "allreduce"])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--kill-at", type=int, default=15)
    p.add_argument("--victim", type=int, default=2)
    p.add_argument("--compute-ms", type=float, default=0.0, help="every step's fixed compute (train --compute-ms)")
    p.add_argument("--mpiexec", default=None, help="launcher command (default: the venv's mpigossip-mpiexec)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--name", default="replace-times")
    p.add_argument("--repeats", type=int, default=1, help="runs of each method and width")
    p.add_argument("--heal-modes", nargs="+", choices=["beside", "wait"], default=["beside"],
                   help="an asynchronous method's (AGP's) heal beside training, or waiting for its transfers "
                        "(MPIGOSSIP_HEAL_BESIDE=0); several: alternated, run by run")
    args = p.parse_args(argv)
    rows, failed = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for width in args.widths:
            for algorithm in args.algorithms:
                for repeat, mode in [(k, m) for k in range(args.repeats) for m in args.heal_modes]:
                    folder = os.path.join(tmp, f"{algorithm}-{width}-{repeat}-{mode}")
                    proc, summary, seconds = run(args, algorithm, width, folder, mode)
                    if summary is None or summary["world_size"] != args.ranks:
                        failed.append(f"{algorithm} width {width}: exit {proc.returncode}\n{proc.stdout[-2000:]}"
                                      f"{proc.stderr[-2000:]}")
                        continue
                    rows.append(dict(row(algorithm, width, summary), run_s=seconds, heal_mode=mode))
                    print(f"replace_times: {json.dumps(rows[-1])}", flush=True)
                    if rows[-1]["failed_ranks"] != [args.victim]:   # one kill must cost one rank
                        failed.append(f"{algorithm} width {width}: ranks {rows[-1]['failed_ranks']} failed where "
                                      f"only {args.victim} was killed\n{proc.stderr[-2000:]}")
    os.makedirs(args.out, exist_ok=True)
    where = args.mpiexec or "mpigossip-mpiexec (one node)"
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as f:
        json.dump({"commit": provenance.commit(), "versions": provenance.versions(), "launcher": where,
                   "ranks": args.ranks, "steps": args.steps, "kill_at": args.kill_at, "victim": args.victim,
                   "compute_ms": args.compute_ms, "command": " ".join(sys.argv),
                   "pythonpath": os.environ.get("PYTHONPATH"),   # (a checkout other than this one's runs)
                   "rows": rows, "failed": failed}, f, indent=2)
    with open(os.path.join(args.out, f"{args.name}.md"), "w") as f:
        f.write(f"# Growing back: rank {args.victim} of {args.ranks} killed at step {args.kill_at} ({where})\n\n")
        f.write("| method | heal | model MB | recovery (s) | spawn (s) | steps beside | pause (s) | heal (s) | of it: "
                "split, handover, load (s) | donor sending (s, steps) | back at full size after the recovery (s) | "
                "survivors idle (s) | newcomer on | accuracy | mass exact |\n"
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
        for r in rows:
            parts = ", ".join(f"{r['heal_parts'][k]:.2f}" if k in r["heal_parts"] else "-"
                              for k in ("split_s", "handover_s", "load_s"))
            streamed = f"{r['stream_s']:.2f}, {r['stream_steps']:.0f}" if r.get("stream_s") is not None else "-"
            pause = f"{r['pause_s']:.2f}" if r.get("pause_s") is not None else "-"
            f.write(f"| {r['algorithm']} | {'beside' if r['beside_heal'] else 'wait'} | {r['model_mb']} | "
                    f"{r['recovery_s']:.3f} | {r['spawn_s']:.2f} | {r['steps_beside']} | {pause} | {r['heal_s']:.2f} | "
                    f"{parts} | {streamed} | {r['back_after_recovery_s']:.2f} | {r['idle_s']:.2f} | "
                    f"{r['newcomer_host']} | {r['final_accuracy']:.4f} | {r['mass_exact']} |\n")
        for failure in failed:
            f.write(f"\nFailed: {failure.splitlines()[0]}\n")
        f.write(f"\nCommit {provenance.commit()}; {provenance.versions()}.\n")
    for failure in failed:
        print(f"replace_times: FAILED {failure}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
