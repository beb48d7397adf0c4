"""Processes end cleanly with messages in flight and without free().

Before the fix, an OSGP wrapper left at exit crashed every rank inside MPI_Finalize
(SIGSEGV): its requests outlived the buffers they sent from.
"""

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpigossip-mpiexec")


@pytest.mark.parametrize("n, mode", [(2, "exit"), (3, "gc"), (4, "gc"), (8, "exit")])
def test_exit_with_messages_in_flight_is_clean_on_every_rank(n, mode):
    proc = subprocess.run([MPIEXEC, "-n", str(n), sys.executable, os.path.join(HERE, "scripts", "exit_in_flight.py"),
                           mode], capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, MPIGOSSIP_TIMEOUT="60"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert out.count("objects in flight, exiting") == n, out[-3000:]
    assert "signal" not in out.lower(), out[-3000:]
