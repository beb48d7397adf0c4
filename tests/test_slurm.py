"""Every script in jobs/ submitted with `sbatch --wait` to a real single-node Slurm on localhost.

tests/slurm/start.sh starts the cluster (installing Debian's Slurm and munge if missing).
Skipped with the reason only where Slurm cannot start; never skipped in CI (CI=true).
The same scripts across 4 emulated nodes: tests/cluster/slurm_jobs.py."""

import json
import os
import subprocess
import time

import pytest

from tests.slurm.jobs import (
    PYTHON,
    ROOT,
    check_binding,
    finish,
    job_fields,
    job_id,
    ranks,
    same_result,
    sbatch,
    start,
    stop,
    submit,
    summary,
)

pytestmark = pytest.mark.slurm
#: tests/run.sh sets it where its cluster step will submit the same job to 4 Slurm nodes
#: (tests/cluster/slurm_jobs.py): the one-node run would repeat it
on_four_nodes = pytest.mark.skipif(os.environ.get("MPIGOSSIP_SLURM_ON_FOUR_NODES") == "1",
                                   reason="the cluster step runs this job on 4 Slurm nodes")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    env = start()
    yield env, tmp_path_factory.mktemp("slurm")
    stop()


def test_train_job_without_a_summary_is_not_done(slurm):
    """A launch that exits 0 without the run's summary (Open MPI's launcher, having lost a node's
    daemon, ends the job with status 0: docs/CLUSTER.md) fails the job, saying so; a summary
    left by an earlier run does not count."""
    env, tmp = slurm
    out, log, fake = tmp / "no-summary", tmp / "no-summary.log", tmp / "exits-0"
    out.mkdir()
    (out / "summary.json").write_text("{}")   # an earlier run's
    time.sleep(1.1)   # (older than the job's start, also on a file system with 1 s times)
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    proc = sbatch(env, "train.sbatch", "-o", str(log), extra={"OUT": str(out), "PYTHON": str(fake)})
    text = log.read_text()
    assert proc.returncode != 0, text
    assert "the launch exited 0 but the run wrote no summary" in text and "train.sbatch: done" not in text


@pytest.mark.parametrize("launcher, algorithm", [("srun", "sgp"), ("mpirun", "dpsgd")])
def test_train_job(slurm, launcher, algorithm):
    """The mpirun run is D-PSGD with HIERARCHICAL=1: the node's 4 ranks average in shared memory."""
    env, tmp = slurm
    out, log = tmp / f"train-{launcher}", tmp / f"train-{launcher}.log"
    extra = {"STEPS": "60", "OUT": str(out), "LAUNCHER": launcher, "CKPT_EVERY": "20", "ALGORITHM": algorithm}
    if algorithm == "dpsgd":
        extra["HIERARCHICAL"] = "1"
    proc = sbatch(env, "train.sbatch", "-o", str(log), extra=extra)
    text = log.read_text()
    assert proc.returncode == 0, proc.stderr + text
    s = summary(out)
    assert s["world_size"] == 4 and s["steps"] == 60 and s["algorithm"] == algorithm
    with open(out / "config.json") as f:
        assert json.load(f)["hierarchical"] == (algorithm == "dpsgd")
    assert "train.sbatch: done" in text
    assert ("/mpirun --bind-to none -n 4 ..." if launcher == "mpirun" else "launch: srun --mpi=pmix") in text
    assert os.path.isfile(out / "checkpoints" / "latest.json")
    placement = ranks(out)
    check_binding(placement, launcher, 4)
    assert all(r["omp_num_threads"] == "1" and r["torch_threads"] == 1 for r in placement), placement


def test_srun_launch_crashed_in_mpi_init_runs_again(slurm):
    """Under srun, a step whose rank crashed inside MPI_Init (a stand-in printing Open MPI's
    backtrace) is named and launched once more; the job then succeeds."""
    env, tmp = slurm
    log = tmp / "init-crash.log"
    wrap = (f"{PYTHON} -m mpigossip launch --launcher srun -- {PYTHON} "
            f"{os.path.join(ROOT, 'tests', 'scripts', 'init_crash.py')} init")
    proc = subprocess.run(["sbatch", "--parsable", "--wait", "--ntasks=2", "-o", str(log), "--wrap", wrap],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    text = log.read_text()
    assert proc.returncode == 0, proc.stderr + text
    assert "a rank crashed inside MPI_Init" in text and "launching again (1 of 1)" in text, text
    assert sorted(line for line in text.splitlines() if line.startswith("started")) == \
        ["started: step 1 task 0", "started: step 1 task 1"], text


def test_failing_run_fails_the_job(slurm):
    env, tmp = slurm
    log = tmp / "fail.log"
    proc = sbatch(env, "train.sbatch", "-o", str(log),
                  extra={"DATASET": "/nonexistent/data.npz", "OUT": str(tmp / "fail")})
    assert proc.returncode != 0
    assert "/nonexistent/data.npz: no such file" in log.read_text()


@on_four_nodes
def test_preempted_job_requeues_and_resumes_to_the_same_result(slurm):
    env, tmp = slurm
    settings = {"STEPS": "800", "CKPT_EVERY": "0", "EXTRA": "--eval-every 400"}
    ref = tmp / "uninterrupted"
    proc = sbatch(env, "train.sbatch", "-o", str(tmp / "ref.log"), extra=dict(settings, OUT=str(ref)))
    assert proc.returncode == 0, proc.stderr
    out, log = tmp / "preempted", tmp / "preempted.log"
    waiter = submit(env, "train.sbatch", "-o", str(log), extra=dict(settings, OUT=str(out)))
    try:
        metrics = out / "metrics-rank0.jsonl"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # signal once the run is well under way
            if metrics.exists() and sum(1 for _ in open(metrics)) > 100:
                break
            time.sleep(0.2)
        job = job_fields(env, "mpigossip-train")
        assert job, "the job is not running"
        subprocess.run(["scancel", "--signal=USR1", "--batch", job["JobId"]], check=True, env=env)
    except BaseException:
        waiter.kill()
        raise
    text = finish(waiter, log)
    assert "asking the ranks to checkpoint" in text and "requeueing job" in text, text
    assert "resuming from" in text, text
    assert summary(out)["steps"] == 800
    same_result(summary(out), summary(ref))


def test_compare_job_and_array_with_collect(slurm):
    env, tmp = slurm
    settings = {"ALGORITHMS": "allreduce sgp", "LRS": "0.1", "STEPS": "40"}
    one = tmp / "compare-one"
    proc = sbatch(env, "compare.sbatch", "-o", str(tmp / "compare-one.log"), extra=dict(settings, OUT=str(one)))
    assert proc.returncode == 0, proc.stderr + (tmp / "compare-one.log").read_text()
    assert (one / "compare.md").read_text().count("\n") == 4
    sweep = tmp / "sweep"
    array = sbatch(env, "compare.sbatch", "--array=0-1", "-o", str(tmp / "array-%a.log"), wait=False,
                   extra=dict(settings, OUT=str(sweep)))
    assert array.returncode == 0, array.stderr
    collect = sbatch(env, "compare.sbatch", f"--dependency=afterok:{job_id(array)}", "--ntasks=1",
                     "-o", str(tmp / "collect.log"), extra={"OUT": str(sweep), "COLLECT": "1"})
    assert collect.returncode == 0, collect.stderr + (tmp / "collect.log").read_text()
    rows = json.load(open(sweep / "compare.json"))
    assert [r["algorithm"] for r in rows] == ["allreduce", "sgp"]
    assert "| allreduce | 0.1 |" in (tmp / "collect.log").read_text()


@on_four_nodes
def test_bench_job(slurm):
    env, tmp = slurm
    out, log = tmp / "bench", tmp / "bench.log"
    proc = sbatch(env, "bench.sbatch", "-o", str(log), extra={"SIZES_MB": "1", "REPEATS": "3", "STEPS": "40",
                                                              "OUT": str(out)})
    assert proc.returncode == 0, proc.stderr + log.read_text()
    rows = json.load(open(out / "comm.json"))
    assert {r["what"] for r in rows} >= {"AllreduceAverager.average / Allreduce", "PushSum.step / Isend+Irecv",
                                       "PushSum.step / Isend+Irecv+combine"}
    assert all(r["q1"] <= r["ratio"] <= r["q3"] for r in rows)
    table = (out / "stragglers" / "compare.md").read_text()
    assert all(f"| {a} |" in table for a in ("allreduce", "sgp", "osgp", "gossip-pull", "easgd"))
