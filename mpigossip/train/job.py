"""``python -m mpigossip train``: train a model with one (or every) algorithm on MPI ranks.

Run with ``mpiexec -n P python -m mpigossip train [flags]`` or ``srun``. Every rank
trains on its own shard; evaluation, metrics and checkpoints are collective at fixed
steps, so every rank reaches them together. Flags: :mod:`.cli`; checkpoints:
:mod:`.checkpoint`; evaluation: :mod:`.evaluate`; preemption: :mod:`.stop`.
"""

import json
import math
import os
import random
import shutil
import signal
import socket
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from mpi4py import MPI

from .. import __version__
from .. import topology as topo_mod
from .. import torch as mgt
from ..core import deadline, provenance
from ..core.nodes import local_rank
from ..launch.info import gpu_count, placement
from ..onesided import progress
from ..resilience import failures, grow
from . import checkpoint, models, regrow
from . import data as data_mod
from .cli import (
    DEFAULTS,
    UsageError,
    algorithms_of,
    alone_in_allocation,
    check_arguments,
    check_launch,
    check_out_folders,
    parse_kill,
    parse_straggler,
    topology_name,
)
from .evaluate import Evaluator, reduce
from .stop import StopAgreement

#: Exit status after a signal-triggered checkpoint (EX_TEMPFAIL): the job scripts requeue on it.
EXIT_PREEMPTED = 75



def inner_momentum(momentum, algorithm):
    """The SGD momentum of a run: ``--momentum``, or its default: 0.9, and 0 for DiLoCo, whose
    outer Nesterov step (lr 0.7, momentum 0.9) already multiplies the pseudo-gradient ~7x at
    steady state; an inner momentum of 0.9 multiplies it again, ~10x, and on the digits the
    model then fell to chance after ~1,000 steps (docs/RESULTS.md, the soak)."""
    if momentum is not None:
        return float(momentum)
    return 0.0 if algorithm == "diloco" else DEFAULTS["momentum"]

class Preempted(Exception):
    """Training stopped by SIGUSR1/SIGTERM after writing a checkpoint."""


def interactive():
    """Whether stdout reaches a terminal. Open MPI hands every rank a pseudo-terminal, so
    under its launcher ask about the launcher's own stdout (the parent process) instead."""
    if not sys.stdout.isatty():
        return False
    if "OMPI_COMM_WORLD_RANK" in os.environ or "PMIX_RANK" in os.environ:
        try:
            fd = os.open(f"/proc/{os.getppid()}/fd/1", os.O_WRONLY | os.O_NOCTTY)
        except OSError:
            return False
        try:
            return os.isatty(fd)
        finally:
            os.close(fd)
    return True


class Run:
    """One training run of one algorithm at one learning rate."""

    def __init__(self, args, comm, algorithm, lr, out, newcomer=False):
        self.args, self.comm, self.algorithm, self.lr, self.out = args, comm, algorithm, lr, out
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.initial_size = self.size
        self.timeout = deadline.check_timeout(args.timeout)
        # a newcomer's comm is its Arrival until it joins (--on-failure replace): its place, no collective
        arrival = isinstance(comm, grow.Arrival)
        if args.device == "cuda":
            torch.cuda.set_device((comm.local_rank if arrival else local_rank(comm)[0]) % gpu_count())
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        self.data = data_mod.load(args.dataset, data_dir=args.data_dir, seed=args.data_seed,
                                  samples=args.samples, features=args.features, classes=args.classes,
                                  clusters=args.clusters, label_noise=args.label_noise)
        x, y = self.data.shard(self.rank, self.size)
        self.x_train, self.y_train = torch.from_numpy(x).to(self.device), torch.from_numpy(y).to(self.device)
        self.x_test = torch.from_numpy(self.data.x_test).to(self.device)
        self.y_test = torch.from_numpy(self.data.y_test).to(self.device)
        if args.steps is not None:
            self.steps = args.steps
        elif args.epochs is not None:
            # From the whole training split, not this rank's shard: shards differ by up to one
            # sample, and every rank must run the same steps (evaluations and checkpoints too).
            per_rank = len(self.data.x_train) / self.size
            self.steps = max(1, math.ceil(args.epochs * per_rank / args.batch_size))
        else:
            self.steps = DEFAULTS["steps"]
        self.on_failure = getattr(args, "on_failure", "abort")
        self.tolerant = self.on_failure in ("continue", "replace")   # (replace: continue, then grow back)
        self.newcomer = newcomer   # spawned into the run in a dead rank's place (--on-failure replace)
        self.grow_pending, self.lost, self.grow_at = False, [], 0   # (replace) a failure followed, not yet replaced
        self.joining = None   # (replace) newcomers started, not yet joined: regrow.Joining
        self.healing = None   # (replace, AGP) a heal going on beside training: beside.Healing
        self.hosts = []   # (replace) each rank's host, where a dead rank's replacement goes
        # Surviving a failure: evaluate at the end only, over the survivors (an evaluation's
        # collectives would meet a failure outside the algorithm's recovery).
        self.eval_every = self.steps if self.tolerant else args.eval_every or max(1, self.steps // 10)
        # fault injection (--kill RANK:STEP, ranks of the launch): [(rank, step)], and the step this rank dies at
        # (checked against the launch's size at start; a newcomer, whose world is its spawn, knows them to
        # record a later kill, but dies by none: its rank's kill was its predecessor's)
        self.kills = [parse_kill(spec, None) for spec in getattr(args, "kill", None) or []]
        self.kill_at = None
        for r, at in self.kills:
            if r == MPI.COMM_WORLD.Get_rank() and not newcomer:
                self.kill_at = at
        self.failures = []  # failures survived: [{"step", "ranks", ...}] (--on-failure continue)
        self.failures_seen = 0  # of self.algo.failures (a resumed run's history is not the algorithm's)
        torch.manual_seed(args.seed)
        self.model = models.build(args.model, self.data.shape, self.data.classes, args.width).to(self.device)
        self.eval_model = models.build(args.model, self.data.shape, self.data.classes, args.width).to(self.device)
        self.algo = None if arrival else self.make_algorithm()   # (a newcomer's: regrow.rebuild, once joined)
        self.evaluate = Evaluator(self.eval_model, self.x_test, self.y_test, comm=comm, timeout=self.timeout)
        self.momentum = inner_momentum(args.momentum, algorithm)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr, momentum=self.momentum,
                                         nesterov=args.nesterov and self.momentum > 0,
                                         weight_decay=args.weight_decay)
        self.rng = np.random.default_rng([args.seed, self.rank])          # batches
        self.slow_rng = random.Random(f"delay:{args.seed}:{self.rank}")   # injected slowdowns
        self.straggle = 1.0
        for spec in args.straggler:
            r, factor = parse_straggler(spec, self.size)
            if r == self.rank:
                self.straggle = factor
        self.start_step = 0
        self.times = {"compute_s": 0.0, "comm_s": 0.0, "wait_s": 0.0}
        # what the launches before a resume took (checkpoint.resume restores it): every time the
        # run reports, in the metrics and in summary.json, counts from step 0 across launches
        self.before = {"wall_s": 0.0, "aside_s": 0.0, "blocked_s": 0.0}
        self.weight_min = math.inf  # the PushSum family: the smallest weight this rank held after a step
        self.metrics_file = None

    def make_algorithm(self, broadcast=True):
        """The algorithm's torch wrapper over ``self.model`` (collective), from the flags
        (``broadcast=False``: every rank keeps its own parameters, as before a heal's load)."""
        args = self.args
        averaging = args.base if self.algorithm in mgt.OUTER else self.algorithm  # whose graph
        flags = {"beta": args.beta, "tau": args.tau, "servers": args.servers, "seed": args.seed,
                 "peers": args.peers, "max_delay": args.max_delay, "hierarchical": args.hierarchical,
                 "node_size": args.node_size, "base": args.base, "inner_steps": args.inner_steps,
                 "outer_lr": args.outer_lr, "outer_momentum": args.outer_momentum, "warmup": args.warmup_steps,
                 "wire": args.wire, "inner_mixing": args.inner_mixing,
                 "on_failure": "continue" if self.tolerant else self.on_failure,
                 "topology": topo_mod.make(topology_name(args, averaging), peers=args.peers, seed=args.seed)}
        accepted = mgt.options_of(self.algorithm, args.base)
        return mgt.make(self.algorithm, self.model, comm=self.comm, timeout=self.timeout, broadcast=broadcast,
                        **{k: v for k, v in flags.items() if k in accepted})

    def _log(self, record):
        if self.metrics_file is not None:
            self.metrics_file.write(json.dumps(record) + "\n")

    def _open_outputs(self):
        """Collective: ``config.json`` (the flags, and where every rank ran) and the metrics file."""
        os.makedirs(self.out, exist_ok=True)
        here = dict(placement(self.comm), device=str(self.device), torch_threads=torch.get_num_threads())
        ranks = deadline.allgather(self.comm, here, timeout=self.timeout, op="placement")
        if self.rank == 0:
            with open(os.path.join(self.out, "config.json"), "w") as f:
                json.dump(dict(vars(self.args), algorithm=self.algorithm, lr=self.lr, world_size=self.size,
                               steps=self.steps, ranks=ranks, commit=provenance.commit(),
                               versions=provenance.versions()), f, indent=2)
        self.metrics_file = open(os.path.join(self.out, f"metrics-rank{self.rank}.jsonl"),
                                 "a" if self.args.resume else "w")

    def clock(self):
        """This run's time so far, from step 0 (a checkpoint keeps it, so a resumed run goes on
        counting): wall seconds, seconds set aside (evaluations, logs, checkpoints), seconds
        blocked in MPI waits."""
        return {"wall_s": time.perf_counter() - self.t_start, "aside_s": self.aside_s,
                "blocked_s": deadline.waited_seconds() - self.waited0}

    def _preempt(self, step):
        """Checkpoint at ``step`` and raise :class:`Preempted` (exit status 75)."""
        checkpoint.save_checkpoint(self.comm, self.out, step, checkpoint.state_of(self, step), self.timeout)
        checkpoint.mark_preempted(self.comm, self.out, step, self.timeout)
        self.metrics_file.close()
        self.algo.free()
        raise Preempted(f"{self.algorithm}: stopped by a signal at step {step}; checkpoint in {self.out}; "
                        f"continue with --resume {self.out}")

    def _drive_heal(self):
        """(replace, AGP) A donor healing beside training drives its sends between a step's parts
        too: over TCP they move only inside MPI, a socket's buffer at a time."""
        if self.healing is not None and self.healing.progress():
            self.healing = None

    def train_step(self, step):
        """One step: local update, the algorithm's communication; the step's metrics record."""
        args = self.args
        t0 = time.perf_counter()
        w0 = deadline.waited_seconds()  # from here: gradient AllReduce waits inside optimizer.step()
        c0 = self.algo.comm_time_s      # communication inside backward() (the gradient AllReduce)
        self._drive_heal()
        idx = torch.from_numpy(self.rng.integers(0, len(self.x_train), args.batch_size)).to(self.device)
        loss = F.cross_entropy(self.model(self.x_train[idx]), self.y_train[idx])
        self.optimizer.zero_grad(set_to_none=False)
        loss.backward()
        self._drive_heal()
        self.optimizer.step()
        loss_value = float(loss.detach())
        if not math.isfinite(loss_value):
            deadline.abort(self.comm, f"train: loss is {loss_value} at step {step} with {self.algorithm}, "
                           f"lr={self.lr} (learning rate too large?)", errorcode=3)
        t1 = time.perf_counter()
        inside = self.algo.comm_time_s - c0
        if args.compute_ms:  # the fixed compute model: the same sleep for every algorithm
            time.sleep(self.straggle * args.compute_ms / 1e3)
        elif self.straggle > 1:  # the computation only: not the gradient AllReduce inside backward()
            time.sleep((self.straggle - 1) * max(0.0, t1 - t0 - inside))
        if args.delay_prob and self.slow_rng.random() < args.delay_prob:
            time.sleep(args.delay_ms / 1e3)
        t2 = time.perf_counter()
        self.algo.step()
        t3 = time.perf_counter()
        waited = deadline.waited_seconds() - w0
        compute, comm_s = t2 - t0 - inside, t3 - t2 + inside  # every algorithm's communication booked alike
        self.times["compute_s"] += compute
        self.times["comm_s"] += comm_s
        self.times["wait_s"] += waited
        return {"step": step, "time_s": t3 - self.t_start, "train_s": t3 - self.t_start - self.aside_s,
                "loss": loss_value, "compute_s": compute,
                "comm_s": comm_s, "wait_s": waited}

    def _follow_algorithm(self):
        """The wrapper followed a failure (in a step, or in a drain before a checkpoint or an
        evaluation): the job's communicator follows at once, if it has not yet."""
        if len(self.algo.failures) > self.failures_seen:
            self._survive(self._at_step)

    def _survive(self, step):
        """The algorithm survived a failure in this step: the job's own communicator (evaluation,
        metrics) shrinks to the survivors too, and the failure is recorded."""
        t0 = time.perf_counter()
        rec = failures.shrink(self.comm, step, timeout=self.timeout, op="train (the job's communicator)", share=step)
        self.comm, self.size = rec.comm, rec.comm.Get_size()
        self.evaluate = Evaluator(self.eval_model, self.x_test, self.y_test, comm=self.comm, timeout=self.timeout)
        self.failures.append(self._failure_record(self.algo.failures[self.failures_seen], rec, t0))
        self.failures_seen += 1
        if self.joining is not None:   # (replace) newcomers were starting: given up, all replaced in one growth
            regrow.give_up(self, f"rank(s) {self.failures[-1]['ranks']} failed while they started")
        if self.healing is not None:   # (replace, AGP) healing beside training: the record as this rank has it
            self.healing.abandon(f"rank(s) {self.failures[-1]['ranks']} failed while the newcomers healed")
            self.healing = None
        # (replace) grow back once every survivor has reached the step after the last one at which one
        # followed the failure (OSGP and AGP let ranks drift: one behind catches up first)
        # the dead, numbered as when the algorithm was built (at the start, or the last growth: the
        # numbers the newcomers take); with those of a failure followed before and not yet replaced
        lost = list(self.failures[-1]["ranks"])
        self.lost = sorted(set(self.lost) | set(lost)) if self.grow_pending else lost
        self.grow_pending = self.on_failure == "replace"
        self.grow_at = max(int(s) for s in rec.shared) + 1
        event = self.failures[-1]
        if self.comm.Get_rank() == 0:
            met = event["met_at_step"]
            print(f"\n{self.algorithm}: rank{'s' if len(event['ranks']) > 1 else ''} "
                  f"{', '.join(map(str, event['ranks']))} failed"
                  + (f" (killed at step {event['killed_at_step']})" if event["killed_at_step"] is not None else "")
                  + f"; met at step {met['first']}" + (f"-{met['last']}" if met["last"] != met["first"] else "")
                  + f"; {self.size} survivors go on (recovered in {event['recovery_s']:.2f} s"
                  + (f", weight lost {event['weight_lost']:.3g})" if "weight_lost" in event else ")"), flush=True)

    def _failure_record(self, algo_record, rec, t0):
        """One failure as ``summary.json`` keeps it: who died, the step it was killed at (a
        ``--kill`` injection; None for a real failure: no survivor knows), the first and last
        training step at which the survivors met it, the algorithm's step of its recovery,
        when (seconds into the run) and how long the recoveries took, and the mass lost."""
        killed = [s for r, s in self.kills if r in algo_record["ranks"]]
        met = [int(s) for s in rec.shared]
        record = {"ranks": algo_record["ranks"], "size": algo_record["size"],
                  "killed_at_step": min(killed) if killed else None,
                  "met_at_step": {"first": min(met), "last": max(met)},
                  "algorithm_step": algo_record["step"],
                  "recovered_at_s": time.perf_counter() - self.t_start,
                  "recovery_s": algo_record["seconds"], "job_shrink_s": time.perf_counter() - t0}
        record.update({k: v for k, v in algo_record.items() if k not in ("ranks", "size", "step", "seconds")})
        return record

    def _progress(self, step, record, last):
        done = (step + 1) / self.steps
        acc = f" acc {last['test_accuracy']:.3f}" if last else ""
        print(f"\r{self.algorithm:<12} [{'#' * int(30 * done):<30}] {step + 1}/{self.steps} "
              f"loss {record['loss']:.4f}{acc}", end="", flush=True)

    def run(self):
        args, comm = self.args, self.comm
        stop = None
        if self.newcomer:   # (handover.heal_run has placed it in the run: no collective of the start here)
            if self.out:
                self.metrics_file = open(os.path.join(self.out, f"metrics-rank{self.rank}.jsonl"), "a")
        else:
            if self.out:
                self._open_outputs()
            if args.resume:
                self.start_step = checkpoint.resume(self, args.resume)
            # SIGUSR1/SIGTERM: checkpoint, exit 75 (not while surviving failures: its per-step collective)
            stop = StopAgreement(comm, self.timeout) if self.out and self.on_failure == "abort" else None
            if self.on_failure == "replace":
                self.hosts = deadline.allgather(comm, socket.gethostname(), timeout=self.timeout, op="train (hosts)")
            if self.start_step == 0:  # the starting point of the curves: the model before training
                self._log({"step": -1, "steps_done": 0, "time_s": 0.0, **self.evaluate(self.model, self.algo)})
            deadline.barrier(comm, timeout=self.timeout, op="train start")
        progress = self.rank == 0 and not args.quiet and interactive()
        self.t_start = time.perf_counter() - self.before["wall_s"]
        self.aside_s = self.before["aside_s"]  # evaluations, logging and checkpoints: not part of a step's time
        self.train_s = 0.0
        self.waited0 = deadline.waited_seconds() - self.before["blocked_s"]
        last, last_print = {}, 0.0
        if self.tolerant:   # a failure met outside a step (a drain) is followed at once
            self.algo.after_failure = self._follow_algorithm
        step = self.start_step
        while step < self.steps:
            while self.joining is not None and step == self.steps - 1:   # (replace) the last step: grow back
                step = regrow.poll(self, step, final=True)   # first (it ends at its size, its checkpoint too)
            self._at_step = step
            if stop is not None and stop.stop_at(step, self.start_step):
                return self._preempt(step)
            if step == self.kill_at:
                sys.stdout.flush()
                if self.metrics_file is not None:   # every step it took is on file
                    self.metrics_file.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            record = self.train_step(step)
            weights = getattr(self.algo, "weights", None)
            if weights:
                self.weight_min = min(self.weight_min, *weights)
                record["weights"] = [float(w) for w in weights]
            if self.tolerant:
                self._follow_algorithm()   # (done already where the wrapper called it back)
            self.train_s = record["train_s"]  # this rank's training time at its last step (before drain)
            t_aside = time.perf_counter()
            if (step + 1) % self.eval_every == 0 or step + 1 == self.steps:
                last = self.evaluate(self.model, self.algo)
                record.update(last, steps_done=step + 1)
            self._log(record)
            if args.checkpoint_every and ((step + 1) % args.checkpoint_every == 0 or step + 1 == self.steps):
                # over the survivors after a failure (self.comm, read after the state: its drain may meet
                # one); a rank that fails in it leaves it uncommitted
                state = checkpoint.state_of(self, step + 1)
                checkpoint.save_checkpoint(self.comm, self.out, step + 1, state, self.timeout,
                                           tolerant=self.tolerant)
            self.aside_s += time.perf_counter() - t_aside
            if progress and (time.perf_counter() - last_print > 0.2 or step + 1 == self.steps):
                last_print = time.perf_counter()
                self._progress(step, record, last)
            step += 1
            if self.healing is not None and self.healing.test():   # (--on-failure replace) healed beside training
                self.healing = None
            if self.joining is not None:   # (--on-failure replace) newcomers starting: ready yet?
                step = regrow.poll(self, step)
            elif self.grow_pending and step >= self.grow_at:   # (--on-failure replace) the dead replaced
                step = regrow.grow_back(self, step)
        while self.joining is not None:   # (newcomers started at the last step) grow back: the job ends at its size
            step = regrow.poll(self, step, final=True)
            last = {}   # (the final evaluation over the grown communicator, the newcomers' models too)
        if self.healing is not None:   # (a heal beside training ends before the run's last collectives)
            self.healing.wait(self.timeout)
            self.healing = None
        if progress:
            print()
        if stop is not None:
            stop.close()
        self.algo.drain()
        wall = time.perf_counter() - self.t_start
        final = last or self.evaluate(self.model, self.algo)
        return self._summary(final, wall, deadline.waited_seconds() - self.waited0)

    def _summary(self, final, wall, blocked):
        """Reduce the run's figures over ranks, write ``summary.json`` (rank 0), free the algorithm."""
        wall_max = reduce(self.comm, wall, self.timeout, op=MPI.MAX)
        train_max = reduce(self.comm, wall - self.aside_s, self.timeout, op=MPI.MAX)
        # Throughput as the network benchmark's P4 measures it: the sum over ranks of each rank's own
        # steps per second (a rank that never waits for a slow one keeps its pace).
        done = self.steps   # every time counts from step 0, across a resume
        throughput = float(reduce(self.comm, done / self.train_s if self.train_s > 0 else 0.0, self.timeout))
        compute, comm_s, wait, blocked = reduce(self.comm, [self.times["compute_s"], self.times["comm_s"],
                                                            self.times["wait_s"], blocked], self.timeout)
        summary = {"algorithm": self.algorithm, "world_size": self.size, "steps": self.steps, "lr": self.lr,
                   "momentum": self.momentum, "model": self.args.model, "dataset": self.data.name,
                   "final_loss": final["test_loss"],
                   "final_accuracy": final["test_accuracy"], "consensus_distance": final["consensus_distance"],
                   "rank_accuracy_mean": final["rank_accuracy_mean"], "rank_accuracy_min": final["rank_accuracy_min"],
                   "rank_distances": final["rank_distances"],
                   **{k: final[k] for k in ("center_loss", "center_accuracy") if k in final},
                   "wall_time_s": wall_max, "train_time_s": train_max,
                   "time_per_step_s": train_max / max(1, done), "throughput_steps_s": throughput,
                   "compute_time_s": compute / self.size, "comm_time_s": comm_s / self.size,
                   "wait_time_s": wait / self.size, "blocked_in_mpi_s": blocked / self.size,
                   "tcp_progress_thread": progress.is_on(), "on_failure": self.on_failure,
                   "failures": self.failures, "initial_world_size": self.initial_size,
                   "mpigossip_version": __version__}
        if self.algorithm in mgt.OUTER:
            summary["base"] = self.args.base
        if self.args.hierarchical:   # (collective: the node split)
            per_node = self.args.node_size or local_rank(self.comm)[1]
            summary["hierarchical_nodes"] = self.size // per_node
        weights = getattr(self.algo, "weights", None)
        if weights:   # after the drain: Σw per parameter group, and the smallest weight any rank held
            summary["weight_sum"] = [float(v) for v in np.atleast_1d(reduce(self.comm, [float(w) for w in weights],
                                                                            self.timeout))]
            lowest = float(reduce(self.comm, self.weight_min, self.timeout, op=MPI.MIN))
            summary["weight_min"] = lowest if math.isfinite(lowest) else None
        if self.metrics_file is not None:
            self.metrics_file.close()
        if self.out and self.rank == 0:
            with open(os.path.join(self.out, "summary.json"), "w") as f:
                json.dump(summary, f, indent=2)
        self.algo.free()
        return summary


def one_line(s):
    name = s["algorithm"] + (f" over {s['base']}" if s.get("base") else "")
    if s.get("hierarchical_nodes") == 1:
        name += " (hierarchical on one node: the node's exact mean every step)"
    elif s.get("hierarchical_nodes"):
        name += f" (hierarchical: {s['hierarchical_nodes']} nodes)"
    return (f"{name}: {s['world_size']} ranks, {s['steps']} steps, lr {s['lr']:g}: "
            f"test accuracy {s['final_accuracy']:.4f}, loss {s['final_loss']:.4f}, consensus distance "
            f"{s['consensus_distance']:.2e}, {s['time_per_step_s'] * 1e3:.1f} ms/step "
            f"(comm {s['comm_time_s']:.2f} s of {s['wall_time_s']:.2f} s)")


def run_many(args, comm, algorithms, lrs, out_for):
    """Run each (algorithm, lr) in turn in this MPI job; returns the summaries.
    Errors in flags or data end every rank with the same message (rank 0 prints it)."""
    summaries = []
    for algorithm in algorithms:
        for lr in lrs:
            run = Run(args, comm, algorithm, lr, out_for(algorithm, lr))
            summary = run.run()
            comm = run.comm  # the survivors' after a failure (--on-failure continue)
            summaries.append(summary)
            if comm.Get_rank() == 0:
                print(one_line(summary), flush=True)
    return summaries


def fail(comm, message, code):
    if comm.Get_rank() == 0:
        print(f"python -m mpigossip: error: {message}", file=sys.stderr, flush=True)
    return code


def failed_to_grow(exc, who):
    """End this rank after a failure while the run grew back (:class:`~mpigossip.train.regrow.ReplaceFailed`):
    every live rank meets it, none knows which of them lives to print it, so each prints the one
    line with its rank, and leaves without MPI_Finalize (which hangs after a failure)."""
    print(f"python -m mpigossip: error ({who}): {exc}", file=sys.stderr, flush=True)
    failures.exit(1)


def check_world(args, algorithms, lrs, comm):
    """The full check of the flags, now that the world size and the GPUs are known."""
    check_launch(comm.Get_size())
    warning = alone_in_allocation(comm.Get_size())
    if warning:
        print(warning, file=sys.stderr, flush=True)
    check_arguments(args, algorithms, lrs, comm.Get_size())
    if getattr(args, "on_failure", "abort") != "abort" and comm.Get_size() > 1 and not failures.enabled():
        raise UsageError(f"--on-failure {args.on_failure} needs Open MPI's fault tolerance (ULFM), which this launch did not "
                         "turn on: a dead rank would still end the job. Launch with `mpiexec --with-ft ulfm` "
                         "(or `mpigossip-mpiexec --with-ft ulfm`, `python -m mpigossip launch --fault-tolerant`)")
    if args.device == "cuda" and gpu_count() == 0:
        raise UsageError("--device cuda: no CUDA GPU is visible")


def main(args, arrival=None):
    """``train``; ``arrival``: a newcomer's place (``--on-failure replace``), learnt first."""
    comm = MPI.COMM_WORLD
    algorithms = algorithms_of(args)

    def out_for(algorithm, lr):
        if not args.out:
            return None
        return os.path.join(args.out, algorithm) if len(algorithms) > 1 else args.out
    try:
        if arrival is not None:   # spawned in a dead rank's place (--on-failure replace): it joins the run under way
            summary, rank = regrow.newcomer_main(args, Run, out_for, arrival)
            if rank == 0:   # (rank 0 died: its newcomer prints the run's line)
                print(one_line(summary), flush=True)
            return 0
    except regrow.ReplaceFailed as exc:
        return failed_to_grow(exc, "a newcomer")
    except grow.Abandoned as exc:   # (a failure while it started: the survivors replace the dead later)
        print(f"python -m mpigossip: note (a newcomer): {exc}", file=sys.stderr, flush=True)
        failures.exit(0)
    try:
        check_world(args, algorithms, [args.lr], comm)
    except UsageError as exc:
        return fail(comm, str(exc), 2)
    if args.resume and args.algorithm == "all":
        return fail(comm, "--resume needs one --algorithm", 2)
    folders = [out_for(a, args.lr) for a in algorithms]
    try:
        check_out_folders(args, folders)
    except UsageError as exc:
        return fail(comm, str(exc), 2)
    if args.overwrite and args.out:
        if comm.Get_rank() == 0:
            for folder in folders:
                shutil.rmtree(os.path.join(folder, "checkpoints"), ignore_errors=True)
        deadline.barrier(comm, timeout=deadline.check_timeout(args.timeout), op="--overwrite")   # gone before any rank writes there
    try:
        run_many(args, comm, algorithms, [args.lr], out_for)
    except Preempted as exc:
        if comm.Get_rank() == 0:
            print(f"preempted: {exc}", flush=True)
        return EXIT_PREEMPTED
    except regrow.ReplaceFailed as exc:
        return failed_to_grow(exc, f"rank {comm.Get_rank()} of the launch")
    except (data_mod.DataError, ValueError, OSError) as exc:
        return fail(comm, str(exc), 1)
    return 0
