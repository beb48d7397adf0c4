"""The jobs/ scripts with `sbatch --wait --nodes=4` on a Slurm across the emulated nodes.

Run by tests/cluster/run.sh once the emulated cluster is up (not collected by a plain
`pytest tests`: the file name does not start with test_). The module's fixture starts Slurm on
the cluster (tests/slurm/start.sh --cluster: slurmctld in the head namespace, one slurmd per
node) and stops it. Checked: ranks on 4 hosts with the GPU binding and OMP_NUM_THREADS each
launcher gives per node; compare and bench across nodes; preemption and requeue; a node lost
mid-job (its switch port down) ending NODE_FAIL, requeued, and resumed from the checkpoint once
the node is back, with the same result as an uninterrupted run; a rank killed under
ON_FAILURE=continue, survived by the others.
"""

import json
import os
import shutil
import signal
import subprocess
import time

import pytest

from mpigossip.train.handover import weight_accounted
from tests.slurm.jobs import check_binding, finish, job_fields, ranks, same_result, sbatch, start, stop, submit, summary

CLUSTER_DIR = os.environ.get("MPIGOSSIP_CLUSTER_DIR", "/tmp/mpigossip-cluster")
NODES = ["node1", "node2", "node3", "node4"]
# One run, three ways: uninterrupted, preempted, and with a node lost. 2000 steps of SGP on 4
# nodes take 10-17 s here: time to act after the first checkpoint (step 250).
LONG = {"STEPS": "2000", "CKPT_EVERY": "250", "EXTRA": "--eval-every 1000"}


def cluster_settings():
    with open(os.path.join(CLUSTER_DIR, "cluster")) as f:
        return dict(item.split("=", 1) for item in f.read().split())


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    if not os.path.isfile(os.path.join(CLUSTER_DIR, "cluster")):
        pytest.fail("no emulated cluster: tests/cluster/run.sh starts one")
    env = start(cluster=True)
    yield env, tmp_path_factory.mktemp("slurm-nodes")
    stop(cluster=True)


def run_ok(proc, log):
    text = log.read_text() if log.exists() else ""
    assert proc.returncode == 0, proc.stderr + text
    return text


@pytest.mark.parametrize("launcher, per_node, cpus", [("srun", 2, 2), ("mpirun", 2, 1)])
def test_train_on_four_nodes(slurm, launcher, per_node, cpus):
    env, tmp = slurm
    out, log = tmp / f"train-{launcher}", tmp / f"train-{launcher}.log"
    proc = sbatch(env, "train.sbatch", "--nodes=4", f"--ntasks-per-node={per_node}", f"--cpus-per-task={cpus}",
                  "-o", str(log), extra={"STEPS": "60", "OUT": str(out), "LAUNCHER": launcher})
    text = run_ok(proc, log)
    assert ("/mpirun --bind-to none -n 8 ..." if launcher == "mpirun" else "launch: srun --mpi=pmix") in text, text
    s = summary(out)
    assert s["world_size"] == 4 * per_node and s["steps"] == 60 and s["final_accuracy"] > 0.8, s
    placement = ranks(out)
    by_host = check_binding(placement, launcher, per_node)
    assert sorted(by_host) == NODES and all(len(rs) == per_node for rs in by_host.values()), by_host
    assert all(r["omp_num_threads"] == str(cpus) and r["torch_threads"] == cpus for r in placement), placement


def test_compare_on_four_nodes(slurm):
    env, tmp = slurm
    out, log = tmp / "compare", tmp / "compare.log"
    proc = sbatch(env, "compare.sbatch", "--nodes=4", "--ntasks-per-node=1", "-o", str(log),
                  extra={"ALGORITHMS": "allreduce sgp", "LRS": "0.1", "STEPS": "40", "OUT": str(out)})
    run_ok(proc, log)
    table = (out / "compare.md").read_text()
    assert "| allreduce | 0.1 |" in table and "| sgp | 0.1 |" in table, table
    assert {r["host"] for r in ranks(out / "sgp-lr0.1")} == set(NODES)


def test_bench_on_four_nodes(slurm):
    env, tmp = slurm
    out, log = tmp / "bench", tmp / "bench.log"
    proc = sbatch(env, "bench.sbatch", "--nodes=4", "--ntasks-per-node=1", "-o", str(log),
                  extra={"SIZES_MB": "1", "REPEATS": "3", "STEPS": "40", "OUT": str(out)}, timeout=400)
    run_ok(proc, log)
    rows = json.load(open(out / "comm.json"))
    assert {r["what"] for r in rows} >= {"AllreduceAverager.average / Allreduce", "PushSum.step / Isend+Irecv"}
    assert all(r["q1"] <= r["ratio"] <= r["q3"] for r in rows)
    table = (out / "stragglers" / "compare.md").read_text()
    assert all(f"| {a} |" in table for a in ("allreduce", "sgp", "osgp", "gossip-pull", "easgd"))


@pytest.fixture(scope="module")
def uninterrupted(slurm):
    env, tmp = slurm
    out, log = tmp / "uninterrupted", tmp / "uninterrupted.log"
    proc = sbatch(env, "train.sbatch", "--nodes=4", "--ntasks-per-node=1", "-o", str(log),
                  extra=dict(LONG, OUT=str(out)))
    run_ok(proc, log)
    return summary(out)


def wait_for_checkpoint(out, waiter, timeout=120):
    """Until the run wrote its first checkpoint (and is still going)."""
    pointer = out / "checkpoints" / "latest.json"
    deadline = time.monotonic() + timeout
    while not pointer.exists():
        assert waiter.poll() is None, "the job ended before its first checkpoint"
        assert time.monotonic() < deadline, "no checkpoint within the time"
        time.sleep(0.2)


def test_preempted_job_on_four_nodes_resumes_to_the_same_result(slurm, uninterrupted):
    env, tmp = slurm
    out, log = tmp / "preempted", tmp / "preempted.log"
    waiter = submit(env, "train.sbatch", "--nodes=4", "--ntasks-per-node=1", "-o", str(log),
                    extra=dict(LONG, OUT=str(out)))
    try:
        wait_for_checkpoint(out, waiter)
        job = job_fields(env, "mpigossip-train")
        assert job.get("JobState") == "RUNNING", job
        subprocess.run(["scancel", "--signal=USR1", "--batch", job["JobId"]], check=True, env=env, timeout=30)
    except BaseException:
        waiter.kill()
        raise
    text = finish(waiter, log)
    assert "asking the ranks to checkpoint" in text and "requeueing job" in text and "resuming from" in text, text
    assert summary(out)["steps"] == 2000
    same_result(summary(out), uninterrupted)


def reboot_node(k):
    """Node k reboots: every process in its namespace (slurmd, and a step's slurmstepd and rank
    still running there from before the cut) is killed, as a reboot ends them, and its slurmd
    starts afresh (tests/slurm/start.sh starts the daemons that are not running). Left running,
    the old step registers with the controller as a step of the requeued job, which then has
    to kill it while the job starts again."""
    namespace = f"{cluster_settings()['prefix']}-n{k}"
    pids = [int(p) for p in subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True,
                                           timeout=30).stdout.split()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 30
    while any(os.path.exists(f"/proc/{pid}") for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    # what the dead steps left in the node's spool and TmpFS goes too, as from folders on tmpfs (a stale
    # pmix.<job>.0 folder or stepd.slurm.pmix.<job>.0 socket fails the requeued job's step, of the same name)
    for folder in ("spool", "tmp"):
        shutil.rmtree(os.path.join(CLUSTER_DIR, "slurm", folder, f"node{k}"), ignore_errors=True)
    start(cluster=True)


def test_node_lost_mid_job_ends_node_fail_and_resumes_when_back(slurm, uninterrupted):
    """node3's switch port goes down after the first checkpoint: Slurm finds the node not
    responding (SlurmdTimeout=20), ends the job NODE_FAIL and requeues it; the job waits for 4
    nodes; the port comes back and the node reboots (what ran on it ends; its slurmd starts afresh
    and registers), ReturnToService=2 puts it back in service and the job resumes from its checkpoint to the
    uninterrupted run's result. (Without the restart the controller finds the node again only
    at its next ping of down nodes, about 110 s later here: the same path, slower.)"""
    env, tmp = slurm
    out, log = tmp / "node-lost", tmp / "node-lost.log"
    switch = f"{cluster_settings()['prefix']}-sw"
    waiter = submit(env, "train.sbatch", "--nodes=4", "--ntasks-per-node=1", "-o", str(log),
                    extra=dict(LONG, OUT=str(out)))
    try:
        wait_for_checkpoint(out, waiter)
        subprocess.run(["ip", "-n", switch, "link", "set", "sw3", "down"], check=True, timeout=30)
        cut = time.monotonic()
        while True:   # requeued: pending again, restarted once
            job = job_fields(env, "mpigossip-train")
            if job.get("JobState") == "PENDING" and job.get("Restarts") == "1":
                break
            assert waiter.poll() is None, "sbatch --wait returned while the node was away"
            assert time.monotonic() - cut < 120, f"not requeued within 120 s of the cut: {job}"
            time.sleep(1)
        requeued = time.monotonic() - cut
        state = subprocess.run(["sinfo", "-h", "-n", "node3", "-o", "%t"], capture_output=True, text=True,
                               env=env, timeout=30).stdout.strip()
        assert state.startswith("down"), state
    except BaseException:
        waiter.kill()
        raise
    finally:
        subprocess.run(["ip", "-n", switch, "link", "set", "sw3", "up"], timeout=30)
    reboot_node(3)
    text = finish(waiter, log, env=env)
    assert "DUE TO NODE FAILURE" in text and "resuming from" in text and "train.sbatch: done" in text, text
    print(f"node lost: requeued {requeued:.0f} s after the cut")
    assert summary(out)["steps"] == 2000
    same_result(summary(out), uninterrupted)
    assert {r["host"] for r in ranks(out)} == set(NODES)


# Spawning onto a spare node under Slurm: Open MPI 5.0.11's launcher lost a survivor's daemon
# ("PRTE has lost communication with a remote daemon", after a PMIX_ERROR in pmix_server_dyn.c) and
# ended the job in 4 of 7 runs here (docs/CLUSTER.md): run it on demand, not in the test command.
SPARES_CASE = pytest.mark.skipif(not os.environ.get("MPIGOSSIP_TEST_SPARES"), reason="Open MPI 5.0.11 loses a "
                                 "daemon in most spawns onto a spare node (docs/CLUSTER.md); MPIGOSSIP_TEST_SPARES=1")


def launcher_died_after_the_run(text, out):
    """Whether a run that spawned a newcomer ended whole (every rank's last line printed, the
    summary written at 300 steps) and only then did Open MPI 5.0.11's launcher fail ("PRTE has
    lost communication with a remote daemon", "free(): invalid pointer", a segfault: 5 of 14
    runs of the replace case once, 1 of 10 on the code before it, never before a rank ended;
    docs/CLUSTER.md). Everything the test checks is then checked as on a clean exit."""
    done = os.path.isfile(out / "summary.json") and summary(out).get("steps") == 300
    return done and "ranks, 300 steps" in text


def launcher_failed_in_the_spawn(proc, text, out):
    """Whether Open MPI 5.0.11's launcher failed while it spawned the newcomer, before the run
    ended ("PMIX_ERROR in file prrte/src/prted/pmix/pmix_server_dyn.c", then "PRTE has lost
    communication with a remote daemon", once in 3 fresh-clone CI runs; or then nothing, the
    launcher crashed, exit 139, once at 757a47e; docs/CLUSTER.md): the launcher's fault, which
    ends the job (no summary). A user's remedy is to submit again (or requeue): the test does
    so once, and holds the second job to every check."""
    return (proc.returncode != 0 and "pmix_server_dyn.c" in text
            and not os.path.isfile(out / "summary.json"))


@pytest.mark.parametrize("mode", ["continue", "replace", pytest.param("spare", marks=SPARES_CASE)])
def test_a_killed_rank_is_survived_under_slurm(slurm, mode):
    """`ON_FAILURE=continue`: train.sbatch starts the ranks with mpirun --with-ft ulfm inside the
    allocation; rank 2 (on node3) kills itself at step 100 and the 3 survivors finish the run,
    checkpointing at their size (CKPT_EVERY=100: the last step, 300, of 3 ranks is the latest).
    `ON_FAILURE=replace`: the survivors spawn a newcomer on a survivor's node (every slot of the
    allocation counts as taken: oversubscribed), which heals from a donor across the 1 Gbit
    links; the run ends at 4 ranks. `spare`: replace with `SPARES=1`: ranks on node1-3 only, and
    the newcomer starts on node4, kept empty for it; the run ends at 3 ranks."""
    env, tmp = slurm
    for attempt in ("", "-again"):
        out, log = tmp / f"survive-{mode}{attempt}", tmp / f"survive-{mode}{attempt}.log"
        extra = {"STEPS": "300", "OUT": str(out), "ON_FAILURE": "continue" if mode == "continue" else "replace",
                 "EXTRA": "--kill 2:100", "SPARES": "1" if mode == "spare" else "0"}
        proc = sbatch(env, "train.sbatch", "--nodes=4", "--ntasks-per-node=1", "-o", str(log), extra=extra)
        text = log.read_text() if log.exists() else ""
        if not (mode != "continue" and attempt == "" and launcher_failed_in_the_spawn(proc, text, out)):
            break
        print(f"({mode}) Open MPI's launcher failed during the spawn (docs/CLUSTER.md); the job once more")
    if mode != "continue" and proc.returncode != 0 and launcher_died_after_the_run(text, out):
        print(f"({mode}) the run ended, then Open MPI's launcher failed (exit {proc.returncode}; docs/CLUSTER.md)")
    else:
        run_ok(proc, log)
    assert "--with-ft ulfm" in text and "sgp: rank 2 failed (killed at step 100); met at step" in text, text
    s = summary(out)
    [f] = s["failures"]
    initial = 3 if mode == "spare" else 4
    size = initial - 1 if mode == "continue" else initial
    assert s["initial_world_size"] == initial and s["world_size"] == size and f["ranks"] == [2], s
    assert s["final_accuracy"] >= 0.9 and f["recovery_s"] < 15, s
    latest = json.load(open(out / "checkpoints" / "latest.json"))  # the last step, after the shrink
    assert latest["step"] == 300 and latest["world_size"] == size and latest["initial_world_size"] == initial, latest
    if mode != "continue":
        replaced = f["replaced"]
        assert f"sgp: rank 2 replaced: back at {initial} ranks" in text and replaced["ranks"] == [2], (text, replaced)
        # on a survivor's node (Open MPI 5.0.11 cannot start one where only the dead rank lived), or the spare
        if mode == "spare":
            assert "nodes kept for newcomers: node4" in text and replaced["hosts"]["2"] == "node4", (text, replaced)
        else:
            assert replaced["hosts"]["2"] in ("node1", "node2", "node4"), replaced
        assert abs(s["weight_sum"][0] - weight_accounted(s)) < 1e-9 and s["rank_accuracy_min"] >= 0.9, s
        print(f"replaced ({mode}) under Slurm across nodes: spawn {replaced['spawn_s']:.2f} s, heal "
              f"{replaced['heal_s']:.2f} s, back at {initial} ranks {replaced['back_at_s'] - f['recovered_at_s']:.2f} s "
              "after the recovery")
