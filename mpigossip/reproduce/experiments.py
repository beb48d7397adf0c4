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

#: The problem of the accuracy runs: 10 classes of 8 Gaussian clusters each in 12 dimensions
#: (not linearly separable, so the MLP has to learn a non-linear boundary) with 20% of the
#: training labels noisy. The bundled digits are too easy (every method reaches 95-99%);
#: this one ends between 70% and 85% after 300 steps, where the methods separate, and an
#: MLP step costs a few ms, so p = 16 fits on 2 cores.
PROBLEM = ("--dataset", "synthetic", "--samples", "10000", "--features", "12", "--classes", "10",
           "--clusters", "8", "--label-noise", "0.2", "--model", "mlp")


def problem(data_dir=None):
    """The training flags of every run: :data:`PROBLEM`, or CIFAR-10 from ``data_dir`` with
    the small CNN (for a user with the data and the compute; hours on 2 cores)."""
    if data_dir:
        return ("--dataset", "cifar10", "--data-dir", os.path.abspath(data_dir), "--model", "cnn")
    return PROBLEM

#: The methods of Jin et al. (AllReduce, EASGD, gossip) and SGP (Assran et al.); OSGP's
#: claim is about slow nodes: it runs in the timed runs.
ALGORITHMS = ("allreduce", "easgd", "gossip-pull", "gossip-push", "sgp")
#: The asynchronous methods of Jin et al.
ASYNC = ("easgd", "gossip-pull", "gossip-push")

SETTINGS = {
    "default": {"sizes": (4, 8, 16), "seeds": (0, 1, 2), "steps": 300, "lrs": (0.01, 0.3),
                "algorithms": ALGORITHMS, "timed_steps": 200, "timed_width": 1024, "timed_size": 8,
                "sim_sizes": (4, 16, 64, 256), "sim_steps": 400, "sim_seeds": (0, 1, 2),
                "consensus_size": 1024, "consensus_steps": 30},
    "quick": {"sizes": (4, 8, 16), "seeds": (0,), "steps": 80, "lrs": (0.01, 0.3),
              "algorithms": ("allreduce", "easgd", "gossip-push", "sgp"), "timed_steps": 40, "timed_width": 256,
              "timed_size": 4, "sim_sizes": (4, 16, 64), "sim_steps": 150, "sim_seeds": (0,),
              "consensus_size": 256, "consensus_steps": 20},
}
#: In quick mode p = 16 runs only the methods finding (d) compares, at the small step size.
QUICK_P16 = {"algorithms": ("allreduce", "easgd", "gossip-push"), "lrs": (0.01,)}

#: The timed runs: the same problem, a wide MLP (``timed_width`` hidden units: 4 MB of
#: parameters at 1024) so that a step's communication over a 1 Gbit link is comparable to
#: its computation, the large step size, and the straggler case (rank 1 twice as slow).
#: EASGD is left out: its center on one rank takes every worker's pull and push through one
#: node's link, serialised by the lock (several times AllReduce's step; docs/RESULTS.md).
TIMED_ALGORITHMS = ("allreduce", "sgp", "osgp", "gossip-push")
STRAGGLER_ALGORITHMS = ("allreduce", "sgp", "osgp")
TIMED_LR = 0.3


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
    """

    def __init__(self, mpiexec, log, *, timeout=1800):
        self.mpiexec, self.log, self.timeout = list(mpiexec), log, timeout

    def compare(self, size, out, algorithms, lrs, steps, extra=()):
        """One ``compare`` job of ``size`` ranks writing into ``out``; returns its summaries.
        Raises ``RuntimeError`` naming the log when the job fails."""
        cmd = self.mpiexec + ["-n", str(size), sys.executable, "-m", "mpigossip", "compare",
                              "--algorithms", *algorithms, "--lrs", *map(str, lrs), "--steps", str(steps),
                              "--eval-every", str(max(1, steps // 15)), "--quiet", "--out", out, *extra]
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
    ``time_s``, ``loss``, ``accuracy``, ``consensus``."""
    points = []
    with open(os.path.join(run_dir, "metrics-rank0.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if "test_loss" in r:
                points.append({"steps": r.get("steps_done", r["step"] + 1), "time_s": r["time_s"],
                               "loss": r["test_loss"], "accuracy": r["test_accuracy"],
                               "consensus": r["consensus_distance"]})
    return points


def accuracy_runs(launcher, root, setting, quick, progress, flags=PROBLEM):
    """The step-size x world-size x seed grid; returns a list of run records."""
    records = []
    for size in setting["sizes"]:
        algorithms, lrs = setting["algorithms"], setting["lrs"]
        if quick and size == 16:
            algorithms, lrs = QUICK_P16["algorithms"], QUICK_P16["lrs"]
        for seed in setting["seeds"]:
            out = os.path.join(root, "runs", f"p{size}-seed{seed}")
            progress(f"p = {size}, seed {seed}: {len(algorithms)} algorithms x {len(lrs)} step sizes")
            for s in launcher.compare(size, out, algorithms, lrs, setting["steps"],
                                      extra=tuple(flags) + ("--seed", str(seed))):
                records.append({**_record(s), "seed": seed,
                                "curve": load_curve(run_dir(out, s["algorithm"], s["lr"]))})
    return records


def timed_runs(launcher, root, setting, progress, flags=PROBLEM):
    """Wall-time runs (meant for the emulated or a real cluster), with and without a straggler."""
    size, steps = setting["timed_size"], setting["timed_steps"]
    width = setting["timed_width"] if "mlp" in flags else 64  # the CNN's width: its first layer's channels
    extra = tuple(flags) + ("--width", str(width), "--seed", "0")
    records = []
    for label, algorithms, more in (("normal", TIMED_ALGORITHMS, ()),
                                    ("straggler", STRAGGLER_ALGORITHMS, ("--straggler", "1:2"))):
        out = os.path.join(root, "timed", label)
        progress(f"timed, {label}: {size} ranks, {', '.join(algorithms)}")
        for s in launcher.compare(size, out, algorithms, (TIMED_LR,), steps, extra=extra + more):
            records.append({**_record(s), "case": label, "curve": load_curve(run_dir(out, s["algorithm"], s["lr"]))})
    return records


def _record(summary):
    keys = ("algorithm", "world_size", "lr", "steps", "final_loss", "final_accuracy", "consensus_distance",
            "time_per_step_s", "wall_time_s", "comm_time_s")
    return {k: summary[k] for k in keys}
