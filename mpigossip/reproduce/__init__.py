"""``python -m mpigossip reproduce``: run the experiments that test the papers' findings and
write a report (markdown + PNG) with a computed verdict for each.

Not an MPI program itself: it launches ``python -m mpigossip compare`` jobs (each one MPI
job, :mod:`.experiments`), runs the simulator (:mod:`.simulate`), judges the findings
(:mod:`.findings`) and writes ``OUT/report.md`` and its figures (:mod:`.report`); the
raw records go to ``OUT/results.json`` and the jobs' output to ``OUT/jobs.log``.
"""

import json
import os
import shlex
import sys
import time


def main(args):
    from . import experiments, findings, report, setup, simulate

    setting = experiments.for_problem(experiments.SETTINGS["quick" if args.quick else "default"], args.dataset)
    os.makedirs(args.out, exist_ok=True)
    mpiexec = shlex.split(args.mpiexec) if args.mpiexec else experiments.default_mpiexec()
    timed_mpiexec = shlex.split(args.timed_mpiexec) if args.timed_mpiexec else mpiexec
    try:
        flags = experiments.problem(args.dataset, args.data_dir)
        if args.dataset == "fashion-mnist":
            from ..train.data import fashion_mnist_files
            fashion_mnist_files(args.data_dir)  # missing files: one line naming the package, before any job
    except ValueError as exc:
        print(f"python -m mpigossip reproduce: error: {exc}", file=sys.stderr, flush=True)
        return 2
    t0 = time.perf_counter()
    commit = setup.commit()  # the code the runs use (later edits of the tree do not count)

    def progress(message):
        print(f"[{time.perf_counter() - t0:6.0f} s] {message}", flush=True)

    def shown(cmd):  # a launcher inside the working folder as a relative path: the report is read elsewhere
        first = cmd[0]
        if os.path.isabs(first) and first.startswith(os.getcwd() + os.sep):
            first = os.path.relpath(first)
        return shlex.join([first] + list(cmd[1:]))

    timed_error = None
    timed_on = {"line": (
        f"- timed runs: `{shown(timed_mpiexec)}` ({setup.cluster(timed_mpiexec)}), {setting['timed_size']} ranks, "
        + ("CNN width 64" if args.dataset == "cifar10" else f"MLP width {setting['timed_width']}")
        + f", lr {setting['timed_lr']:g}, {setting['timed_steps']} steps, fixed compute model: every step sleeps "
        f"{setting['timed_compute_ms']:g} ms (x2 on the straggler), cases "
        f"{', '.join(setting['timed_cases'])}, {setting['timed_repeats']} interleaved repeat(s); ms/step and "
        "time to accuracy exclude evaluations"
        + ("" if args.timed_mpiexec else " (on this machine: communication is nearly free here)")),
        "on_cluster": bool(args.timed_mpiexec)}
    with open(os.path.join(args.out, "jobs.log"), "a" if args.resume else "w") as log:
        try:
            if args.accuracy_from:
                records = reused_accuracy_runs(args.accuracy_from, setting)
                progress(f"accuracy runs: {len(records)} reused from {args.accuracy_from}")
            else:
                records = experiments.accuracy_runs(
                    experiments.Launcher(mpiexec, log, timeout=args.timeout, resume=args.resume),
                    args.out, setting, progress, flags)
        except (RuntimeError, ValueError) as exc:
            print(f"python -m mpigossip reproduce: error: {exc}", file=sys.stderr, flush=True)
            return 1
        timed_from = getattr(args, "timed_from", None)
        try:
            if timed_from:
                timed, timed_on = reused_timed_runs(timed_from, setting)
                progress(f"timed runs: {len(timed)} reused from {timed_from}")
            else:
                timed = experiments.timed_runs(
                    experiments.Launcher(timed_mpiexec, log, timeout=args.timeout, resume=args.resume),
                    args.out, setting, progress, flags)
        except ValueError as exc:
            print(f"python -m mpigossip reproduce: error: {exc}", file=sys.stderr, flush=True)
            return 1
        except RuntimeError as exc:  # the report is still written, without them; exit status 1
            timed, timed_error = [], str(exc)
            print(f"python -m mpigossip reproduce: error: {exc}; the report has no timed runs",
                  file=sys.stderr, flush=True)
    progress("simulator: consensus curves")
    curves = simulate.consensus_curves(setting["consensus_size"], setting["consensus_steps"])
    sim_records = simulate.sgd_scaling(setting["sim_sizes"], setting["sim_steps"], setting["sim_seeds"], progress)
    speeds, speed_setting = [], ""
    calibration = getattr(args, "calibration", None)
    if calibration and calibration != "none":
        if os.path.exists(calibration):
            progress("time model: the simulated schemes' steps per second")
            mb, compute_ms = simulate.TIMED_MB, setting["timed_compute_ms"]
            speeds = simulate.predicted_speeds(calibration, setting["sim_sizes"], mb=mb, compute=compute_ms / 1e3)
            speed_setting = (f"the time model calibrated in `{os.path.basename(calibration)}`, the timed runs' "
                             f"workload ({mb:g} MB, {compute_ms:g} ms of compute a step), 2 ranks per node, 1 Gbit "
                             "links")
        else:
            progress(f"time model: no calibration at {calibration}: (d-sim) without times")
    minutes = (time.perf_counter() - t0) / 60

    judged = findings.judge(records, timed, sim_records, timed_on_cluster=timed_on["on_cluster"],
                            sim_speeds=speeds, speed_setting=speed_setting)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"accuracy_runs": records, "timed_runs": timed, "timed_on": timed_on, "simulator": sim_records,
                   "simulator_speeds": speeds, "consensus_curves": curves}, f)

    shown_flags = " ".join(os.path.basename(a) if os.path.isabs(a) else a for a in flags)  # no machine paths
    command = [os.path.basename(a) if os.path.isabs(a) else a for a in sys.argv[2:]]
    header = [f"Made by `{' '.join(['python -m mpigossip reproduce'] + command)}` on "
              f"{time.strftime('%Y-%m-%d %H:%M')} in {minutes:.1f} min ({'quick' if args.quick else 'default'} mode), "
              f"at commit {commit}; {setup.versions()}.",
              "",
              f"- machine: {setup.machine()}",
              f"- accuracy runs: `{shown(mpiexec)}`, p = {', '.join(map(str, setting['sizes']))} ranks on this "
              f"machine's {os.cpu_count()} cores (oversubscribed: accuracy only, never timed), "
              f"{len(setting['seeds'])} seed(s) (initialisation and batches; the data split is fixed, so runs pair "
              f"by seed), {setting['steps']} steps, step sizes {', '.join(map(str, setting['lrs']))}, SGD with "
              f"momentum 0.9, batch 32 per rank; problem: `{shown_flags}`"
              + (" (10 classes of 8 Gaussian clusters, 20% noisy training labels)" if args.dataset == "synthetic"
                 else ""),
              timed_on["line"],
              f"- simulator: softmax regression on the synthetic data, plain SGD, batch 16, {setting['sim_steps']} steps, "
              f"lr {', '.join(map(str, simulate.SIM_LRS))}",
              "- verdicts: computed by the rule stated under each finding (mpigossip/reproduce/findings.py)"]
    if args.quick:
        header[1:1] = ["", "**Quick mode is a smoke test of the pipeline, not a reproduction**: one seed decides no "
                       "paired comparison (every verdict that needs one reads \"not decided\"), and (d) compares "
                       "p = 4 with 8, not 8 with 16. The verdicts come from the full run: `python -m mpigossip "
                       "reproduce` (README, \"Reproducing the papers\")."]
    if args.accuracy_from:
        header.append(f"- **the accuracy runs are reused** from `{os.path.basename(args.accuracy_from)}` of an earlier "
                      "run (`--accuracy-from`): the commit above made "
                      + ("the simulator and the time model only" if timed_from else "the timed runs and the simulator only"))
    if timed_from:
        header.append(f"- **the timed runs are reused** from `{os.path.basename(timed_from)}` of an earlier run "
                      "(`--timed-from`; the line above is that run's)")
    if timed_error:
        header.append(f"- **the timed runs failed**: {timed_error}")
    path = report.write(args.out, findings=judged, records=records, timed=timed, sim_records=sim_records,
                        curves=curves, consensus_p=setting["consensus_size"], header=header)
    progress(f"wrote {path}")
    for f in judged:
        print(f"  ({f.key}) {f.verdict}: {f.claim}")
    return 1 if timed_error else 0


def reused_timed_runs(path, setting):
    """The timed runs of an earlier ``results.json`` and where they ran (``{"line": the report's
    line on them, "on_cluster": bool}``; for a file older than that record, its report's line
    beside it); ``ValueError`` unless they hold every case and repeat of ``setting`` at its size
    and steps."""
    try:
        with open(path) as f:
            data = json.load(f)
        timed = data["timed_runs"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--timed-from {path}: not a reproduction's results.json ({exc})") from None
    have = {(r.get("case"), r.get("repeat")) for r in timed
            if r.get("world_size") == setting["timed_size"] and r.get("steps") == setting["timed_steps"]}
    want = {(case, repeat) for case in setting["timed_cases"] for repeat in range(setting["timed_repeats"])}
    if not timed or not want <= have:
        raise ValueError(f"--timed-from {path}: its timed runs are not this mode's ({setting['timed_size']} ranks, "
                         f"{setting['timed_steps']} steps, cases {', '.join(setting['timed_cases'])} x "
                         f"{setting['timed_repeats']} repeats)")
    timed_on = data.get("timed_on")
    if not timed_on:
        line = None
        try:
            with open(os.path.join(os.path.dirname(path), "report.md")) as f:
                line = next((x.rstrip("\n") for x in f if x.startswith("- timed runs: ")), None)
        except OSError:
            pass
        if line is None:
            raise ValueError(f"--timed-from {path}: it does not say where its timed runs ran (no report.md beside it)")
        timed_on = {"line": line, "on_cluster": "on this machine: communication is nearly free" not in line}
    return timed, timed_on


def reused_accuracy_runs(path, setting):
    """The accuracy runs of an earlier ``results.json``; ``ValueError`` unless they are the
    grid ``setting`` would run (its world sizes, step sizes, seeds and steps)."""
    try:
        with open(path) as f:
            records = json.load(f)["accuracy_runs"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--accuracy-from {path}: not a reproduction's results.json ({exc})") from None
    grid = {(r["world_size"], float(r["lr"]), r["seed"], r["steps"]) for r in records}
    want = {(p, float(lr), seed, setting["steps"]) for p in setting["sizes"] for lr in setting["lrs"]
            for seed in setting["seeds"]}
    if not records or not want <= grid:
        raise ValueError(f"--accuracy-from {path}: its accuracy runs are not this mode's grid (world sizes "
                         f"{setting['sizes']}, step sizes {setting['lrs']}, seeds {setting['seeds']}, "
                         f"{setting['steps']} steps)")
    return records
