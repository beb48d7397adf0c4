"""What a P4 rank's step is made of (``bench_network.py --p4-parts``), for comparing the time
model's step with the package's part by part (#43, item 4).

Attached to a torch wrapper for its timed steps, a :class:`Probe` records, per step of the rank:

* ``cpu_ms``: the process's CPU time (``time.process_time``: every thread of it, Open MPI's
  progress thread included); ``machine_cpu_ms``: the whole machine's busy CPU time over the
  rank's timed steps (``/proc/stat``: every rank of the emulated nodes, which share this
  machine's cores, and the kernel's network stack), per step of the rank: the model charges
  both (a rank's CPU and the network stack's per byte on both sides);
* gossip pull: the time waiting for the target's shared lock (``read_lock_ms``), the read
  itself (``read_ms``: the ``Rget`` pieces and their wait; ``reads``: how many steps read, the
  others drew the rank itself), the unlock, and the exclusive lock on its own window when
  publishing (``publish_lock_ms``);
* AGP: the messages sent and shares combined per step (``sent_per_step``,
  ``combined_per_step``; the model's ``models_moved_per_step``) and the steps ``held``.

The probe wraps the instance's window and methods, never the package's code; :meth:`detach`
puts them back before the algorithm drains and frees.
"""

import os
import time

from mpi4py import MPI


def _busy_s():
    """The machine's busy CPU seconds since boot (``/proc/stat``: all but idle and iowait), or
    None where there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / ticks


class _TimedWin:
    """An ``MPI.Win`` whose ``Lock``/``Unlock`` add their time to the probe's parts."""

    def __init__(self, win, probe, rank):
        self._win, self._probe, self._rank = win, probe, rank

    def Lock(self, target, lock_type=MPI.LOCK_EXCLUSIVE, assertion=0):
        t0 = time.perf_counter()
        self._win.Lock(target, lock_type, assertion)
        part = "publish_lock" if target == self._rank else "read_lock"
        self._probe.add(part, time.perf_counter() - t0)

    def Unlock(self, target):
        t0 = time.perf_counter()
        self._win.Unlock(target)
        self._probe.add("publish_unlock" if target == self._rank else "read_unlock", time.perf_counter() - t0)

    def __getattr__(self, name):
        return getattr(self._win, name)


class Probe:
    """The parts of a wrapper's steps on this rank (see the module's docstring)."""

    def __init__(self, algo):
        self.inner = [getattr(c, "inner", c) for c in getattr(algo, "comms", [])]
        self.parts = {}
        self._restore = []
        for c in self.inner:
            win = getattr(c, "win", None)
            if getattr(c, "mode", None) == "pull" and win is not None:
                c.win = _TimedWin(win, self, c.rank)
                wait = c._wait

                def timed_wait(requests, op, peer=None, wait=wait):
                    t0 = time.perf_counter()
                    wait(requests, op, peer=peer)
                    self.add("read", time.perf_counter() - t0)
                    self.reads += 1
                c._wait = timed_wait
                self._restore.append((c, win))

    reads = 0

    def add(self, part, seconds):
        self.parts[part] = self.parts.get(part, 0.0) + seconds

    def _counters(self):
        sent = sum(out.sent for c in self.inner for out in getattr(c, "_outs", {}).values())
        combined = sum(int(c.received.sum()) for c in self.inner if hasattr(c, "_outs"))
        held = sum(getattr(c, "held", 0) for c in self.inner if hasattr(c, "_outs"))
        return sent, combined, held

    def start(self):
        """The timed steps start now."""
        self.parts, self.reads = {}, 0
        self._cpu0, self._busy0, self._counts0 = time.process_time(), _busy_s(), self._counters()

    def result(self, steps):
        """Per step of this rank since :meth:`start`: CPU and the method's parts (ms), and AGP's
        counts."""
        out = {"cpu_ms": (time.process_time() - self._cpu0) / steps * 1e3}
        busy = _busy_s()
        if busy is not None and self._busy0 is not None:
            out["machine_cpu_ms"] = (busy - self._busy0) / steps * 1e3
        out.update({part + "_ms": s / steps * 1e3 for part, s in sorted(self.parts.items())})
        if "read" in self.parts:
            out["reads"] = self.reads
        if any(hasattr(c, "_outs") for c in self.inner):
            sent, combined, held = (b - a for a, b in zip(self._counts0, self._counters()))
            out.update(sent_per_step=sent / steps, combined_per_step=combined / steps, held=held)
        return out

    def detach(self):
        for c, win in self._restore:
            c.win = win
            del c._wait   # (the class's method again)
        self._restore = []
