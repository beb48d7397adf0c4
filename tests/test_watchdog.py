"""The watchdog (mpigossip.core.watchdog): a blocking call past its deadline ends the process
with the operation named and every thread's stack; one that finishes leaves nothing behind."""

import subprocess
import sys
import textwrap
import time

from mpigossip.core import watchdog

SCRIPT = textwrap.dedent("""
    import time
    from mpigossip.core import watchdog

    class Comm:   # stands in for an MPI communicator: the watchdog names the rank, then aborts
        def Get_rank(self):
            return 2
        def Get_size(self):
            return 4
        def Abort(self, code):
            print("aborted", code, flush=True)

    def blocking_collective():
        time.sleep(30)

    with watchdog.watching(Comm(), 0.5, "AllreduceAverager.average"):
        blocking_collective()
    print("not ended", flush=True)
""")


def test_a_call_past_its_deadline_ends_the_process_naming_it():
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    seconds = time.monotonic() - t0
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    assert "not ended" not in proc.stdout
    assert ("mpigossip: rank 2/4: AllreduceAverager.average: timed out after 0.5 s waiting for all ranks "
            "(a blocking collective; the watchdog)") in proc.stderr
    assert "blocking_collective" in proc.stderr   # the stuck thread's stack
    assert "aborted 1" in proc.stdout             # MPI_Abort (the package runs MPI_THREAD_MULTIPLE)
    assert seconds < 20


def test_a_call_within_its_deadline_leaves_no_watch():
    class Comm:
        def Get_rank(self):
            return 0

        def Get_size(self):
            return 1

    for _ in range(1000):
        with watchdog.watching(Comm(), 60.0, "op"):
            pass
    assert not watchdog._watches
    assert len(watchdog._thread) == 1 and watchdog._thread[0].daemon
