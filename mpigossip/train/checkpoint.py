"""Checkpoints of the training job: atomic collective writes, data-only loads, resume.

Every rank writes its own file (write, then rename); once all have, rank 0 moves
``checkpoints/latest.json`` to the new step. A crash at any point leaves the previous
checkpoint complete and pointed to. Files are loaded with ``torch.load(weights_only=True)``.
"""

import json
import os
import pickle
import shutil
import signal

import torch
from mpi4py import MPI

from ..core import deadline
from ..resilience import failures
from .data import DataError

#: Written into ``OUT/checkpoints`` by rank 0 once a preemption checkpoint is complete.
PREEMPTED_MARKER = "preempted.json"


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


def save_checkpoint(comm, out, step, state, timeout, tolerant=False):
    """Collective: every rank writes its file (write, then rename); after all have, rank 0
    moves ``latest.json`` to the new step (again atomically). A crash at any point leaves
    the previous checkpoint complete and pointed to.

    ``tolerant`` (``--on-failure continue``, ULFM): a rank that fails during the checkpoint
    makes it incomplete, not fatal: returns ``False`` without moving ``latest.json`` (rank 0
    commits only after every rank has written its file), and the survivors meet the failure
    in their next step, where they recover. Returns ``True`` once committed."""
    name = f"step-{step:08d}"
    folder = os.path.join(out, "checkpoints", name)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"rank-{comm.Get_rank()}.pt")
    _atomic_write(path, lambda tmp: (torch.save(state, tmp), _crash_hook(step)))
    if not _barrier(comm, timeout, tolerant):
        return False
    if comm.Get_rank() == 0:
        meta = {"dir": name, "step": step, "world_size": comm.Get_size(), "algorithm": state["algorithm"],
                "initial_world_size": state.get("initial_world_size", comm.Get_size())}
        _atomic_write(os.path.join(out, "checkpoints", "latest.json"),
                      lambda tmp: json.dump(meta, open(tmp, "w")))
        for old in sorted(os.listdir(os.path.join(out, "checkpoints"))):
            if old.startswith("step-") and old < name:
                shutil.rmtree(os.path.join(out, "checkpoints", old), ignore_errors=True)
    _barrier(comm, timeout, tolerant)  # (failed here: committed all the same)
    return True


def _barrier(comm, timeout, tolerant):
    """The checkpoint's barrier; ``tolerant``: ``False`` if a peer failed in it."""
    if not tolerant:
        deadline.barrier(comm, timeout=timeout, op="checkpoint")
        return True
    try:
        with failures.raised_as_failure("checkpoint"):  # a failed peer may fail the Ibarrier's start itself
            barrier = comm.Ibarrier()
        failures.wait([barrier], comm=comm, timeout=timeout, op="checkpoint", peer="all ranks (Ibarrier)")
    except failures.PeerFailure:
        return False
    return True


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
    deadline.raise_collectively(comm, error, timeout=timeout, op="--resume", exc=DataError)
    return states


def _crash_hook(step):
    """Tests: ``MPIGOSSIP_CRASH_IN_CHECKPOINT=STEP[:RANK]`` kills this process (SIGKILL)
    mid-write of the checkpoint at ``STEP`` (every rank, or rank ``RANK`` of the launch)."""
    spec = os.environ.get("MPIGOSSIP_CRASH_IN_CHECKPOINT", "").split(":")
    if spec[0] == str(step) and (len(spec) == 1 or spec[1] == str(MPI.COMM_WORLD.Get_rank())):
        os.kill(os.getpid(), signal.SIGKILL)


# ------------------------------------------------------------------------------ the run


def mark_preempted(comm, out, step, timeout):
    """Collective, after a checkpoint: rank 0 writes the preemption marker for job scripts
    (the ranks' exit status alone may be lost: srun --kill-on-bad-exit)."""
    if comm.Get_rank() == 0:
        _atomic_write(os.path.join(out, "checkpoints", PREEMPTED_MARKER),
                      lambda tmp: json.dump({"step": step}, open(tmp, "w")))
    deadline.barrier(comm, timeout=timeout, op="preemption")  # no rank exits before it exists


def state_of(run, step):
    """Everything a run needs to continue exactly from ``step``. The algorithm's state first: its
    drain may meet a failure, after which the size and the failures are the survivors'."""
    algo = run.algo.state_dict()
    state = {"algorithm": run.algorithm, "step": step, "world_size": run.size, "lr": run.lr,
             "initial_world_size": run.initial_size, "failures": run.failures,
             "model": run.model.state_dict(), "optimizer": run.optimizer.state_dict(),
             "algo": algo, "rng": run.rng.bit_generator.state,
             "slow_rng": run.slow_rng.getstate(), "torch_rng": torch.get_rng_state(), "times": run.times,
             "clock": run.clock()}
    return state


def resume(run, folder):
    """Continue ``run`` from the latest checkpoint in ``folder`` (collective). Same world size:
    exactly where it stopped; another: every rank from the consensus (mean) model, with a
    fresh optimizer and algorithm state. Returns the step to start from."""
    found = latest_checkpoint(folder)
    if found is None:
        raise DataError(f"--resume {folder}: no checkpoints/latest.json there")
    step_dir, meta = found
    if meta["algorithm"] != run.algorithm:
        raise DataError(f"--resume {folder}: checkpoint is for {meta['algorithm']}, not {run.algorithm}")
    if int(meta["step"]) >= run.steps:
        raise DataError(f"--resume {folder}: its latest checkpoint is at step {meta['step']}, and the run is "
                        f"{run.steps} steps long: nothing left to train (--steps and --epochs count from the "
                        f"run's start, not from the checkpoint: ask for more than {meta['step']})")
    if meta["world_size"] == run.size:
        state = load_checkpoint(run.comm, [os.path.join(step_dir, f"rank-{run.rank}.pt")], run.timeout)[0]
        run.model.load_state_dict(state["model"])
        run.optimizer.load_state_dict(state["optimizer"])
        run.algo.load_state_dict(state["algo"])
        run.rng.bit_generator.state = state["rng"]
        run.slow_rng.setstate(state["slow_rng"])
        torch.set_rng_state(state["torch_rng"])
        run.times = dict(state["times"])
        run.before = dict(state.get("clock", run.before))
        _restore_failures(run, state)
    else:
        states = load_checkpoint(run.comm, [os.path.join(step_dir, f"rank-{r}.pt")
                                            for r in range(meta["world_size"])], run.timeout)
        mean = {k: sum(s["model"][k].double() for s in states) / len(states) for k in states[0]["model"]}
        run.model.load_state_dict({k: v.to(states[0]["model"][k].dtype) for k, v in mean.items()})
        run.algo.free()
        run.algo = run.make_algorithm()
        _restore_failures(run, states[0])
        mine = states[min(run.rank, len(states) - 1)]   # the times go on from a rank of the old world
        run.times = dict(mine["times"])
        run.before = dict(mine.get("clock", run.before))
    if run.rank == 0 and not run.args.quiet:
        print(f"resumed {run.algorithm} from {step_dir} (step {meta['step']}, {meta['world_size']} ranks)",
              flush=True)
    return int(meta["step"])


def _restore_failures(run, state):
    """The run's history of survived failures and its first world size, from a checkpoint
    written after a shrink (``--on-failure continue``): ``summary.json`` keeps them."""
    run.failures = [dict(f) for f in state.get("failures", [])]
    run.initial_size = int(state.get("initial_world_size", state["world_size"]))
