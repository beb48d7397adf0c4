"""Time to accuracy at scale: the accuracy simulator (:mod:`.sgd`) joined to the time model
(:mod:`.scaling`).

For each cluster (ranks ``p``, link rate, straggler) the time model gives each method's steps
per second per rank and the models its messages moved per step; that sets how the accuracy
simulator mixes for it (:func:`mixing_of`): SGP a PushSum round every step, OSGP:D with its
messages D rounds in flight, AGP a round every ``1 / moved`` steps (it sends only when its
link is free, so it mixes less where the link cannot keep up) with its messages a round in
flight. The accuracy simulator then gives the steps each mixing needs to reach the target
(AllReduce's best accuracy in the first half of its steps at that ``p`` less ``drop``), and their ratio to the steps per
second the time to the target.

What a rank holds is what is evaluated (``evaluate="ranks"``: the mean accuracy of the ranks'
own models; EASGD's center, which is its output), or the exact mean of the ranks' models
(``"mean"``: a final AllReduce, where every scheme looks alike on a convex problem).

What the join leaves out (the caveats every table states): the accuracy simulator steps all
ranks together, so an asynchronous method whose ranks run at different speeds is counted at
their mean pace; its problem is convex (softmax regression); AGP's messages, which carry
what accumulated while the last one was in flight, are counted as one PushSum share.
"""

import numpy as np

from .scaling import predict
from .sgd import run_sgd

__all__ = ["MIXING", "mixing_of", "label", "accuracy_steps", "steps_to", "steps_to_target", "assign_mixing", "join",
           "time_to_accuracy", "winners", "markdown"]

#: The accuracy simulator's scheme and message delay (rounds) of each time-model method.
MIXING = {"allreduce": ("allreduce", 0), "sgp": ("sgp", 0), "agp": ("sgp", 1), "gossip-pull": ("gossip-pull", 0),
          "easgd": ("easgd", 0)}
#: Methods that send only when their last message is done: they mix less often than every step
#: where their link cannot keep up.
SENDS_WHEN_FREE = ("agp",)


def mixing_of(method, moved=1.0, *, max_tau=64):
    """``(scheme, tau, delay)``: how the accuracy simulator mixes for ``method`` whose messages
    moved ``moved`` models per step in the time model (``osgp:D``: PushSum with its messages
    ``D`` rounds in flight)."""
    if method.startswith("osgp"):
        _, _, d = method.partition(":")
        return "sgp", 1, int(d or 1)
    if method not in MIXING:
        raise ValueError(f"no accuracy scheme for {method!r}: the methods joined are "
                         f"{sorted(MIXING) + ['osgp:D']}")
    scheme, delay = MIXING[method]
    tau = 1
    if method in SENDS_WHEN_FREE and moved > 0:
        tau = int(min(max_tau, max(1, round(1.0 / moved))))
    elif method in SENDS_WHEN_FREE:
        tau = max_tau
    return scheme, tau, delay


def label(scheme, tau=1, delay=0):
    """A mixing's name in the tables and the JSON: ``sgp``, ``sgp every 3``, ``sgp delay 1``."""
    return scheme + (f" every {tau}" if tau > 1 else "") + (f" delay {delay}" if delay else "")


def steps_to(curve, target, metric="accuracy"):
    """The first evaluated step count whose ``metric`` reaches ``target``, or None."""
    for steps, value in zip(curve["steps"], curve[metric]):
        if value >= target:
            return steps
    return None


def _metric(scheme, evaluate):
    if evaluate not in ("ranks", "mean"):
        raise ValueError(f"evaluate must be 'ranks' or 'mean', got {evaluate!r}")
    return "rank_accuracy" if evaluate == "ranks" and scheme != "easgd" else "accuracy"


def accuracy_steps(problem_for, settings, *, steps, lr, seeds=(0,), drop=0.01, evals=50, skew=0.0,
                   evaluate="ranks", progress=None):
    """Run the accuracy simulator for each ``(p, scheme, tau, delay)`` of ``settings`` (and
    AllReduce at each ``p``: it sets the target) and give :func:`steps_to_target` of its runs.

    Args:
        problem_for: ``problem_for(seed)`` -> a problem for :func:`~.sgd.run_sgd`.
        steps, lr, skew: SGD steps, step size and data skew of every run.
        drop: the target is AllReduce's best accuracy in its first half at that ``p`` and seed
            less this.
        evals: evaluations per run (the resolution of the step counts).
        evaluate: ``"ranks"`` or ``"mean"`` (the module's docstring).
    """
    settings = sorted(set(settings) | {(p, "allreduce", 1, 0) for p, *_ in settings})
    records = []
    for seed in seeds:
        problem = problem_for(seed)
        for p, scheme, tau, delay in settings:
            if progress:
                progress(f"accuracy: p = {p}, seed {seed}: {label(scheme, tau, delay)}")
            r = run_sgd(problem, scheme, p, steps=steps, lr=lr, seed=seed, tau=tau, delay=delay, skew=skew,
                        eval_every=max(1, steps // evals))
            records.append({**r, "seed": seed})
    return steps_to_target(records, drop=drop, evaluate=evaluate)


def steps_to_target(records, *, drop=0.01, evaluate="ranks"):
    """Steps to the target of each mixing at each ``p`` in :func:`~.sgd.run_sgd` records (each
    with its ``seed``; ``tau`` and ``delay`` 1 and 0 where absent): the target at a ``p`` and
    seed is the best accuracy AllReduce reached in the first half of its steps less ``drop``
    (so that a scheme needing up to twice AllReduce's steps still reaches it); the median over
    seeds.

    Returns:
        ``{p: {"target": mean target, "steps": {label: median steps, or None when most seeds
        never reached it}}}``.
    """
    out = {}
    for p in sorted({r["p"] for r in records}):
        at = [r for r in records if r["p"] == p]
        found, targets = {}, []
        for seed in sorted({r["seed"] for r in at}):
            runs = [r for r in at if r["seed"] == seed]
            ar = [r for r in runs if r["scheme"] == "allreduce"]
            if not ar:
                raise ValueError(f"no AllReduce run at p = {p}, seed {seed}: it sets the target")
            half = [a for k, a in zip(ar[0]["steps"], ar[0]["accuracy"]) if k <= ar[0]["steps"][-1] / 2]
            target = max(half) - drop
            targets.append(target)
            for r in runs:
                key = label(r["scheme"], r.get("tau", 1), r.get("delay", 0))
                found.setdefault(key, []).append(steps_to(r, target, _metric(r["scheme"], evaluate)))
        out[p] = {"target": float(np.mean(targets)), "steps": {s: _median(v) for s, v in found.items()}}
    return out


def _median(values):
    """The median of the step counts, a run that never reached the target counted as infinite;
    None if that median is."""
    m = float(np.median([np.inf if v is None else v for v in values]))
    return None if np.isinf(m) else m


def assign_mixing(rows, *, max_tau=64):
    """Give each time-model row the accuracy simulator's ``scheme``, ``tau`` and ``delay`` for
    it (:func:`mixing_of` its models moved per step) and their ``mixing`` label. Returns ``rows``."""
    for r in rows:
        scheme, tau, delay = mixing_of(r["method"], r["models_moved_per_step"], max_tau=max_tau)
        r.update(scheme=scheme, tau=tau, delay=delay, mixing=label(scheme, tau, delay))
    return rows


def join(rows, accuracy):
    """Give each time-model row (with its ``mixing`` label) ``steps_to_target`` (None if its
    mixing never reached the target, or was not simulated) and ``seconds_to_target`` (those
    steps at its steps per second per rank). Returns ``rows``."""
    for r in rows:
        a = accuracy[r["ranks"]]
        n = a["steps"].get(r["mixing"])
        r.update(target=a["target"], steps_to_target=n,
                 seconds_to_target=(n / r["steps_per_s"] if n is not None and r["steps_per_s"] > 0 else None))
    return rows


def time_to_accuracy(costs, problem_for, *, ranks, rates_gbit, per_node, mb, compute, methods,
                     stragglers=(1.0, 2.0), time_steps=10, sim_steps=1000, lr=0.05, seeds=(0,), drop=0.01,
                     skew=0.0, evaluate="ranks", evals=50, progress=None):
    """The time model's rows (:func:`~.scaling.predict`) at each ``p`` and rate, each with the
    accuracy simulator's mixing for it (``scheme``, ``tau``, ``delay``, ``mixing``), its steps
    to the target and the seconds they take (:func:`join`).

    Returns:
        ``(rows, accuracy)``: ``accuracy`` as :func:`steps_to_target`'s.
    """
    for m in methods:
        mixing_of(m)   # an unknown method fails before any simulation
    rows = predict(costs, ranks=sorted(ranks), rates_gbit=rates_gbit, per_node=per_node, mb=mb, compute=compute,
                   methods=tuple(methods), steps=time_steps, stragglers=stragglers, progress=progress)
    assign_mixing(rows, max_tau=max(1, sim_steps // 4))
    settings = {(r["ranks"], r["scheme"], r["tau"], r["delay"]) for r in rows}
    accuracy = accuracy_steps(problem_for, settings, steps=sim_steps, lr=lr, seeds=seeds, drop=drop, evals=evals,
                              skew=skew, evaluate=evaluate, progress=progress)
    return join(rows, accuracy), accuracy


def winners(rows):
    """``{(straggler, ranks, rate): (method, seconds, its time / AllReduce's)}``: the method
    first to the target in each cell (None where none reaches it)."""
    cells = {}
    for r in rows:
        cells.setdefault((r["straggler"], r["ranks"], r["rate_gbit"]), []).append(r)
    out = {}
    for key, got in cells.items():
        reached = [r for r in got if r["seconds_to_target"] is not None]
        if not reached:
            out[key] = None
            continue
        best = min(reached, key=lambda r: r["seconds_to_target"])
        ar = next((r["seconds_to_target"] for r in got if r["method"] == "allreduce"), None)
        out[key] = (best["method"], best["seconds_to_target"], best["seconds_to_target"] / ar if ar else None)
    return out


def markdown(rows, accuracy):
    """Per straggler setting, seconds to the target (ranks and rate down, methods across; in
    brackets the mixing where it is not the method's every-step one), the first in bold; then
    the steps each mixing needed and the caveats."""
    methods = list(dict.fromkeys(r["method"] for r in rows))
    best = winners(rows)
    out = []
    for factor in sorted({r["straggler"] for r in rows}):
        title = "no straggler" if factor == 1.0 else f"rank 1 {factor:g}x slow"
        out += [f"**{title}**: seconds to the target accuracy (first in bold; - : not reached in the simulated "
                "steps; AGP's mixing in brackets: a round every k steps, as its link allows)", "",
                "| ranks | Gbit/s | " + " | ".join(methods) + " | first | vs AllReduce |",
                "|---|---|" + "---|" * (len(methods) + 2)]
        cells = {}
        for r in rows:
            if r["straggler"] == factor:
                cells.setdefault((r["ranks"], r["rate_gbit"]), {})[r["method"]] = r
        for (p, rate), got in cells.items():
            win = best[(factor, p, rate)]
            text = []
            for m in methods:
                r = got[m]
                s = r["seconds_to_target"]
                cell = "-" if s is None else (f"**{s:.1f}**" if win and m == win[0] else f"{s:.1f}")
                if r.get("tau", 1) > 1:
                    cell += f" (every {r['tau']})"
                text.append(cell)
            first = "-" if win is None else win[0]
            ratio = "-" if win is None or win[2] is None else f"{win[2]:.2f}"
            out.append(f"| {p} | {rate:g} | " + " | ".join(text) + f" | {first} | {ratio} |")
        out.append("")
    mixings = sorted({s for a in accuracy.values() for s in a["steps"]})
    out += ["Steps to the target in the accuracy simulator (AllReduce's best accuracy in its first half of the "
            "steps less the drop; median over seeds; - : not reached):", "", "| ranks | target | " + " | ".join(mixings) + " |",
            "|---|---|" + "---|" * len(mixings)]
    for p, a in sorted(accuracy.items()):
        out.append(f"| {p} | {a['target']:.3f} | "
                   + " | ".join("" if s not in a["steps"] else "-" if a["steps"][s] is None else f"{a['steps'][s]:g}"
                                for s in mixings) + " |")
    out += ["", "Mixing per method: " + ", ".join(f"{m} as {label(MIXING[m][0], 1, MIXING[m][1])}" for m in MIXING
                                              if m != MIXING[m][0])
            + ", osgp:D as sgp delay D; AGP a round every round(1 / models moved per step) steps. Left out: the "
            "accuracy simulator steps all ranks together (an asynchronous method's ranks at different speeds "
            "count at their mean pace) on the one problem named above; AGP's messages carry what accumulated while "
            "the last was in flight, counted here as one PushSum share."]
    return "\n".join(out)
