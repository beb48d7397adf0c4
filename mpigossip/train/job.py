"""``python -m mpigossip train``: train a model with one (or every) algorithm on MPI ranks.

Run with ``mpiexec -n P python -m mpigossip train [flags]`` or ``srun``. Every rank
trains on its own shard; evaluation, metrics and checkpoints are collective at fixed
steps, so every rank reaches them together.
"""

import json
import math
import os
import pickle
import random
import shutil
import signal
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from mpi4py import MPI

from .. import deadline
from .. import topology as topo_mod
from .. import torch as mgt
from ..info import gpu_count, local_rank
from . import data as data_mod
from . import models
from .cli import DEFAULTS, UsageError, algorithms_of, check_arguments, parse_straggler

#: Steps between two rounds of the (nonblocking) agreement on a stop request.
STOP_CHECK_EVERY = 10
#: Exit status after a signal-triggered checkpoint (EX_TEMPFAIL): the job scripts requeue on it.
EXIT_PREEMPTED = 75
#: Written into ``OUT/checkpoints`` by rank 0 once a preemption checkpoint is complete.
PREEMPTED_MARKER = "preempted.json"


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


# ------------------------------------------------------------------------------ checkpoints


def _atomic_write(path, write):
    tmp = f"{path}.tmp{os.getpid()}"
    write(tmp)
    os.replace(tmp, path)


def latest_checkpoint(out):
    """``(step_dir, meta)`` of the latest complete checkpoint under ``out``, or ``None``."""
    pointer = os.path.join(out, "checkpoints", "latest.json")
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as f:
        meta = json.load(f)
    return os.path.join(out, "checkpoints", meta["dir"]), meta


def save_checkpoint(comm, out, step, state, timeout):
    """Collective: every rank writes its file (write, then rename); after all have, rank 0
    moves ``latest.json`` to the new step (again atomically). A crash at any point leaves
    the previous checkpoint complete and pointed to."""
    name = f"step-{step:08d}"
    folder = os.path.join(out, "checkpoints", name)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"rank-{comm.Get_rank()}.pt")
    _atomic_write(path, lambda tmp: (torch.save(state, tmp), _crash_hook(step)))
    deadline.barrier(comm, timeout=timeout, op="checkpoint")
    if comm.Get_rank() == 0:
        meta = {"dir": name, "step": step, "world_size": comm.Get_size(), "algorithm": state["algorithm"]}
        _atomic_write(os.path.join(out, "checkpoints", "latest.json"),
                      lambda tmp: json.dump(meta, open(tmp, "w")))
        for old in sorted(os.listdir(os.path.join(out, "checkpoints"))):
            if old.startswith("step-") and old < name:
                shutil.rmtree(os.path.join(out, "checkpoints", old), ignore_errors=True)
    deadline.barrier(comm, timeout=timeout, op="checkpoint")


def load_checkpoint(comm, paths, timeout):
    """Collective: load checkpoint files as data only (``torch.load(weights_only=True)``:
    tensors, numbers, strings and containers; a file that would run code when unpickled is
    refused). Every rank raises the same :class:`~mpigossip.train.data.DataError` if any
    rank could not load one of its files."""
    states, error = [], None
    for path in paths:
        try:
            states.append(torch.load(path, weights_only=True))
        except pickle.UnpicklingError as exc:
            first = str(exc).strip().splitlines()[0]
            error = (f"{path} is not a plain checkpoint: refused to load it, since loading it would run "
                     f"code ({first})")
            break
        except (OSError, RuntimeError, EOFError) as exc:
            error = f"cannot load {path}: {exc}"
            break
    deadline.raise_collectively(comm, error, timeout=timeout, op="--resume", exc=data_mod.DataError)
    return states


def _crash_hook(step):
    """Tests: ``MPIGOSSIP_CRASH_IN_CHECKPOINT=STEP`` kills this process (SIGKILL) mid-write."""
    if os.environ.get("MPIGOSSIP_CRASH_IN_CHECKPOINT") == str(step):
        os.kill(os.getpid(), signal.SIGKILL)


# ------------------------------------------------------------------------------ the run


class Run:
    """One training run of one algorithm at one learning rate."""

    def __init__(self, args, comm, algorithm, lr, out):
        self.args, self.comm, self.algorithm, self.lr, self.out = args, comm, algorithm, lr, out
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.timeout = deadline.check_timeout(args.timeout)
        if args.device == "cuda":
            torch.cuda.set_device(local_rank(comm)[0] % gpu_count())
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        self.data = data_mod.load(args.dataset, data_dir=args.data_dir, seed=args.seed,
                                  samples=args.samples, features=args.features, classes=args.classes)
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
        self.eval_every = args.eval_every or max(1, self.steps // 10)
        torch.manual_seed(args.seed)
        self.model = models.build(args.model, self.data.shape, self.data.classes).to(self.device)
        self.eval_model = models.build(args.model, self.data.shape, self.data.classes).to(self.device)
        self.algo = self._make_algorithm()
        self.eval_flat = mgt.FlatParameters(self.eval_model)
        self.eval_buffers = mgt.FlatParameters.of_buffers(self.eval_model)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr, momentum=args.momentum,
                                         nesterov=args.nesterov and args.momentum > 0,
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
        self.metrics_file = None
        self.stop_requested = False

    def _make_algorithm(self):
        """The algorithm's torch wrapper over ``self.model`` (collective), from the flags."""
        args = self.args
        flags = {"beta": args.beta, "tau": args.tau, "servers": args.servers, "seed": args.seed,
                 "peers": args.peers, "max_delay": args.max_delay,
                 "topology": topo_mod.make(args.topology, peers=args.peers, seed=args.seed)}
        return mgt.make(self.algorithm, self.model, comm=self.comm, timeout=self.timeout,
                        **{k: v for k, v in flags.items() if k in mgt.OPTIONS[self.algorithm]})

    # -- evaluation (collective) --------------------------------------------------
    def _sum(self, values, reduce=MPI.SUM):
        """Sum (or ``reduce``) a number or a list of numbers over ranks, with the job's deadline."""
        out = deadline.allreduce(self.comm, np.asarray(values, dtype=np.float64), timeout=self.timeout,
                                 op="train (reduce metrics)", reduce=reduce)
        return out if np.ndim(out) == 0 else out.tolist()

    def _accuracy(self, model, x, y):
        model.eval()
        with torch.no_grad():
            correct, loss = 0, 0.0
            for lo in range(0, len(x), 1024):
                logits = model(x[lo:lo + 1024])
                loss += float(F.cross_entropy(logits, y[lo:lo + 1024], reduction="sum"))
                correct += int((logits.argmax(1) == y[lo:lo + 1024]).sum())
        model.train()
        return correct, loss

    def evaluate(self):
        """Consensus model (exact mean over ranks) and rank models on the test split, and the
        consensus distance sqrt(mean_i ||x_i - mean x||^2)."""
        comm = self.comm
        consensus = self.algo.consensus_parameters()
        self.eval_model.load_state_dict(self.model.state_dict())
        distance = 0.0
        for group, mean, own in zip(self.eval_flat.groups, consensus, self.algo.model_buffers()):
            group.copy_(torch.from_numpy(mean).to(group.dtype))
            distance += float(((own.detach().double().cpu().numpy() - mean) ** 2).sum())
        for group, mean in zip(self.eval_buffers.groups, self.algo.consensus_buffers()):
            group.copy_(torch.from_numpy(mean).to(group.dtype))  # BatchNorm statistics: their mean too
        distance = math.sqrt(self._sum(distance) / self.size)
        n = len(self.x_test)
        lo, hi = self.rank * n // self.size, (self.rank + 1) * n // self.size  # consensus: split the test set
        c_correct, c_loss = self._accuracy(self.eval_model, self.x_test[lo:hi], self.y_test[lo:hi])
        c_correct, c_loss = self._sum([c_correct, c_loss])
        r_correct, _ = self._accuracy(self.model, self.x_test, self.y_test)  # this rank's own model
        rank_accs = deadline.allgather(comm, r_correct / n, timeout=self.timeout, op="train (evaluate)")
        return {"test_loss": c_loss / n, "test_accuracy": c_correct / n, "consensus_distance": distance,
                "rank_accuracy_mean": float(np.mean(rank_accs)), "rank_accuracy_min": float(np.min(rank_accs))}

    # -- checkpoints --------------------------------------------------------------
    def state(self, step):
        state = {"algorithm": self.algorithm, "step": step, "world_size": self.size, "lr": self.lr,
                 "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "algo": self.algo.state_dict(), "rng": self.rng.bit_generator.state,
                 "slow_rng": self.slow_rng.getstate(), "torch_rng": torch.get_rng_state(), "times": self.times}
        if hasattr(self.algo, "center_parameters"):
            state["center"] = [torch.from_numpy(c) for c in self.algo.center_parameters()]
        return state

    def resume(self, folder):
        found = latest_checkpoint(folder)
        if found is None:
            raise data_mod.DataError(f"--resume {folder}: no checkpoints/latest.json there")
        step_dir, meta = found
        if meta["algorithm"] != self.algorithm:
            raise data_mod.DataError(f"--resume {folder}: checkpoint is for {meta['algorithm']}, "
                                     f"not {self.algorithm}")
        if meta["world_size"] == self.size:
            state = load_checkpoint(self.comm, [os.path.join(step_dir, f"rank-{self.rank}.pt")], self.timeout)[0]
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.algo.load_state_dict(state["algo"])
            self.rng.bit_generator.state = state["rng"]
            self.slow_rng.setstate(state["slow_rng"])
            torch.set_rng_state(state["torch_rng"])
            self.times = dict(state["times"])
            if "center" in state:
                self._restore_center(state["center"])
        else:
            # Another world size: start every rank from the consensus model, fresh algorithm state.
            states = load_checkpoint(self.comm, [os.path.join(step_dir, f"rank-{r}.pt")
                                                 for r in range(meta["world_size"])], self.timeout)
            mean = {k: sum(s["model"][k].double() for s in states) / len(states) for k in states[0]["model"]}
            self.model.load_state_dict({k: v.to(states[0]["model"][k].dtype) for k, v in mean.items()})
            self.algo.free()
            self.algo = self._make_algorithm()
        self.start_step = int(meta["step"])
        if self.rank == 0 and not self.args.quiet:
            print(f"resumed {self.algorithm} from {step_dir} (step {self.start_step}, "
                  f"{meta['world_size']} ranks)", flush=True)

    def _request_stop(self, signum, frame):
        self.stop_requested = True

    def _preempt(self, step):
        """Checkpoint at ``step`` and raise :class:`Preempted` (exit status 75)."""
        save_checkpoint(self.comm, self.out, step, self.state(step), self.timeout)
        if self.rank == 0:  # for job scripts: the exit status alone may be lost (srun --kill-on-bad-exit)
            _atomic_write(os.path.join(self.out, "checkpoints", PREEMPTED_MARKER),
                          lambda tmp: json.dump({"step": step}, open(tmp, "w")))
        deadline.barrier(self.comm, timeout=self.timeout, op="preemption")  # no rank exits before it exists
        if self.metrics_file is not None:
            self.metrics_file.close()
        self.algo.free()
        raise Preempted(f"{self.algorithm}: stopped by a signal at step {step}; checkpoint in {self.out}; "
                        f"continue with --resume {self.out}")

    def _restore_center(self, centers):
        for server, saved in zip(self.algo.servers_, centers):
            if self.rank == 0:
                current = server.pull(np.empty(server.size_elements, server.dtype))
                server.push(saved.numpy() - current)
        deadline.barrier(self.comm, timeout=self.timeout, op="resume")

    # -- the loop -----------------------------------------------------------------
    def _log(self, record):
        if self.metrics_file is not None:
            self.metrics_file.write(json.dumps(record) + "\n")

    def run(self):
        args, comm = self.args, self.comm
        if self.out:
            os.makedirs(self.out, exist_ok=True)
            if self.rank == 0:
                with open(os.path.join(self.out, "config.json"), "w") as f:
                    json.dump(dict(vars(args), algorithm=self.algorithm, lr=self.lr, world_size=self.size,
                                   steps=self.steps), f, indent=2)
            mode = "a" if args.resume else "w"
            self.metrics_file = open(os.path.join(self.out, f"metrics-rank{self.rank}.jsonl"), mode)
        if args.resume:
            self.resume(args.resume)
        progress = self.rank == 0 and not args.quiet and interactive()
        if self.out:  # preemption: SIGUSR1 / SIGTERM ask for a checkpoint and exit status 75
            for sig in (signal.SIGUSR1, signal.SIGTERM):
                signal.signal(sig, self._request_stop)
        flag, agreed, agreement = np.zeros(1, np.int32), np.zeros(1, np.int32), None
        deadline.barrier(comm, timeout=self.timeout, op="train start")
        t_start = time.perf_counter()
        waited0 = deadline.waited_seconds()
        last, last_print = {}, 0.0
        n = len(self.x_train)
        step = self.start_step
        for step in range(self.start_step, self.steps):
            if self.out and step > self.start_step and step % STOP_CHECK_EVERY == 0:
                # Agree on stopping without a synchronisation point: every rank posts its flag
                # now and reads the previous round's result, posted STOP_CHECK_EVERY steps ago.
                if agreement is not None:
                    deadline.wait(agreement, comm=comm, timeout=self.timeout, op="train (stop agreement)")
                    if agreed[0]:
                        return self._preempt(step)
                flag[0] = self.stop_requested
                agreement = comm.Iallreduce(flag, agreed, op=MPI.MAX)
            t0 = time.perf_counter()
            w0 = deadline.waited_seconds()  # from here: gradient AllReduce waits inside optimizer.step()
            idx = torch.from_numpy(self.rng.integers(0, n, self.args.batch_size)).to(self.device)
            loss = F.cross_entropy(self.model(self.x_train[idx]), self.y_train[idx])
            self.optimizer.zero_grad(set_to_none=False)
            loss.backward()
            self.optimizer.step()
            loss_value = float(loss.detach())
            if not math.isfinite(loss_value):
                deadline.abort(comm, f"train: loss is {loss_value} at step {step} with {self.algorithm}, "
                               f"lr={self.lr} (learning rate too large?)", errorcode=3)
            t1 = time.perf_counter()
            if self.straggle > 1:
                time.sleep((self.straggle - 1) * (t1 - t0))
            if args.delay_prob and self.slow_rng.random() < args.delay_prob:
                time.sleep(args.delay_ms / 1e3)
            t2 = time.perf_counter()
            self.algo.step()
            t3 = time.perf_counter()
            self.times["compute_s"] += t2 - t0
            self.times["comm_s"] += t3 - t2
            self.times["wait_s"] += deadline.waited_seconds() - w0
            record = {"step": step, "time_s": t3 - t_start, "loss": loss_value, "compute_s": t2 - t0,
                      "comm_s": t3 - t2, "wait_s": deadline.waited_seconds() - w0}
            if (step + 1) % self.eval_every == 0 or step + 1 == self.steps:
                last = self.evaluate()
                record.update(last)
            self._log(record)
            if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0 and step + 1 < self.steps:
                save_checkpoint(comm, self.out, step + 1, self.state(step + 1), self.timeout)
            if progress and (time.perf_counter() - last_print > 0.2 or step + 1 == self.steps):
                last_print = time.perf_counter()
                done = (step + 1) / self.steps
                bar = "#" * int(30 * done)
                acc = f" acc {last['test_accuracy']:.3f}" if last else ""
                print(f"\r{self.algorithm:<12} [{bar:<30}] {step + 1}/{self.steps} loss {loss_value:.4f}{acc}",
                      end="", flush=True)
        if progress:
            print()
        if agreement is not None:
            deadline.wait(agreement, comm=comm, timeout=self.timeout, op="train (stop agreement)")
        self.algo.drain()
        wall = time.perf_counter() - t_start
        steps_run = max(1, self.steps - self.start_step)
        final = self.evaluate() if not last else last
        wall_max = self._sum(wall, reduce=MPI.MAX)
        compute, comm_s, wait, blocked = self._sum([self.times["compute_s"], self.times["comm_s"],
                                                    self.times["wait_s"], deadline.waited_seconds() - waited0])
        summary = {"algorithm": self.algorithm, "world_size": self.size, "steps": self.steps, "lr": self.lr,
                   "model": args.model, "dataset": self.data.name, "final_loss": final["test_loss"],
                   "final_accuracy": final["test_accuracy"], "consensus_distance": final["consensus_distance"],
                   "rank_accuracy_mean": final["rank_accuracy_mean"],
                   "wall_time_s": wall_max, "time_per_step_s": wall_max / steps_run,
                   "compute_time_s": compute / self.size, "comm_time_s": comm_s / self.size,
                   "wait_time_s": wait / self.size, "blocked_in_mpi_s": blocked / self.size}
        if self.metrics_file is not None:
            self.metrics_file.close()
        if self.out and self.rank == 0:
            with open(os.path.join(self.out, "summary.json"), "w") as f:
                json.dump(summary, f, indent=2)
        self.algo.free()
        return summary


def one_line(s):
    return (f"{s['algorithm']}: {s['world_size']} ranks, {s['steps']} steps, lr {s['lr']:g}: "
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
            summaries.append(summary)
            if comm.Get_rank() == 0:
                print(one_line(summary), flush=True)
    return summaries


def fail(comm, message, code):
    if comm.Get_rank() == 0:
        print(f"python -m mpigossip: error: {message}", file=sys.stderr, flush=True)
    return code


def check_world(args, algorithms, lrs, comm):
    """The full check of the flags, now that the world size and the GPUs are known."""
    check_arguments(args, algorithms, lrs, comm.Get_size())
    if args.device == "cuda" and gpu_count() == 0:
        raise UsageError("--device cuda: no CUDA GPU is visible")


def main(args):
    comm = MPI.COMM_WORLD
    algorithms = algorithms_of(args)
    try:
        check_world(args, algorithms, [args.lr], comm)
    except UsageError as exc:
        return fail(comm, str(exc), 2)
    if args.resume and args.algorithm == "all":
        return fail(comm, "--resume needs one --algorithm", 2)

    def out_for(algorithm, lr):
        if not args.out:
            return None
        return os.path.join(args.out, algorithm) if len(algorithms) > 1 else args.out
    try:
        run_many(args, comm, algorithms, [args.lr], out_for)
    except Preempted as exc:
        if comm.Get_rank() == 0:
            print(f"preempted: {exc}", flush=True)
        return EXIT_PREEMPTED
    except (data_mod.DataError, ValueError, OSError) as exc:
        return fail(comm, str(exc), 1)
    return 0
