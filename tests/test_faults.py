"""A lost rank ends the job with a message naming rank, operation and peer: never a hang."""

import os
import re
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
BIN = os.path.dirname(sys.executable)
MPIEXEC = os.path.join(BIN, "mpigossip-mpiexec")


def run(args, timeout=90):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    t0 = time.monotonic()
    proc = subprocess.run([MPIEXEC] + args, capture_output=True, text=True, timeout=timeout, env=env)
    return proc, time.monotonic() - t0


@pytest.mark.parametrize("how, extra", [
    ("stop", []),                      # a hung rank: the launcher sees nothing wrong
    ("kill", ["--enable-recovery"]),   # a dead rank, with the launcher told to keep the job
])
def test_lost_peer_ends_job_with_a_named_timeout(how, extra):
    proc, seconds = run(extra + ["-n", "4", sys.executable, os.path.join(HERE, "scripts", "lost_peer.py"), how])
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "finished without noticing" not in out
    assert "mpigossip: rank 2/4: PushSum.step (step 5): timed out after 3 s waiting for rank 1" in out, out
    assert seconds < 60


@pytest.mark.parametrize("where, message", [
    ("construct", r"mpigossip: rank [023]/4: PushSum \(construction\): timed out after 3 s "
                  r"waiting for all ranks \(Idup\)"),
    ("average", r"mpigossip: rank [023]/4: AllreduceAverager\.average: timed out after 3 s "
                r"waiting for all ranks \(Ibarrier\)"),
])
def test_hung_peer_before_a_collective_ends_job_with_a_named_timeout(where, message):
    """Collective construction and the blocking average are guarded too: a rank that never
    arrives makes the others abort, not hang in a blocking MPI call."""
    proc, seconds = run(["-n", "4", sys.executable, os.path.join(HERE, "scripts", "lost_peer.py"), "stop", where])
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
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
    assert {r["local_rank"] for r in info["ranks"]} == {0, 1, 2, 3}
    proc, _ = run(["-n", "2", sys.executable, "-m", "mpigossip", "info"], timeout=120)
    assert proc.returncode == 0 and "CUDA-aware MPI: no" in proc.stdout and proc.stdout.count("mpigossip ") == 1
