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
two flows through one link each get half of it, a flow alone gets all of it.
"""

import heapq
import math

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


class _Flow:
    __slots__ = ("left", "resources", "weights", "cap", "rate", "event")

    def __init__(self, amount, resources, weights, cap, event):
        self.left, self.resources, self.weights = amount, resources, weights
        self.cap, self.rate, self.event = cap, 0.0, event


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
        self._flows = []
        self._last = 0.0
        self._version = 0
        self.carried = {name: 0.0 for name in capacity}  # units moved through each resource

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

        def start():
            self._advance()
            self._flows.append(_Flow(float(amount), tuple(weights), tuple(weights.values()), cap, done))
            self._reschedule()
        self.engine.call_at(self.engine.now + latency, start)
        return done

    def _advance(self):
        """Move every flow on by its rate since the last change."""
        dt = self.engine.now - self._last
        if dt > 0:
            for f in self._flows:
                moved = f.rate * dt
                f.left -= moved
                for name, w in zip(f.resources, f.weights):
                    self.carried[name] += moved * w
        self._last = self.engine.now

    def _rates(self):
        """Max-min fair rates by progressive filling, each flow's rate counted in units of its
        first resource's capacity (capped at its own cap): every unfixed flow rises by the same
        fraction of that until a resource is full or the flow reaches its cap; the flows
        through a full resource are fixed. Flows over the same first resource (the transfers
        out of one link) share max-min fairly as usual; flows of different units, bytes over a
        link and CPU-seconds on a core pool, share a pool by the same fraction of their pace."""
        left = dict(self.capacity)
        unfixed = list(self._flows)
        solo = {}
        for f in unfixed:
            f.rate = 0.0
            solo[id(f)] = min(f.cap, self.capacity[f.resources[0]] / f.weights[0])
        while unfixed:
            load = {}   # units of each resource per unit of the common level
            for f in unfixed:
                for name, w in zip(f.resources, f.weights):
                    load[name] = load.get(name, 0.0) + w * solo[id(f)]
            level = min([left[name] / n for name, n in load.items()] + [1.0])
            full = {name for name, n in load.items() if left[name] / n <= level * (1 + 1e-12)}
            fixed = [f for f in unfixed if level >= 1.0 or full.intersection(f.resources)]
            for f in fixed:
                f.rate = level * solo[id(f)]
                for name, w in zip(f.resources, f.weights):
                    left[name] = max(0.0, left[name] - f.rate * w)
            fixed = set(map(id, fixed))
            unfixed = [f for f in unfixed if id(f) not in fixed]

    def _reschedule(self):
        self._rates()
        self._version += 1
        version = self._version
        soonest = math.inf
        for f in self._flows:
            if f.rate > 0:
                soonest = min(soonest, f.left / f.rate)
        if soonest < math.inf:
            self.engine.call_at(self.engine.now + max(soonest, 1e-12 * max(1.0, self.engine.now)), self._complete,
                                version)

    def _complete(self, version):
        if version != self._version:
            return  # the flows changed since this was scheduled
        self._advance()
        # done: less than a femtosecond-per-second of the clock left to go (time adds up in floats)
        eps = 1e-12 * max(1.0, self.engine.now)
        finished = [f for f in self._flows if f.left <= f.rate * eps or f.left <= 1e-12]
        self._flows = [f for f in self._flows if f not in finished]
        self._reschedule()
        for f in finished:
            f.event.succeed()
