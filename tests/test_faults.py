"""A lost rank ends the job with a message naming rank, operation and peer: never a hang."""

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from mpigossip.resilience import failures
from mpigossip.train.handover import weight_accounted

pytestmark = pytest.mark.faults   # a timed step of its own (tests/run.sh); the training cases run in the train step

HERE = os.path.dirname(os.path.abspath(__file__))
BIN = os.path.dirname(sys.executable)
MPIEXEC = os.path.join(BIN, "mpigossip-mpiexec")


#: Open MPI 5's launcher failing to start, before any rank runs (PMIx's listener; seen once in CI,
#: and upstream: lfortran/lfortran#8610): such a launch is made again, once.
LAUNCHER_STARTUP_FAULT = "The PMIx server's listener thread failed to start"


def run(args, timeout=90, env=None):
    env = dict(env or os.environ, PYTHONUNBUFFERED="1")
    for _ in range(2):
        t0 = time.monotonic()
        proc = subprocess.run([MPIEXEC] + args, capture_output=True, text=True, timeout=timeout, env=env)
        if proc.returncode == 0 or LAUNCHER_STARTUP_FAULT not in proc.stdout + proc.stderr:
            break
        sys.stderr.write(f"tests/test_faults.py: the launcher failed to start ({LAUNCHER_STARTUP_FAULT}); again\n")
    return proc, time.monotonic() - t0


LOST_PEER = os.path.join(HERE, "scripts", "lost_peer.py")


def _ranks_alive():
    """Whether a rank (``python lost_peer.py ...``, not the launcher) is still running."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if len(argv) > 1 and argv[1] == LOST_PEER.encode():
            return True
    return False


def run_lost_peer(launcher_args, *script_args, timeout=90, launcher_grace=10):
    """Launch lost_peer.py; return (exit status, output, seconds until every rank had ended).

    Open MPI 5's launcher under ``--enable-recovery`` sometimes stays up after every rank has
    aborted (PRRTE, not the ranks: seen in about 1 run in 12 with the code before the chunked
    PushSum step, and more often since, as the timing of the aborts changed). The ranks' exit
    is what this test is about, so once none is left the launcher gets ``launcher_grace``
    seconds and is then ended here (exit status None).
    """
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with tempfile.TemporaryFile("w+") as out:
        t0 = time.monotonic()
        proc = subprocess.Popen([MPIEXEC, *launcher_args, sys.executable, LOST_PEER, *script_args], stdout=out,
                                stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
        seen = gone = None
        status = None
        while True:
            status = proc.poll()
            now = time.monotonic() - t0
            if status is not None:
                gone = gone if gone is not None else now
                break
            alive = _ranks_alive()
            seen = seen or alive
            if seen and not alive and gone is None:
                gone = now
            if now > timeout or (gone is not None and now - gone > launcher_grace):
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                assert gone is not None, f"ranks still running after {timeout} s"
                break
            time.sleep(0.2)
        out.seek(0)
        return status, out.read(), gone


@pytest.mark.parametrize("how, extra", [
    ("stop", []),                      # a hung rank: the launcher sees nothing wrong
    ("kill", ["--enable-recovery"]),   # a dead rank, with the launcher told to keep the job
])
def test_lost_peer_ends_job_with_a_named_timeout(how, extra):
    status, out, seconds = run_lost_peer(extra + ["-n", "4"], how)
    assert status != 0, out
    assert "finished without noticing" not in out
    # Whichever live rank's deadline fires first ends the job (under load not always rank 2, whose
    # only in-peer is rank 1): it must name the lost rank 1 among those it waited for.
    assert re.search(r"mpigossip: rank [023]/4: PushSum\.step \(step 5\): timed out after 3 s waiting for "
                     r"rank (1\b|[0-9, ]*\b1\b)", out), out
    assert seconds < 60


@pytest.mark.parametrize("where, message", [
    ("construct", r"mpigossip: rank [023]/4: PushSum \(construction\): timed out after 3 s "
                  r"waiting for all ranks \(Ibarrier\)"),
    ("average", r"mpigossip: rank [023]/4: AllreduceAverager\.average: timed out after 3 s "
                r"waiting for all ranks \(a blocking collective; the watchdog\)"),
    # on_failure="continue": a hung peer is no failure ULFM reports; the exchange's own deadline
    # names the peers still awaited
    ("tolerant", r"mpigossip: rank [023]/4: PushSum\.step \(step 5\): timed out after 3 s waiting for "
                 r"rank (1\b|[0-9, ]*\b1\b)"),
])
def test_hung_peer_in_a_guarded_wait_ends_job_with_a_named_timeout(where, message):
    """Collective construction, the blocking average and the fault-tolerant exchange are
    guarded too: a rank that never arrives makes the others abort, naming it, not hang."""
    status, out, seconds = run_lost_peer(["-n", "4"], "stop", where)
    assert status != 0, out
    assert "finished without noticing" not in out
    assert re.search(message, out), out
    assert seconds < 60


def test_info_under_mpiexec():
    proc, _ = run(["-n", "4", sys.executable, "-m", "mpigossip", "info", "--json"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    import json
    info = json.loads(proc.stdout)
    assert info["world_size"] == 4 and [r["rank"] for r in info["ranks"]] == [0, 1, 2, 3]
    assert info["cuda_aware_mpi"] is False and info["thread_level"] == "multiple"
    assert info["one_sided_progress"].startswith("off: ")  # an explicit choice, off by default
    assert {r["local_rank"] for r in info["ranks"]} == {0, 1, 2, 3}
    proc, _ = run(["-n", "2", sys.executable, "-m", "mpigossip", "info"], timeout=120)
    assert proc.returncode == 0 and "CUDA-aware MPI: no" in proc.stdout and proc.stdout.count("mpigossip ") == 1


SURVIVE = os.path.join(HERE, "scripts", "survive.py")


def survivors(out):
    import json
    return [json.loads(line.split("survive: ", 1)[1]) for line in out.splitlines() if line.startswith("survive: ")]


@pytest.mark.parametrize("n, args", [
    (4, ["--victim", "3"]),                                  # shared memory, 1 MB
    (5, ["--victim", "2", "--kind", "torch", "--mb", "4", "--mid"]),  # dies mid-exchange (rendezvous), torch
    (3, ["--victim", "0", "--die", "0"]),                    # rank 0, before its first step
    (4, ["--victim", "1", "--algo", "dpsgd"]),
    (4, ["--victim", "2", "--algo", "allreduce", "--mb", "4", "--mid"]),
    (4, ["--victim", "1", "--algo", "allreduce-overlap", "--mb", "4", "--mid"]),  # killed while its ring is in flight
    (4, ["--victim", "1", "--algo", "gossip-push", "--mb", "4", "--mid", "--steps", "80"]),  # 3 random pushers:
    # 31 steps after the failure left their spread near the 1e-6 checked, under load (4 of 6 runs above it)
    (4, ["--victim", "3", "--algo", "osgp"]),                # overlap mode: shares in flight when it dies
    (5, ["--victim", "2", "--algo", "osgp", "--kind", "torch", "--mb", "4", "--mid"]),
    (4, ["--victim", "3", "--algo", "agp", "--steps", "120"]),  # AGP: nobody waits; it mixes slower
    (5, ["--victim", "2", "--algo", "agp", "--mb", "4", "--mid", "--steps", "120"]),
    # two peers a step, killed at a boundary and mid-step at other steps (a share added in part,
    # or its x without its w, broke z - base in 4-6 of 10 runs each before failures.Message)
    (5, ["--algo", "agp", "--peers", "2", "--die", "7", "--steps", "37", "--compute-ms", "2"]),
    (5, ["--algo", "agp", "--peers", "2", "--die", "12", "--mid", "--steps", "42", "--compute-ms", "2"]),
    (5, ["--algo", "osgp", "--peers", "2", "--die", "9", "--steps", "39", "--compute-ms", "2"]),
    (5, ["--algo", "osgp", "--peers", "2", "--die", "16", "--mid", "--steps", "46", "--compute-ms", "2"]),
    # unequal weights: a survivor that kept its (x, w) while a live peer added its share counted it
    # twice (Σw above the world's less the victim's, every run before PushSum._settle)
    (5, ["--algo", "pushsum", "--unequal", "--die", "6", "--steps", "26", "--compute-ms", "2"]),
    (5, ["--algo", "pushsum", "--unequal", "--die", "10", "--mid", "--steps", "30", "--compute-ms", "2"]),
    # a second rank dies in the recovery, between the survivors' exchange and their agreement on it
    # (an ordinary collective then failed on some survivors: a raw MPI.Exception ended them)
    (5, ["--algo", "pushsum", "--unequal", "--crash-in-recovery", "1", "--steps", "30", "--compute-ms", "2"]),
    # every weight 0.1: the survivors hold Σw near 0.3, and their steps on z would grow 10x; the
    # recovery brings Σw back above half the survivors by a power of two (none before it did)
    (4, ["--algo", "pushsum", "--w0", "0.1", "--mid", "--steps", "30", "--compute-ms", "2"]),
    (4, ["--algo", "osgp", "--w0", "0.1", "--steps", "30", "--compute-ms", "2"]),
    (4, ["--algo", "agp", "--w0", "0.1", "--mid", "--steps", "60", "--compute-ms", "2"]),
    (5, ["--algo", "agp", "--crash-in-recovery", "1", "--steps", "60", "--compute-ms", "2"]),
    # the outer methods over their bases (an outer step every 3, local updates between), killed
    # between outer steps and inside one (SlowMo over PushSum with unequal weights broke z - base,
    # failure or not, before the first anchor was x / w)
    (5, ["--algo", "pushsum", "--outer", "slowmo", "--unequal", "--die", "8", "--mid", "--steps", "30",
         "--compute-ms", "2"]),
    (5, ["--algo", "pushsum", "--outer", "diloco", "--die", "6", "--steps", "30", "--compute-ms", "2"]),
    (5, ["--algo", "allreduce", "--outer", "slowmo", "--die", "5", "--mid", "--steps", "30", "--compute-ms", "2"]),
    (5, ["--algo", "dpsgd", "--outer", "localsgd", "--die", "4", "--steps", "30", "--compute-ms", "2"]),
    (5, ["--algo", "gossip-push", "--outer", "diloco", "--die", "11", "--mid", "--steps", "40", "--compute-ms", "2"]),
])
def test_survivors_of_a_killed_rank_go_on(n, args, tmp_path):
    """PushSum (synchronous and overlap mode), AGP, D-PSGD, AllreduceAverager and gossip push, and
    the outer methods over them, with on_failure="continue" under ULFM: a rank SIGKILLs itself; every survivor learns
    it in that step, recovers within 15 s and takes every step; the failure is recorded alike
    everywhere; Σx and Σw are conserved over the survivors afterwards and Σw plus the weight
    lost is the world size, and no more than the victim's weight is gone; z converges and
    z - base stays one constant over the elements (tests/scripts/survive.py checks, per survivor)."""
    record = ["--record", str(tmp_path / "victim")]
    proc, _ = run(["--with-ft", "ulfm", "-n", str(n), sys.executable, SURVIVE, *args, *record], timeout=120)
    found = survivors(proc.stdout)
    left = n - 1 - ("--crash-in-recovery" in args)
    assert len(found) == left and all(s["ok"] for s in found), proc.stdout + proc.stderr
    assert all(s["size"] == left for s in found)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("n, args", [
    (4, ["--algo", "pushsum", "--mid"]),
    (5, ["--algo", "agp", "--peers", "2", "--die", "12", "--mid", "--steps", "42", "--compute-ms", "2"]),
    (5, ["--algo", "osgp", "--peers", "2", "--die", "9", "--steps", "39", "--compute-ms", "2"]),
    (4, ["--algo", "allreduce", "--mid"]),
])
def test_survivors_of_a_killed_rank_go_on_with_messages_in_pieces(n, args, tmp_path):
    """As above, with every fault-tolerant message sent in pieces of 40,000 bytes or less (27 for the 1 MiB buffer)
    ($MPIGOSSIP_CHUNK_BYTES; the default is the TCP eager limit less 4 KiB): a share is
    combined only once every piece has arrived, so a rank killed between pieces leaves no
    survivor with part of a share."""
    env = dict(os.environ, MPIGOSSIP_CHUNK_BYTES="40000")
    record = ["--record", str(tmp_path / "victim")]
    proc, _ = run(["--with-ft", "ulfm", "-n", str(n), sys.executable, SURVIVE, *args, *record], timeout=120, env=env)
    found = survivors(proc.stdout)
    assert len(found) == n - 1 and all(s["ok"] for s in found), proc.stdout + proc.stderr
    assert all(s["chunk_bytes"] == 40000 for s in found), found
    assert proc.returncode == 0, proc.stdout + proc.stderr


SURVIVE_GROUPS = os.path.join(HERE, "scripts", "survive_groups.py")


@pytest.mark.parametrize("args", [
    ["--algo", "sgp", "--mid", "--mb", "4"],   # killed inside its exchange: survivors in different groups
    ["--algo", "allreduce-params"],            # parameters in two dtypes and BatchNorm statistics: 3 groups
    ["--algo", "allreduce", "--mid", "--mb", "4"],   # gradients in 5 buckets, killed in backward with some in flight
    # one bucket completed with the victim, the next not: the survivors mean their own gradients again
    # (without restoring the first bucket's, its gradients were inexact on every run)
    ["--algo", "allreduce", "--between-buckets", "--mb", "4"],
])
def test_survivors_of_a_killed_rank_go_on_with_several_groups(args):
    """A torch wrapper whose parameters form several groups (two dtypes; AllReduce's
    floating-point buffers): rank 3 of 4 is killed; every group recovers, together, on every
    survivor; each stands at the same step, the failure is recorded once per group and once by
    the wrapper, SGP's weight is accounted for per group, and the survivors' consensus models
    agree (tests/scripts/survive_groups.py checks, per survivor). AllReduce SGD on gradients:
    its buckets, overlapped with the backward pass, survive too (the last gradients the exact
    mean of the survivors' own)."""
    import json
    proc, _ = run(["--with-ft", "ulfm", "-n", "4", sys.executable, SURVIVE_GROUPS, *args], timeout=120)
    found = [json.loads(line.split("survive_groups: ", 1)[1]) for line in proc.stdout.splitlines()
             if line.startswith("survive_groups: ")]
    assert len(found) == 3 and all(s["ok"] for s in found), proc.stdout + proc.stderr
    assert all(s["groups"] >= 2 for s in found) and proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("algorithm", ["sgp", pytest.param("osgp", marks=pytest.mark.train),
                                       pytest.param("agp", marks=pytest.mark.train), "gossip-push", "slowmo",
                                       "allreduce"])  # (train: the units step stays under half its limit)
def test_training_survives_a_killed_rank(tmp_path, algorithm):
    """`train --on-failure continue`: rank 3 of 4 dies at step 100 of 300; the 3 survivors train
    on to the end and reach 90% on the digits; summary.json records the failure (SGP: with the
    PushSum weight lost).

    Gossip push: two failures one after the other (rank 4 of 5 at step 100, rank 1 at 200): the
    3 survivors finish, each failure recorded with the ranks of the launch and the size after.

    SGP, with checkpoints every 50 steps: rank 3 dies while writing the one at step 100, which
    is left uncommitted (the one at 50, of 4 ranks, stays the latest); the survivors recover in
    their next step and checkpoint at their new size; a relaunch on 3 ranks resumes exactly
    from the last one (step 250) and keeps the failure in its summary.

    SlowMo over SGP (an average every 32 steps), with checkpoints: the survivors meet the
    failure at the next average (step 127), where some complete their exchange and others do
    not; they agree that a rank failed and recover together, so that their checkpoints (step
    150 on) stay matched.

    OSGP (overlap, one step of delay) and AGP (no rank waits), with checkpoints every 50 steps:
    rank 3 killed at step 100; the shares in flight are lost with it (in the weight lost), the
    survivors checkpoint at their new size. AGP's survivors learn of it when a message to or
    from the dead rank fails (a few steps on: 19-41 here, within 150).

    AllReduce SGD (the gradients' mean): the survivors average their own gradients again over
    the survivors after the failure, so that their models stay equal (consensus distance 0)."""
    import json
    train = [sys.executable, "-m", "mpigossip", "train", "--algorithm", algorithm, "--steps", "300",
             "--on-failure", "continue", "--quiet", "--out", str(tmp_path)]
    launch, env, met_at = ["--with-ft", "ulfm", "-n", "4"], None, (100, 102)
    if algorithm == "gossip-push":  # two failures, one after the other: 5 ranks, 3 survivors
        launch[-1] = "5"
        proc, _ = run([*launch, *train, "--kill", "4:100", "--kill", "1:200"], timeout=240)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        s = json.load(open(tmp_path / "summary.json"))
        assert s["initial_world_size"] == 5 and s["world_size"] == 3 and s["final_accuracy"] >= 0.9, s
        assert [(f["ranks"], f["size"], f["killed_at_step"], f["met_at_step"]["first"]) for f in s["failures"]] == \
            [([4], 4, 100, 100), ([1], 3, 200, 200)], s
        return
    if algorithm == "sgp":
        launch += ["-x", "MPIGOSSIP_CRASH_IN_CHECKPOINT"]
        env = dict(os.environ, MPIGOSSIP_CRASH_IN_CHECKPOINT="100:3")
        extra = ["--checkpoint-every", "50"]
    elif algorithm in ("osgp", "agp"):
        extra = ["--kill", "3:100", "--checkpoint-every", "50"]
        met_at = (100, 106) if algorithm == "osgp" else (100, 250)   # (measured: OSGP 102-104)
    elif algorithm == "slowmo":
        extra, met_at = ["--base", "sgp", "--kill", "3:100", "--checkpoint-every", "50"], (127, 127)
    else:
        extra = ["--kill", "3:100"]
    proc, _ = run([*launch, *train, *extra], timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{algorithm}: rank 3 failed" in proc.stdout and "3 survivors go on" in proc.stdout, proc.stdout
    s = json.load(open(tmp_path / "summary.json"))
    assert s["initial_world_size"] == 4 and s["world_size"] == 3 and s["steps"] == 300, s
    [f] = s["failures"]
    # one failure, one record: killed at (the injection), met by the survivors between, recovered
    met = f["met_at_step"]
    killed = None if algorithm == "sgp" else 100   # sgp's case dies in a checkpoint (the crash hook), not --kill
    assert f["ranks"] == [3] and f["size"] == 3 and f["killed_at_step"] == killed, f
    assert met_at[0] <= met["first"] <= met["last"] <= met_at[1], f
    assert f["recovery_s"] < 15 and f["recovered_at_s"] > 0 and "algorithm_step" in f, f
    if killed is not None:
        assert f"(killed at step 100); met at step {met['first']}" in proc.stdout, proc.stdout
    if algorithm in ("sgp", "slowmo"):
        assert 0 < f["weight_lost"] <= 2, f
    if algorithm in ("osgp", "agp"):   # its own weight and what was in flight to or from it
        assert 0 < f["weight_lost"] < 4, f
    if algorithm in ("sgp", "osgp", "agp"):   # exact mass over the survivors, and AGP's floor held
        assert all(abs(total - weight_accounted(s)) < 1e-9 for total in s["weight_sum"]), s
        assert s["weight_min"] >= 2.0 ** -11, s
    assert s["final_accuracy"] >= 0.9, s
    if algorithm == "allreduce":
        assert s["consensus_distance"] == 0, s
    if algorithm == "allreduce":
        return
    latest = json.load(open(tmp_path / "checkpoints" / "latest.json"))
    assert latest["step"] == 300 and latest["world_size"] == 3 and latest["initial_world_size"] == 4, latest
    assert sorted(os.listdir(tmp_path / "checkpoints" / latest["dir"])) == [f"rank-{r}.pt" for r in range(3)]
    if algorithm != "sgp":
        return
    proc, _ = run(["--with-ft", "ulfm", "-n", "3", *train[:7], "350", *train[8:], "--resume", str(tmp_path),
                   *extra], timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    resumed = json.load(open(tmp_path / "summary.json"))
    assert resumed["world_size"] == 3 and resumed["initial_world_size"] == 4 and resumed["steps"] == 350, resumed
    assert resumed["failures"] == s["failures"] and resumed["final_accuracy"] >= 0.9, resumed


SHRINK_HANGS = """
import time
from mpigossip import failures

class Comm:  # a revoked communicator whose MPI_Comm_shrink never returns
    def Get_size(self):
        return 4
    def Revoke(self):
        pass
    def Shrink(self):
        time.sleep(60)

failures.shrink(Comm(), 7, timeout=0.5, op="sgp (failure at step 7)")
print("returned")
"""


def test_a_shrink_that_hangs_ends_the_process_naming_it():
    """MPI_Comm_shrink has no deadline of its own (Open MPI's Ishrink fails on a revoked
    communicator): past the timeout the process ends (exit 1) with a message naming the
    operation and every thread's stack, instead of hanging forever."""
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", SHRINK_HANGS], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "returned" not in proc.stdout, proc.stdout + proc.stderr
    assert ("mpigossip: rank 0: sgp (failure at step 7): MPI_Comm_shrink did not return within 0.5 s; "
            "ending this process") in proc.stderr, proc.stderr
    assert "in Shrink" in proc.stderr, proc.stderr   # the stack of the thread that waited
    assert time.monotonic() - start < 30


ABORT_ONE = """
import sys, time
from mpi4py import MPI
from mpigossip import deadline
from mpigossip.__main__ import abort_on_uncaught
comm = MPI.COMM_WORLD
if comm.Get_rank() == 1:
    time.sleep(0.5)
    if sys.argv[1] == "exception":
        abort_on_uncaught(RuntimeError("loss is nan at step 3963"))
    deadline.abort(comm, "PushSum.drain: timed out after 3 s waiting for rank 2")
time.sleep(60)
print("rank", comm.Get_rank(), "still running after 60 s", flush=True)
"""


@pytest.mark.parametrize("how", ["exception", "timeout"])
def test_an_abort_ends_a_fault_tolerant_job(how):
    """Under ULFM (``--with-ft ulfm``) Open MPI's MPI_Abort ends only the rank that calls it:
    the others went on and the launcher waited for them (a NaN on one rank hung the job until
    an outer timeout). An uncaught exception or a deadline's abort ends the whole job there
    too, within seconds."""
    proc, seconds = run(["--with-ft", "ulfm", "-n", "3", sys.executable, "-c", ABORT_ONE, how], timeout=90)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "still running" not in proc.stdout, proc.stdout
    assert seconds < 30, (seconds, proc.stdout + proc.stderr)
    assert ("uncaught exception" if how == "exception" else "timed out after 3 s") in proc.stderr, proc.stderr


AGP_IN_FLIGHT = os.path.join(HERE, "scripts", "agp_in_flight.py")


@pytest.mark.parametrize("algo", ["agp", "osgp"])
def test_survivors_keep_what_they_sent_each_other(algo):
    """AGP and OSGP: a rank dies while shares between two survivors are in flight (one of them
    neither steps nor receives for 1.5 s). The survivors receive what they sent each other
    before the communicator is revoked: the weight lost is exactly the dead rank's, Σw over the
    survivors the rest (tests/scripts/agp_in_flight.py; revoking first lost the shares in
    flight)."""
    import json
    proc, _ = run(["--with-ft", "ulfm", "-n", "4", sys.executable, AGP_IN_FLIGHT, "--mb", "4", "--algo", algo],
                  timeout=120)
    found = [json.loads(line.split("agp_in_flight: ", 1)[1]) for line in proc.stdout.splitlines()
             if line.startswith("agp_in_flight: ")]
    assert len(found) == 3 and all(s["ok"] for s in found), proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stdout + proc.stderr


EXIT_DRAIN = os.path.join(HERE, "scripts", "exit_drain.py")


def test_survivors_leave_only_once_their_last_messages_are_out():
    """After a failure, ranks end with failures.exit (no MPI_Finalize). Survivors that send
    each other more than the TCP sockets take at once and then exit: every message arrives
    (exit waits for every rank to enter it; leaving at once lost queued messages in 5 of 6
    runs). Over TCP on one node (``btl tcp,self``), three launches (tests/scripts/exit_drain.py)."""
    for _ in range(3):
        proc, _ = run(["--with-ft", "ulfm", "--mca", "btl", "tcp,self", "-n", "6", sys.executable, EXIT_DRAIN],
                      timeout=60)
        found = [json.loads(line.split("exit_drain: ", 1)[1]) for line in proc.stdout.splitlines()
                 if line.startswith("exit_drain: ")]
        assert len(found) == 5 and all(s["ok"] for s in found), proc.stdout + proc.stderr
        assert proc.returncode == 0, proc.stdout + proc.stderr


COLLECTIVE_FAILURE = os.path.join(HERE, "scripts", "collective_failure.py")


@pytest.mark.parametrize("second", [False, True], ids=["one-death", "a-death-in-the-shrink"])
def test_a_collective_that_meets_a_death_reports_the_failure_not_err_in_status(second):
    """A deadline collective (``deadline.allgather``: a nonblocking collective under
    ``MPI_Testall``) that meets a dead rank raises the failure's own class on every survivor
    (``MPI_ERR_PROC_FAILED`` or ``MPI_ERR_REVOKED``), not ``MPI_ERR_IN_STATUS``; so a second
    death while the survivors exchange their step in ``failures.shrink`` makes them shrink
    again, where it ended the job before (tests/scripts/collective_failure.py; the second:
    ``MPIGOSSIP_CRASH_IN_RECOVERY=2:exchange``)."""
    env = dict(os.environ, **({failures.CRASH_IN_RECOVERY: "2:exchange"} if second else {}))
    n = 5 if second else 4
    proc, _ = run(["--with-ft", "ulfm", "-n", str(n), *(["-x", failures.CRASH_IN_RECOVERY] if second else []),
                   sys.executable, COLLECTIVE_FAILURE], timeout=60, env=env)
    out = proc.stdout + proc.stderr
    rows = [json.loads(line.split("collective_failure: ", 1)[1]) for line in proc.stdout.splitlines()
            if line.startswith("collective_failure: ")]
    lost = [2, 4] if second else [3]
    assert len(rows) == n - len(lost), out
    assert all(r["as_failure"] and r["lost"] == lost and r["size"] == n - len(lost) for r in rows), out
    assert proc.returncode == 0, out


GROW = os.path.join(HERE, "scripts", "grow.py")


@pytest.mark.parametrize("missing", [False, True], ids=["spawned", "spawn-refused"])
def test_a_killed_rank_is_replaced_and_the_job_grows_back(missing):
    """#45's first layer (mpigossip.resilience.grow): the survivors of a killed rank spawn a
    replacement that takes its number, and all four reach a broadcast and an Allreduce over the
    grown communicator (tests/scripts/grow.py). A spawn that cannot start leaves the survivors
    at three ranks with one warning, not hanging."""
    proc, rows, out = _grow("--heal", "broadcast", *(["--argv-missing"] if missing else []))
    if missing:
        assert len(rows) == 3 and all(r["ok"] and r["size"] == 3 and r["role"] == "survivor" for r in rows), out
        warned = [w for r in rows for w in r["failure"]["warnings"]]
        assert len(warned) == 1 and "no replacement for rank(s) [3]" in warned[0], out
    else:
        assert len(rows) == 4 and all(r["ok"] and r["size"] == 4 for r in rows), out
        new = [r for r in rows if r["role"] == "newcomer"]
        assert len(new) == 1 and new[0]["rank"] == 3 and new[0]["taken"] == [3], out
        assert sorted(r["rank"] for r in rows if r["role"] == "survivor") == [0, 1, 2], out
        assert all(r["failure"]["lost"] == [3] for r in rows if r["role"] == "survivor"), out
        assert all(r["checks"]["model equal"] for r in rows), out   # heal.broadcast reached the newcomer
    # a refused spawn: the survivors end well, the launcher still reports the launch it could not
    # make (Open MPI 5's prterun exits 183 after its "unable to launch" message)
    assert proc.returncode == 0 or (missing and "unable to launch" in out), out


@pytest.mark.parametrize("algo", ["pushsum", "agp"])
def test_a_replaced_rank_heals_with_exact_mass(algo):
    """#45's heal for the PushSum family (mpigossip.resilience.heal.split): after a kill and the
    survivors' recovery, a donor hands the newcomer half its (x, w): the halves add up to what
    it held exactly, Σx and Σw over the grown job are the survivors', z - base stays one
    constant on every rank (the newcomer's too) through 30 more steps at 4 ranks, and z converges
    (tests/scripts/grow.py --heal)."""
    proc, rows, out = _grow("--heal", algo)
    assert len(rows) == 4 and all(r["ok"] and r["size"] == 4 for r in rows), out
    assert sum("halves exact" in r["checks"] for r in rows) == 1, out    # one donor, checked
    assert [r["rank"] for r in rows if r["role"] == "newcomer"] == [3], out
    assert all(r["failure"]["lost"] == [3] for r in rows if r["role"] == "survivor"), out
    assert proc.returncode == 0, out


def _grow(*args):
    proc, _ = run(["--with-ft", "ulfm", "-n", "4", sys.executable, GROW, "--mb", "4", *args], timeout=120)
    rows = [json.loads(line.split("grow: ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("grow: ")]
    return proc, rows, proc.stdout + proc.stderr


@pytest.mark.parametrize("algorithm", ["sgp", pytest.param("osgp", marks=pytest.mark.train),
                                       pytest.param("agp", marks=pytest.mark.train),
                                       pytest.param("allreduce", marks=pytest.mark.train),
                                       pytest.param("diloco", marks=pytest.mark.train), "refused", "at-the-end"])
def test_training_grows_back_after_a_killed_rank(tmp_path, algorithm):
    """`train --on-failure replace` (#45): rank 3 of 4 is killed at step 100 of 300 (20 ms of
    compute a step); the survivors spawn a newcomer that takes rank 3 (its shard, its metrics
    file), train on while it starts (Python, torch, its data and model: seconds), and grow back
    when it is ready, at one step, where it heals from a donor; the run ends at 4 ranks:
    summary.json records the failure and the replacement with its times and the steps trained
    beside the newcomer's start;
    the newcomer's model ends as close to the consensus as the others' and the consensus model at
    90% on the digits (every rank's own too; AGP's at 85%); the PushSum family's mass is exact
    across the heal (Σw + weight lost = 4: the newcomer's half came out of a donor); AllReduce's
    models are equal. OSGP and AGP let
    ranks drift: the survivors grow back together, once the last of them has reached the step.
    DiLoCo over SGP: the base's numerators split as SGP's, the outer state handed over.
    "refused": SGP whose replacement cannot start (MPIGOSSIP_REPLACE_WITH names no program): one
    warning, the survivors train on at 3 ranks. "at-the-end": SGP with rank 3 killed at step 290
    and no compute time, so the survivors reach the last step before the newcomer is ready: they
    wait for it there, and the last step, its checkpoint and the evaluation are at 4 ranks."""
    refused, at_end = algorithm == "refused", algorithm == "at-the-end"
    algo = "sgp" if refused or at_end else algorithm
    train = [sys.executable, "-m", "mpigossip", "train", "--algorithm", algo, "--steps", "300",
             *(["--base", "sgp"] if algo == "diloco" else []), *([] if at_end else ["--compute-ms", "20"]),
             "--on-failure", "replace", "--kill", "3:290" if at_end else "3:100", "--quiet", "--timeout", "60",
             "--out", str(tmp_path)]
    launch, env = ["--with-ft", "ulfm", "-n", "4"], None
    if refused:
        launch += ["-x", "MPIGOSSIP_REPLACE_WITH"]
        env = dict(os.environ, MPIGOSSIP_REPLACE_WITH="/nonexistent/python")
    proc, _ = run([*launch, *train], timeout=240, env=env)
    out = proc.stdout + proc.stderr
    s = json.load(open(tmp_path / "summary.json"))
    [f] = s["failures"]
    assert f["ranks"] == [3] and f["size"] == 3 and f["killed_at_step"] == (290 if at_end else 100), f
    replaced = f["replaced"]
    if refused:   # (prterun still reports the launch it could not make: exit 183)
        assert "no replacement for rank(s) [3]" in out and out.count("RuntimeWarning") == 1, out
        assert replaced["refused"] and replaced["ranks"] == [] and s["world_size"] == 3, s
        assert s["final_accuracy"] >= 0.9 and abs(s["weight_sum"][0] - weight_accounted(s)) < 1e-9, s
        return
    assert proc.returncode == 0, out
    assert f"{algo}: rank 3 replaced: back at 4 ranks" in proc.stdout, out
    assert s["initial_world_size"] == 4 and s["world_size"] == 4 and s["steps"] == 300, s
    assert replaced["ranks"] == [3] and not replaced["refused"] and replaced["spawn_s"] > 0, replaced
    assert replaced["back_at_s"] > f["recovered_at_s"] and replaced["heal_s"] >= 0, (f, replaced)
    # the survivors trained while the newcomer started, and grew back at one step (before the end, or at it)
    assert replaced["steps_beside"] > 0 and replaced["beside_s"] > 0 and replaced["pause_s"] >= 0, replaced
    assert (replaced["at_step"] == 299) if at_end else (101 < replaced["at_step"] < 299), replaced
    assert replaced["as_donor"] is True, replaced   # the newcomer's parameters its donor's, bit for bit, at the heal
    # AGP heals beside training: the donor's sends went while it stepped, the record gathered afterwards
    assert bool(replaced.get("beside_heal")) == (algo == "agp") and "pending" not in replaced, replaced
    if algo == "agp":
        assert replaced["heal_parts"]["stream_s"] >= 0 and replaced["ready_s"] > 0 and "incomplete" not in replaced
        assert replaced["idle_s"] > 0 and replaced["total_s"] > replaced["sync_s"], replaced
    # every rank's own model too. AGP's ranks never wait, so its spread follows the timing: 6 runs here beside a
    # busy core gave rank accuracies down to 0.87 (0.82 once under CI's load) and the newcomer's distance from
    # the consensus 0.4-2.1x the others' largest (the synchronous methods: within 2x)
    agp = algo == "agp"
    seen = {k: s.get(k) for k in ("final_accuracy", "rank_accuracy_min", "rank_accuracy_mean", "rank_distances",
                                  "weight_sum", "weight_min", "consensus_distance")}
    seen["failure"] = {k: f.get(k) for k in ("met_at_step", "weight_lost", "scaled_by")}
    seen["replaced"] = {k: replaced.get(k) for k in ("donors", "scaled_by", "weight_before")}
    assert s["final_accuracy"] >= 0.9 and s["rank_accuracy_min"] >= (0.8 if agp else 0.9), seen
    d = s["rank_distances"]
    assert len(d) == 4 and d[3] <= (3 if agp else 2) * max(d[:3]) + 1e-12, d   # the newcomer mixed in like the others
    if algo in ("sgp", "osgp", "agp", "diloco"):   # exact mass across the heal, AGP's floor held
        # (Σw: 4, less the loss, times the heal's power of two that brings it back near 4)
        assert abs(s["weight_sum"][0] - weight_accounted(s)) < 1e-9 and 2 <= s["weight_sum"][0] <= 8, s
        assert s["weight_min"] >= 2.0 ** -11, s
    if algo == "allreduce":
        assert s["consensus_distance"] == 0, s
    # the dead rank's steps, then the newcomer's from the step the survivors grew back at to the end
    steps = [json.loads(line)["step"] for line in open(tmp_path / "metrics-rank3.jsonl")]
    newcomer = steps[steps.index(replaced["at_step"], 1):]
    assert newcomer == list(range(replaced["at_step"], 300)), newcomer[:5]
    assert steps[len(steps) - len(newcomer) - 1] == (289 if at_end else 99), steps[:5]


@pytest.mark.train
def test_training_grows_back_twice():
    """Two failures, each replaced (#45): OSGP at 4 ranks, rank 3 killed at step 100 and rank 0 at
    step 400 of 600 (30 ms of compute a step: the first newcomer has joined by then): two newcomers in turn (the second takes rank 0: it writes the summary and
    prints the run's line; the replacement's line comes from the first survivor), the run ends at 4 ranks, the mass exact across both
    heals (4, less each loss, times each heal's power of two), every rank's model >= 90%. Seen
    failing: the second loss reckoned against 4 instead of the Σw the first left (weight_lost
    1.75 for 0.75), and without the heal's rescale OSGP's weights fell to Σw 0.78 over 4 ranks,
    its steps on z x5 too large: the run diverged to chance (10%)."""
    with tempfile.TemporaryDirectory() as out:
        proc, _ = run(["--with-ft", "ulfm", "-n", "4", sys.executable, "-m", "mpigossip", "train", "--algorithm",
                       "osgp", "--steps", "600", "--on-failure", "replace", "--kill", "3:100", "--kill", "0:400",
                       "--compute-ms", "30", "--quiet", "--timeout", "60", "--out", out], timeout=300)
        text = proc.stdout + proc.stderr
        assert proc.returncode == 0, text
        s = json.load(open(os.path.join(out, "summary.json")))
    assert [f["ranks"] for f in s["failures"]] == [[3], [0]], s["failures"]
    assert [f["killed_at_step"] for f in s["failures"]] == [100, 400], s["failures"]
    assert [f["replaced"]["ranks"] for f in s["failures"]] == [[3], [0]], s["failures"]
    assert all(f["replaced"]["spawn_s"] > 0 for f in s["failures"]), s["failures"]
    assert "osgp: rank 3 replaced: back at 4 ranks" in text and "osgp: rank 0 replaced: back at 4 ranks" in text, text
    assert "osgp: 4 ranks, 600 steps" in text and "Traceback" not in text, text
    assert s["world_size"] == 4 and s["steps"] == 600, s
    assert abs(s["weight_sum"][0] - weight_accounted(s)) < 1e-9 and 2 <= s["weight_sum"][0] <= 8, s
    assert s["final_accuracy"] >= 0.9 and s["rank_accuracy_min"] >= 0.9, s


@pytest.mark.parametrize("algorithm", ["sgp", pytest.param("agp", marks=pytest.mark.train)])
def test_a_second_failure_before_the_growth_is_replaced_with_the_first(tmp_path, algorithm):
    """A rank dies after the survivors followed a failure and before they grew back (#45): rank 3
    killed at step 100 of 300, rank 2 as the survivors begin to grow back
    (MPIGOSSIP_KILL_BEFORE_GROW). The survivors learn it from their agreement on the step, train
    on until the algorithm has followed the second death, then replace both ranks in one growth:
    two failures recorded, the second's replacement naming ranks 2 and 3, 4 ranks at the end,
    the mass accounted across both losses and the heal, every rank at 90%. Seen failing: the
    agreement's collective met the death and the job aborted (AGP's ranks, which drift, met it so
    in the soak); and the second death was numbered in the shrunk communicator (rank 2 of 3)."""
    env = dict(os.environ, MPIGOSSIP_KILL_BEFORE_GROW="2")
    proc, _ = run(["--with-ft", "ulfm", "-n", "4", "-x", "MPIGOSSIP_KILL_BEFORE_GROW", sys.executable, "-m",
                   "mpigossip", "train", "--algorithm", algorithm, "--steps", "300", "--on-failure", "replace",
                   "--kill", "3:100", "--quiet", "--timeout", "60", "--out", str(tmp_path)], timeout=240, env=env)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Traceback" not in text, text
    s = json.load(open(tmp_path / "summary.json"))
    assert [f["ranks"] for f in s["failures"]] == [[3], [2]], s["failures"]
    first, second = s["failures"]
    assert "replaced" not in first and second["replaced"]["ranks"] == [2, 3], s["failures"]
    assert second["replaced"]["as_donor"] is True and not second["replaced"]["refused"], second
    assert f"{algorithm}: ranks 2, 3 replaced: back at 4 ranks" in text, text
    assert s["world_size"] == 4 and s["steps"] == 300, s
    assert abs(s["weight_sum"][0] - weight_accounted(s)) < 1e-9 and 2 <= s["weight_sum"][0] <= 8, s
    assert s["final_accuracy"] >= 0.9 and s["rank_accuracy_min"] >= (0.8 if algorithm == "agp" else 0.9), s


@pytest.mark.train
def test_the_donor_killed_while_it_heals_beside_training_is_replaced_too(tmp_path):
    """AGP heals beside training (#45): the donor starts its sends and goes back to training. Here
    it dies right then (MPIGOSSIP_KILL_AFTER_HEAL=donor: rank 3 killed at step 100 of 300, its
    newcomer healed from the donor, which is killed as it returns). Whether its state reached the
    newcomer or not (the newcomer then ends with one note), the survivors follow the death and
    grow back again: two failures, both replaced, 4 ranks at the end, no traceback, the mass
    accounted across the losses and both heals (the half in flight, if lost, counted in the
    second failure's weight_lost), every rank at 80%."""
    env = dict(os.environ, MPIGOSSIP_KILL_AFTER_HEAL="donor")
    proc, _ = run(["--with-ft", "ulfm", "-n", "4", "-x", "MPIGOSSIP_KILL_AFTER_HEAL", sys.executable, "-m",
                   "mpigossip", "train", "--algorithm", "agp", "--steps", "300", "--compute-ms", "20",
                   "--on-failure", "replace", "--kill", "3:100", "--quiet", "--timeout", "60", "--out", str(tmp_path)],
                  timeout=240, env=env)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Traceback" not in text, text
    s = json.load(open(tmp_path / "summary.json"))
    first, *later = s["failures"]
    donor = int(first["replaced"]["donors"]["3"])
    dead = sorted({r for f in later for r in f["ranks"]})   # the donor (and its newcomer, had it lost its state)
    assert first["ranks"] == [3] and donor in dead and set(dead) <= {donor, 3}, s["failures"]
    assert first["replaced"]["ranks"] == [3] and first["replaced"]["beside_heal"], first
    assert "pending" not in first["replaced"] and sorted(later[-1]["replaced"]["ranks"]) == dead, s["failures"]
    assert s["world_size"] == 4 and s["steps"] == 300, s
    assert abs(s["weight_sum"][0] - weight_accounted(s)) < 1e-9, s
    assert s["final_accuracy"] >= 0.9 and s["rank_accuracy_min"] >= 0.8, s


@pytest.mark.parametrize("algorithm", ["sgp", pytest.param("agp", marks=pytest.mark.train)])
def test_a_failure_while_the_newcomer_starts_is_replaced_with_the_first(tmp_path, algorithm):
    """A second failure while the survivors train on beside a newcomer's start (#45): rank 1
    dies at its first step after the spawn of rank 3's newcomer (MPIGOSSIP_KILL_WHILE_JOINING).
    The survivors give that newcomer up (it ends with one note, exit 0), follow the death, and
    grow back once for both: two failures recorded, the first's newcomer "abandoned", the
    second's replacement naming ranks 1 and 3; 4 ranks at the end, the mass accounted across
    both losses and the heal, every rank at 90%, no traceback, no hang."""
    env = dict(os.environ, MPIGOSSIP_KILL_WHILE_JOINING="1")
    proc, seconds = run(["--with-ft", "ulfm", "-n", "4", "-x", "MPIGOSSIP_KILL_WHILE_JOINING", sys.executable, "-m",
                         "mpigossip", "train", "--algorithm", algorithm, "--steps", "400", "--on-failure", "replace",
                         "--kill", "3:100", "--compute-ms", "20", "--quiet", "--timeout", "60",
                         "--out", str(tmp_path)], timeout=240, env=env)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Traceback" not in text and "mpigossip: error" not in text, text
    assert text.count("python -m mpigossip: note (a newcomer): train (--on-failure replace): the survivors gave "
                      "this replacement up") == 1, text
    s = json.load(open(tmp_path / "summary.json"))
    assert [f["ranks"] for f in s["failures"]] == [[3], [1]], s["failures"]
    first, second = s["failures"]
    assert "replaced" not in first and first["abandoned"]["ranks"] == [3], first
    assert first["abandoned"]["steps_beside"] >= 0 and "failed while they started" in first["abandoned"]["why"], first
    assert second["replaced"]["ranks"] == [1, 3] and second["replaced"]["as_donor"] is True, second
    assert f"{algorithm}: ranks 1, 3 replaced: back at 4 ranks" in text, text
    assert s["world_size"] == 4 and s["steps"] == 400, s
    assert abs(s["weight_sum"][0] - weight_accounted(s)) < 1e-9 and 2 <= s["weight_sum"][0] <= 8, s
    assert s["final_accuracy"] >= 0.9 and s["rank_accuracy_min"] >= (0.8 if algorithm == "agp" else 0.9), s
    assert seconds < 120, seconds


def test_a_failure_during_the_heal_ends_the_run_with_a_named_error(tmp_path):
    """A second failure while the run grows back (#45 item 3): rank 1 dies inside the heal of
    rank 3's newcomer (MPIGOSSIP_KILL_IN_HEAL). The newcomer holds no state yet and the donors'
    was handed out in part: every live rank, the newcomer too, ends with the one named error
    (which replacement, resume from the last checkpoint), no traceback, no hang; the checkpoint
    of step 100, before the failure, is there to resume from."""
    env = dict(os.environ, MPIGOSSIP_KILL_IN_HEAL="1")
    proc, seconds = run(["--with-ft", "ulfm", "-n", "4", "-x", "MPIGOSSIP_KILL_IN_HEAL", sys.executable, "-m",
                         "mpigossip", "train", "--algorithm", "sgp", "--steps", "300", "--on-failure", "replace",
                         "--kill", "3:101", "--compute-ms", "20", "--checkpoint-every", "100", "--quiet",
                         "--timeout", "60", "--out", str(tmp_path)], timeout=240, env=env)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Traceback" not in text, text
    named = re.findall(r"python -m mpigossip: error \((rank \d of the launch|a newcomer)\): train \(--on-failure "
                       r"replace\): a rank failed while rank\(s\) \[3\] were replaced", text)
    assert sorted(named) == ["a newcomer", "rank 0 of the launch", "rank 2 of the launch"], text
    assert f"resume it from its last checkpoint (--resume {tmp_path})" in text, text
    # the survivors trained on while the newcomer started: the last checkpoint is the last before the heal
    trained = [json.loads(line)["step"] for line in open(tmp_path / "metrics-rank0.jsonl")]
    assert json.load(open(tmp_path / "checkpoints" / "latest.json"))["step"] == (trained[-1] + 1) // 100 * 100
    assert seconds < 120, seconds   # (the deadline is 60 s: the error came from the failure, not a timeout)
