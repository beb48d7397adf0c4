"""A small discrete-event engine for the time model: processes as generators, and shared
resources (links, cores) divided max-min fairly among the transfers that use them.

A process is a generator that yields :class:`Event` objects and is resumed, with the event's
value, when that event fires::

    def rank(engine, fabric):
        yield engine.timeout(0.2)                                  # a sleep: no resource
        yield fabric.transfer(1e6, ["up0", "down1"], latency=1e-4)  # 1 MB over two links

    engine = Engine()
    fabric = Fabric(engine, {"up0": 125e6, "down1": 125e6})
    engine.process(rank(engine, fabric))
    engine.run()

A :meth:`Fabric.transfer` is work (bytes, or CPU-seconds) over a set of resources, each with
a capacity per second; every transfer in progress gets its max-min fair share of each
resource it crosses (and at most its own ``cap``), recomputed whenever one starts or ends:
two flows through one link each get half of it, a flow alone gets all of it. The sharing is
recomputed only among the resources a change can reach: resources join a group once a flow
crosses two of them (a message's uplink and downlink; a core pool alone stays its own), and
max-min fairness in one group does not depend on another's flows, so a CPU flow starting
on one node's cores does not reshare every link of the cluster.
"""

import heapq
import math

import numpy as np

__all__ = ["Engine", "Event", "Fabric"]


class Event:
    """Something that happens once, at some simulated time, with a value."""

    __slots__ = ("engine", "done", "value", "_callbacks")

    def __init__(self, engine):
        self.engine, self.done, self.value, self._callbacks = engine, False, None, []

    def succeed(self, value=None):
        """Fire now: every process waiting on it resumes (at the current time)."""
        if self.done:
            raise RuntimeError("an event fires once")
        self.done, self.value = True, value
        callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            self.engine.call_at(self.engine.now, fn, value)

    def then(self, fn):
        """Call ``fn(value)`` once the event has fired (at once, queued, if it has)."""
        if self.done:
            self.engine.call_at(self.engine.now, fn, self.value)
        else:
            self._callbacks.append(fn)


class Engine:
    """Simulated time and the queue of what happens next (ties in the order scheduled)."""

    def __init__(self):
        self.now = 0.0
        self._queue = []
        self._seq = 0

    def call_at(self, t, fn, *args):
        """Call ``fn(*args)`` at time ``t`` (not before now)."""
        if t < self.now - 1e-12:
            raise ValueError(f"cannot schedule at {t} before now ({self.now})")
        heapq.heappush(self._queue, (max(t, self.now), self._seq, fn, args))
        self._seq += 1

    def event(self):
        """A new event, fired by whoever holds it."""
        return Event(self)

    def timeout(self, seconds):
        """An event that fires ``seconds`` from now."""
        if seconds < 0 or math.isnan(seconds):
            raise ValueError(f"a timeout must be >= 0 seconds, got {seconds}")
        ev = Event(self)
        self.call_at(self.now + seconds, ev.succeed)
        return ev

    def all_of(self, events):
        """An event that fires once every one of ``events`` has (at once for none)."""
        events = list(events)
        ev = Event(self)
        left = [len(events)]
        if not events:
            self.call_at(self.now, ev.succeed)

        def one(_):
            left[0] -= 1
            if left[0] == 0:
                ev.succeed()
        for e in events:
            e.then(one)
        return ev

    def process(self, generator):
        """Start a process now; returns an event that fires (with its return value) when it ends."""
        finished = Event(self)

        def resume(value):
            try:
                waited = generator.send(value)
            except StopIteration as stop:
                finished.succeed(stop.value)
                return
            if not isinstance(waited, Event):
                raise TypeError(f"a process must yield Events, got {waited!r}")
            waited.then(resume)
        self.call_at(self.now, resume, None)
        return finished

    def run(self, until=math.inf):
        """Run until nothing is left to happen or the time ``until``; returns the time reached."""
        while self._queue and self._queue[0][0] <= until:
            t, _, fn, args = heapq.heappop(self._queue)
            self.now = t
            fn(*args)
        if self._queue:
            self.now = until
        return self.now


class Fabric:
    """Resources with a capacity per second, shared max-min fairly by the flows crossing them.

    Args:
        engine: the :class:`Engine`.
        capacity: ``{name: units per second}`` (bytes/s for a link, cores for a CPU pool).
    """

    def __init__(self, engine, capacity):
        for name, c in capacity.items():
            if not c > 0:
                raise ValueError(f"resource {name!r}: capacity must be > 0, got {c}")
        self.engine, self.capacity = engine, dict(capacity)
        self._names = list(capacity)
        self._slot = {name: i for i, name in enumerate(self._names)}
        self._cap = np.array([float(capacity[n]) for n in self._names])
        self._carried = np.zeros(len(self._names))
        # The flows under way, as parallel arrays (one entry per flow) and their incidence on
        # the resources (one entry per flow and resource it crosses): the sharing is
        # recomputed at every start and end of a flow, so it is done in numpy throughout.
        self._events = []
        self._left = np.zeros(0)
        self._rate = np.zeros(0)
        self._solo = np.zeros(0)   # a flow's pace alone: its cap, or its first resource's capacity
        self._fi = np.zeros(0, dtype=np.intp)   # per incidence: the flow's position
        self._ri = np.zeros(0, dtype=np.intp)   # the resource's
        self._w = np.zeros(0)                   # the units of the resource per unit of the flow
        self._g = np.zeros(0, dtype=np.intp)    # per flow: its group (a resource's index)
        self._parent = list(range(len(self._names)))   # the groups, as a union-find over resources
        self._dirty = set()                     # groups whose flows changed since the last sharing
        self._last = 0.0
        self._version = 0
        self._pending = False

    @property
    def carried(self):
        """``{name: units moved through it}`` so far."""
        return dict(zip(self._names, self._carried.tolist()))

    def transfer(self, amount, resources, *, cap=math.inf, latency=0.0):
        """An event that fires when ``amount`` units have crossed every one of ``resources``
        (after ``latency`` seconds first), at most ``cap`` units per second. ``resources`` is
        a list of names, or ``{name: weight}``: a unit of the flow takes ``weight`` units of
        that resource (CPU-seconds per byte of a link's traffic, say); the first one sets the
        flow's pace in the sharing (:meth:`_rates`)."""
        weights = dict(resources) if isinstance(resources, dict) else {name: 1.0 for name in resources}
        for name, w in weights.items():
            if name not in self.capacity:
                raise KeyError(f"no resource {name!r}")
            if not w > 0:
                raise ValueError(f"resource {name!r}: weight must be > 0, got {w}")
        done = self.engine.event()
        if amount <= 0:
            self.engine.call_at(self.engine.now + latency, done.succeed)
            return done
        index = np.array([self._slot[n] for n in weights], dtype=np.intp)
        w = np.array(list(weights.values()), dtype=float)

        def start():
            self._advance()
            group = self._join(index)
            n = len(self._events)
            self._events.append(done)
            self._g = np.append(self._g, group)
            self._dirty.add(group)
            self._left = np.append(self._left, float(amount))
            self._rate = np.append(self._rate, 0.0)
            self._solo = np.append(self._solo, min(cap, self._cap[index[0]] / w[0]))
            self._fi = np.append(self._fi, np.full(len(index), n, dtype=np.intp))
            self._ri = np.append(self._ri, index)
            self._w = np.append(self._w, w)
            self._changed()
        self.engine.call_at(self.engine.now + latency, start)
        return done

    def _find(self, r):
        parent = self._parent
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    def _join(self, index):
        """Put the resources ``index`` in one group (and the flows of the groups it merges);
        returns the group."""
        roots = {self._find(int(r)) for r in index}
        group = min(roots)
        for r in roots - {group}:
            self._parent[r] = group
            merged = self._g == r
            if merged.any():
                self._g[merged] = group
            if r in self._dirty:
                self._dirty.discard(r)
                self._dirty.add(group)
        return group

    def _advance(self):
        """Move every flow on by its rate since the last change."""
        dt = self.engine.now - self._last
        if dt > 0 and self._events:
            self._left -= self._rate * dt
            self._carried += np.bincount(self._ri, self._w * self._rate[self._fi] * dt, minlength=len(self._cap))
        self._last = self.engine.now

    def _rates(self):
        """Max-min fair rates by progressive filling, each flow's rate counted in units of its
        first resource's capacity (capped at its own cap): every unfixed flow rises by the same
        fraction of that until a resource is full or the flow reaches its cap; the flows
        through a full resource are fixed. Flows over the same first resource (the transfers
        out of one link) share max-min fairly as usual; flows of different units, bytes over a
        link and CPU-seconds on a core pool, share a pool by the same fraction of their pace."""
        dirty, self._dirty = self._dirty, set()
        if not len(self._events) or not dirty:
            return
        changed = np.zeros(len(self._cap), dtype=bool)
        changed[list(dirty)] = True
        mine = changed[self._g]   # the flows whose sharing may have changed
        if mine.all():
            fi, ri, w, solo = self._fi, self._ri, self._w, self._solo
        else:
            inc = mine[self._fi]
            fi = (np.cumsum(mine) - 1)[self._fi[inc]]
            ri, w, solo = self._ri[inc], self._w[inc], self._solo[mine]
        n = len(solo)
        if not n:
            return
        # the resources these flows cross, numbered 0..k-1: every pass below is over them only
        res, ri = np.unique(ri, return_inverse=True)
        nres = len(res)
        ws = w * solo[fi]   # a flow's load on a resource per unit of the level
        rate = np.zeros(n)
        left = self._cap[res]
        unfixed = np.ones(n, dtype=bool)
        while True:
            load = np.bincount(ri, ws * unfixed[fi], minlength=nres)
            used = load > 0
            ratio = np.divide(left, load, out=np.full(nres, np.inf), where=used)
            level = min(float(ratio.min()), 1.0)
            if level >= 1.0:
                rate[unfixed] = solo[unfixed]
                break
            full = used & (ratio <= level * (1 + 1e-12))
            fixed = unfixed & (np.bincount(fi, full[ri], minlength=n) > 0)
            rate[fixed] = level * solo[fixed]
            left = np.maximum(0.0, left - np.bincount(ri, w * rate[fi] * fixed[fi], minlength=nres))
            unfixed &= ~fixed
            if not unfixed.any():
                break
        self._rate[mine] = rate

    def _changed(self):
        """The flows changed: share anew once this instant's changes are in (flows starting
        together, as a ring's ranks do, are shared once, not once per flow)."""
        self._version += 1   # a completion scheduled for the old flows is void
        if not self._pending:
            self._pending = True
            self.engine.call_at(self.engine.now, self._reschedule)

    def _reschedule(self):
        self._pending = False
        self._rates()
        moving = self._rate > 0
        if moving.any():
            soonest = float((self._left[moving] / self._rate[moving]).min())
            self.engine.call_at(self.engine.now + max(soonest, 1e-12 * max(1.0, self.engine.now)), self._complete,
                                self._version)

    def _complete(self, version):
        if version != self._version:
            return  # the flows changed since this was scheduled
        self._advance()
        # done: less than a femtosecond-per-second of the clock left to go (time adds up in floats)
        eps = 1e-12 * max(1.0, self.engine.now)
        finished = (self._left <= self._rate * eps) | (self._left <= 1e-12)
        flags = finished.tolist()
        done = [e for e, f in zip(self._events, flags) if f]
        if done:
            keep = ~finished
            self._events = [e for e, f in zip(self._events, flags) if not f]
            self._dirty.update(self._g[finished].tolist())
            self._left, self._rate, self._solo = self._left[keep], self._rate[keep], self._solo[keep]
            self._g = self._g[keep]
            inc = keep[self._fi]
            renumber = np.cumsum(keep) - 1
            self._fi = renumber[self._fi[inc]]
            self._ri, self._w = self._ri[inc], self._w[inc]
        self._changed()
        for e in done:
            e.succeed()
