"""The experiments of ``reproduce``: which ``compare`` jobs run, how they are launched, and
their results loaded back.

Each experiment is one ``python -m mpigossip compare`` MPI job (a subprocess under the
chosen launcher), so the runs are exactly what a user gets from the command line.
"""

import json
import os
import shlex
import subprocess
import sys
import time

from ..train.table import run_dir

#: The default problem: Fashion-MNIST (real images, 60000 training / 10000 test) with a
#: 784-128-10 MLP: a step costs about a millisecond on one core, so p = 16 fits on 2 cores,
#: and it is hard enough that the methods end apart (about 85-89% test accuracy).
FASHION = ("--dataset", "fashion-mnist", "--model", "mlp")
#: The synthetic problem of earlier reports: 10 classes of 8 Gaussian clusters each in 12
#: dimensions (not linearly separable) with 20% of the training labels noisy.
PROBLEM = ("--dataset", "synthetic", "--samples", "10000", "--features", "12", "--classes", "10",
           "--clusters", "8", "--label-noise", "0.2", "--model", "mlp")


def problem(dataset="fashion-mnist", data_dir=None):
    """The training flags of every run: Fashion-MNIST (default; ``data_dir`` overrides where
    its files are), the synthetic :data:`PROBLEM`, or CIFAR-10 from ``data_dir`` with the
    small CNN (for a user with the data and the compute; hours on 2 cores). The data split is
    the same for every seed (``--data-seed`` 0): the seeds pair."""
    if dataset == "cifar10":
        if not data_dir:
            raise ValueError("reproduce --dataset cifar10 needs --data-dir (CIFAR-10's python batches)")
        return ("--dataset", "cifar10", "--data-dir", os.path.abspath(data_dir), "--model", "cnn")
    if dataset == "synthetic":
        return PROBLEM
    return FASHION + (("--data-dir", os.path.abspath(data_dir)) if data_dir else ())

#: The methods of Jin et al. (AllReduce, EASGD, gossip) and SGP (Assran et al.); OSGP's
#: claim is about slow nodes: it runs in the timed runs.
ALGORITHMS = ("allreduce", "easgd", "gossip-pull", "gossip-push", "sgp")
#: The asynchronous methods of Jin et al.
ASYNC = ("easgd", "gossip-pull", "gossip-push")

SETTINGS = {
    # 1200 steps: on Fashion-MNIST at p = 8 and the small step, AllReduce's and EASGD's test loss fell
    # 0.43 -> 0.37 from step 600 to 1200 and by under 1% more to 1600 (measured before choosing).
    "default": {"sizes": (4, 8, 16), "seeds": (0, 1, 2), "steps": 1200, "lrs": (0.01, 0.3),
                "algorithms": ALGORITHMS, "timed_steps": 100, "timed_width": 256, "timed_size": 8,
                "timed_repeats": 3, "timed_compute_ms": 200, "timed_cases": ("normal", "straggler", "delays"),
                "evals": 15, "timed_evals": 6,  # evaluations cost 8 ranks on 2 cores more than 100 steps
                "sim_sizes": (4, 16, 64, 256), "sim_steps": 400, "sim_seeds": (0, 1, 2),
                "consensus_size": 1024, "consensus_steps": 30},
    # A smoke test of the pipeline (every stage, report and figure), not a reproduction: one seed
    # decides no paired comparison, and (d) compares p = 4 with 8 instead of 8 with 16.
    "quick": {"sizes": (2, 4), "seeds": (0,), "steps": 80, "lrs": (0.01, 0.3),
              "algorithms": ("allreduce", "easgd", "gossip-push", "sgp"), "timed_steps": 40, "timed_width": 256,
              "timed_size": 4, "timed_repeats": 1, "timed_compute_ms": 5, "timed_cases": ("normal", "straggler"),
              "evals": 6, "timed_evals": 6,  # an evaluation at p = 16 on 2 cores costs about what 10 steps do
              "problem_extra": ("--samples", "12000"),  # a fifth of Fashion-MNIST's training split
              "sim_sizes": (4, 16, 64), "sim_steps": 150, "sim_seeds": (0,),
              "consensus_size": 256, "consensus_steps": 20},
}

#: The timed runs: the same problem, an MLP of ``timed_width`` hidden units (1.08 MB of
#: parameters at 256 on Fashion-MNIST, like the network benchmark's P4 model), the large step
#: size, and a fixed compute model (``--compute-ms``: every step sleeps the same time, rank 1
#: twice that with the straggler) long enough that computation, not the 2 shared cores or the
#: link, paces a step: with communication dominating (a 3 MB model, 50 ms of compute, 8 ranks
#: on 2 cores) even synchronous SGP kept 0.94 of its pace with a straggler, and the measurement
#: could not tell a tolerant method from an intolerant one. Every algorithm computes alike.
#: Cases: ``normal``; ``straggler`` (rank 1 permanently 2x slow); ``delays`` (each rank, each
#: step, sleeps 2x the compute time with probability 0.2: transient slowdowns). Synchronous
#: SGP is the negative control: it must lose what AllReduce loses. EASGD is left out: its
#: center on one rank takes every worker's pull and push through one node's link.
TIMED_ALGORITHMS = ("allreduce", "sgp", "osgp", "agp", "gossip-push")
STRAGGLER_ALGORITHMS = ("allreduce", "sgp", "osgp", "agp")
#: The (small, large) step sizes per problem, SGD with momentum 0.9: on Fashion-MNIST the
#: synthetic problem's large step (0.3) made gossip's ranks diverge (a NaN at p = 4); the
#: large step of the timed runs is the larger one.
STEP_SIZES = {"fashion-mnist": (0.01, 0.1), "synthetic": (0.01, 0.3), "cifar10": (0.01, 0.1)}


def for_problem(setting, dataset):
    """``setting`` with the step sizes of ``dataset``."""
    lrs = STEP_SIZES[dataset]
    return dict(setting, lrs=lrs, timed_lr=max(lrs))


def timed_case_flags(case, compute_ms):
    """The extra training flags of a timed case."""
    return {"normal": (), "straggler": ("--straggler", "1:2"),
            "delays": ("--delay-prob", "0.2", "--delay-ms", f"{2 * compute_ms:g}")}[case]


def default_mpiexec():
    """``mpigossip-mpiexec`` beside this Python (local-run defaults), else ``mpiexec``."""
    here = os.path.join(os.path.dirname(sys.executable), "mpigossip-mpiexec")
    return [here] if os.access(here, os.X_OK) else ["mpiexec"]


class Launcher:
    """Runs ``compare`` jobs under one ``mpiexec`` command line and logs each launch.

    Args:
        mpiexec: the launcher's words (e.g. ``["tests/cluster/mpiexec", "--map-by", "node"]``).
        log: a file object for the jobs' output.
        timeout: seconds one job may take before it is killed (an error).
        resume: reuse a job whose ``compare.json`` in its output folder already holds every
            run it would make (an interrupted reproduction continues where it stopped).
    """

    def __init__(self, mpiexec, log, *, timeout=1800, resume=False):
        self.mpiexec, self.log, self.timeout, self.resume = list(mpiexec), log, timeout, resume

    def compare(self, size, out, algorithms, lrs, steps, extra=(), evals=15):
        """One ``compare`` job of ``size`` ranks writing into ``out`` (about ``evals``
        evaluations per run); returns its summaries. Raises ``RuntimeError`` naming the log
        when the job fails."""
        cmd = self.mpiexec + ["-n", str(size), sys.executable, "-m", "mpigossip", "compare",
                              "--algorithms", *algorithms, "--lrs", *map(str, lrs), "--steps", str(steps),
                              "--eval-every", str(max(1, steps // evals)), "--quiet", "--out", out, *extra]
        if self.resume:
            done = load_summaries(out)
            if sorted((s["algorithm"], s["lr"]) for s in done) == sorted((a, float(lr)) for a in algorithms
                                                                           for lr in lrs):
                self.log.write(f"# reused (--resume): {shlex.join(cmd)}\n")
                return done
        self.log.write(f"$ {shlex.join(cmd)}\n")
        self.log.flush()
        stale = os.path.join(out, "compare.json")
        if os.path.exists(stale):
            os.remove(stale)  # written by rank 0 only once every run has finished
        t0 = time.perf_counter()
        try:
            done = subprocess.run(cmd, stdout=self.log, stderr=subprocess.STDOUT, timeout=self.timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"reproduce: a job ran past {self.timeout} s: {shlex.join(cmd)}") from None
        self.log.write(f"# exit {done.returncode} after {time.perf_counter() - t0:.1f} s\n")
        self.log.flush()
        summaries = load_summaries(out)
        if len(summaries) != len(algorithms) * len(lrs):
            raise RuntimeError(f"reproduce: job failed (exit {done.returncode}): {shlex.join(cmd)}; "
                               f"see {self.log.name}")
        if done.returncode != 0:  # e.g. a launcher that hung after every rank had finished
            self.log.write(f"# every run finished and wrote its summary; exit {done.returncode} ignored\n")
        return summaries


def load_summaries(out):
    path = os.path.join(out, "compare.json")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return json.load(f)


def load_curve(run_dir):
    """The evaluations of one run (``metrics-rank0.jsonl``): a list of dicts with ``steps``,
    ``time_s`` (training time: evaluations excluded), ``loss``, ``accuracy`` (of the center
    for EASGD and ASGD, else of the mean model), ``consensus``, ``rank_accuracy``."""
    points = []
    with open(os.path.join(run_dir, "metrics-rank0.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if "test_loss" in r:
                points.append({"steps": r.get("steps_done", r["step"] + 1), "time_s": r.get("train_s", r["time_s"]),
                               "loss": r.get("center_loss", r["test_loss"]),
                               "accuracy": r.get("center_accuracy", r["test_accuracy"]),
                               "consensus": r["consensus_distance"], "rank_accuracy": r["rank_accuracy_mean"]})
    return points


def accuracy_runs(launcher, root, setting, progress, flags=PROBLEM):
    """The step-size x world-size x seed grid; returns a list of run records."""
    records = []
    more = setting.get("problem_extra", ()) if "fashion-mnist" in flags else ()
    for size in setting["sizes"]:
        algorithms, lrs = setting["algorithms"], setting["lrs"]
        for seed in setting["seeds"]:
            out = os.path.join(root, "runs", f"p{size}-seed{seed}")
            progress(f"p = {size}, seed {seed}: {len(algorithms)} algorithms x {len(lrs)} step sizes")
            for s in launcher.compare(size, out, algorithms, lrs, setting["steps"],
                                      extra=tuple(flags) + more + ("--seed", str(seed)),
                                      evals=setting["evals"]):
                records.append({**_record(s), "seed": seed,
                                "curve": load_curve(run_dir(out, s["algorithm"], s["lr"]))})
    return records


def timed_runs(launcher, root, setting, progress, flags=PROBLEM):
    """Wall-time runs (meant for the emulated or a real cluster) under the fixed compute model:
    every case ``timed_repeats`` times, interleaved, so that comparisons pair by repeat."""
    size, steps, compute_ms = setting["timed_size"], setting["timed_steps"], setting["timed_compute_ms"]
    width = setting["timed_width"] if "mlp" in flags else 64  # the CNN's width: its first layer's channels
    extra = tuple(flags) + ("--width", str(width), "--seed", "0", "--compute-ms", f"{compute_ms:g}")
    records = []
    for repeat in range(setting["timed_repeats"]):
        for case in setting["timed_cases"]:
            algorithms = TIMED_ALGORITHMS if case == "normal" else STRAGGLER_ALGORITHMS
            out = os.path.join(root, "timed", f"{case}-{repeat}")
            progress(f"timed, {case}, repeat {repeat + 1}/{setting['timed_repeats']}: {size} ranks, "
                     + ", ".join(algorithms))
            for s in launcher.compare(size, out, algorithms, (setting["timed_lr"],), steps,
                                      extra=extra + timed_case_flags(case, compute_ms),
                                      evals=setting["timed_evals"]):
                records.append({**_record(s), "case": case, "repeat": repeat,
                                "curve": load_curve(run_dir(out, s["algorithm"], s["lr"]))})
    return records


def _record(summary):
    """The figures of one run. EASGD (and ASGD) are judged on their center, the model they
    train; the mean of the ranks' models is kept beside it (``mean_model_*``)."""
    keys = ("algorithm", "world_size", "lr", "steps", "final_loss", "final_accuracy", "consensus_distance",
            "time_per_step_s", "throughput_steps_s", "wall_time_s", "comm_time_s", "compute_time_s", "wait_time_s", "blocked_in_mpi_s",
            "rank_accuracy_mean", "rank_accuracy_min")
    record = {k: summary[k] for k in keys if k in summary}
    if "center_loss" in summary:
        record.update(mean_model_loss=record["final_loss"], mean_model_accuracy=record["final_accuracy"],
                      final_loss=summary["center_loss"], final_accuracy=summary["center_accuracy"])
    return record
