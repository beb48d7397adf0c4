"""Helpers of the Slurm tests (tests/test_slurm.py on one node, tests/cluster/slurm_jobs.py
across the emulated nodes): start and stop the cluster, submit the jobs/ scripts, read results."""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PYTHON = sys.executable


def start(*, cluster=False):
    """Start Slurm (tests/slurm/start.sh [--cluster]); the environment its commands need."""
    args = ["bash", os.path.join(ROOT, "tests", "slurm", "start.sh")] + (["--cluster"] if cluster else [])
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        reason = f"Slurm could not start here: {proc.stderr.strip()[-400:]}"
        if os.environ.get("CI") or cluster:
            pytest.fail(reason)
        pytest.skip(reason)
    exports = re.search(r"export (.*)", proc.stdout).group(1)
    env = dict(os.environ, PYTHON=PYTHON)
    for assignment in exports.split():
        name, value = assignment.split("=", 1)
        env[name] = value.replace("$PATH", os.environ["PATH"])
    if cluster:   # the emulated nodes share this machine's cores (mpigossip.onesided.progress reads this)
        env.setdefault("MPIGOSSIP_CORES_PER_NODE", str((os.cpu_count() or 1) // 4))
    return env


def stop(*, cluster=False):
    subprocess.run(["bash", os.path.join(ROOT, "tests", "slurm", "stop.sh")] + (["--cluster"] if cluster else []),
                   timeout=120)


def sbatch(env, script, *options, extra=None, wait=True, timeout=300):
    """``sbatch --parsable [--wait] OPTIONS jobs/SCRIPT`` from the repository root, with ``extra``
    added to the environment (the job scripts read their settings from it)."""
    cmd = ["sbatch", "--parsable"] + (["--wait"] if wait else []) + list(options) + [os.path.join(ROOT, "jobs", script)]
    return subprocess.run(cmd, capture_output=True, text=True, env=dict(env, **(extra or {})), cwd=ROOT,
                          timeout=timeout if wait else 60)


def submit(env, script, *options, extra=None):
    """``sbatch --wait`` in the background: the Popen (its stdout is the job id)."""
    cmd = ["sbatch", "--parsable", "--wait"] + list(options) + [os.path.join(ROOT, "jobs", script)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(env, **(extra or {})), cwd=ROOT)


def finish(waiter, log, timeout=300, env=None):
    """Wait for a :func:`submit`-ted job (killing ``sbatch --wait`` if it outlives ``timeout``);
    the text of its log. The job must have succeeded. ``env``: Slurm's environment, to say
    where the job and the nodes stood if it did not end in time."""
    try:
        _, stderr = waiter.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        where = "" if env is None else "\n" + slurm_state(env)
        text = log.read_text() if log.exists() else ""
        raise AssertionError(f"the job did not end within {timeout} s; its log:\n{text}{where}") from None
    finally:
        if waiter.poll() is None:
            waiter.kill()
    text = log.read_text()
    assert waiter.returncode == 0, stderr + text
    return text


def slurm_state(env, lines=40):
    """The queue, the nodes and the tail of the controller's log: why a job did not run."""
    def run(*cmd):
        proc = subprocess.run(list(cmd), capture_output=True, text=True, env=env, timeout=30)
        return proc.stdout + proc.stderr
    out = ["$ squeue", run("squeue", "-o", "%i %j %T %r %N"), "$ sinfo -N", run("sinfo", "-N", "-o", "%N %t %E")]
    folder = os.path.dirname(env.get("SLURM_CONF", ""))
    controller = os.path.join(folder, "log", "slurmctld.log")
    if os.path.isfile(controller):
        with open(controller) as f:
            out += [f"$ tail {controller}", "".join(f.readlines()[-lines:])]
    return "\n".join(out)


def same_result(run, reference):
    """The run ended where the reference did: final loss and accuracy equal, bit for bit."""
    assert run["steps"] == reference["steps"]
    assert (run["final_loss"], run["final_accuracy"]) == (reference["final_loss"], reference["final_accuracy"])


def job_id(proc):
    return proc.stdout.strip().splitlines()[0].split(";")[0]


def job_fields(env, name):
    """``scontrol show job`` of the running or pending job called ``name``, as a dict (empty if none)."""
    ids = subprocess.run(["squeue", "-h", "-o", "%i", "-n", name], capture_output=True, text=True, env=env,
                         timeout=30).stdout.split()
    if not ids:
        return {}
    text = subprocess.run(["scontrol", "show", "job", "-o", ids[0]], capture_output=True, text=True, env=env,
                          timeout=30).stdout
    return dict(field.split("=", 1) for field in text.split() if "=" in field)


def summary(folder):
    with open(os.path.join(folder, "summary.json")) as f:
        return json.load(f)


def ranks(folder):
    """Where each rank of a train run ran (``config.json``'s ``ranks``)."""
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)["ranks"]


def check_binding(placement, launcher, gpus_per_node):
    """Every rank of a node takes a GPU of its own (the ranks by host are returned). Under srun
    Slurm hands each task its GPU (CUDA_VISIBLE_DEVICES); under mpirun every rank of a node sees
    the node's GPUs of the job and takes (local rank modulo their number)."""
    by_host = {}
    for r in placement:
        by_host.setdefault(r["host"], []).append(r)
    for host, rs in by_host.items():
        assert sorted(r["local_rank"] for r in rs) == list(range(len(rs))), (host, rs)
        if launcher == "srun":
            gpus = [r["cuda_visible_devices"] for r in rs]
            assert all("," not in g for g in gpus) and len(set(gpus)) == len(rs), (host, rs)
        else:
            visible = {r["cuda_visible_devices"] for r in rs}
            assert visible == {",".join(map(str, range(gpus_per_node)))}, (host, rs)
            assert len({r["local_rank"] % gpus_per_node for r in rs}) == len(rs), (host, rs)
    return by_host
