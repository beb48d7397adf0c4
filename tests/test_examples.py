"""Every example runs under mpiexec -n 4 and reaches its accuracy (each asserts it)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpigossip-mpiexec")


@pytest.mark.parametrize("script, args", [
    ("allreduce_sgd.py", []), ("sgp.py", []), ("sgp.py", ["--overlap"]),
    ("gossip.py", ["pull"]), ("gossip.py", ["push"]), ("easgd.py", []), ("easgd.py", ["--async"]),
])
def test_example_runs_under_four_ranks(script, args):
    proc = subprocess.run([MPIEXEC, "-n", "4", sys.executable, os.path.join(ROOT, "examples", script)] + args,
                          capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "relative error" in proc.stdout
