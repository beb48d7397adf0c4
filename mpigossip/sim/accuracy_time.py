"""Time to accuracy at scale: the accuracy simulator (:mod:`.sgd`) joined to the time model
(:mod:`.scaling`).

For each number of ranks ``p`` the accuracy simulator runs each scheme in lockstep on its
convex problem and gives the steps it needs to reach a target accuracy (AllReduce's final
accuracy at that ``p`` less ``drop``); the time model gives each method's steps per second
per rank on the predicted cluster; their ratio is the time to the target. Methods the
accuracy simulator has no scheme for borrow the closest one (:data:`CURVE_OF`: OSGP and AGP
mix as PushSum and take SGP's steps).

What the join leaves out (the caveats every table states): the accuracy simulator steps all
ranks together, so an asynchronous method whose ranks run at different speeds is counted at
their mean pace, and one that mixes less often than once a step (it cannot keep up with its
link: ``models_moved_per_step`` below its method's own) is credited with a full step's mixing.
"""

import numpy as np

from .scaling import predict
from .sgd import run_sgd

__all__ = ["CURVE_OF", "accuracy_steps", "steps_to_target", "time_to_accuracy", "winners", "markdown"]

#: The accuracy simulator's scheme whose steps each time-model method takes.
CURVE_OF = {"allreduce": "allreduce", "sgp": "sgp", "osgp:2": "sgp", "agp": "sgp", "gossip-pull": "gossip-pull",
            "easgd": "easgd"}


def steps_to(curve, target):
    """The first evaluated step count whose accuracy reaches ``target``, or None."""
    for steps, accuracy in zip(curve["steps"], curve["accuracy"]):
        if accuracy >= target:
            return steps
    return None


def accuracy_steps(problem_for, ranks, *, schemes, steps, lr, seeds=(0,), drop=0.01, evals=50, progress=None):
    """Run the accuracy simulator and give :func:`steps_to_target` of its runs.

    Args:
        problem_for: ``problem_for(seed)`` -> a problem for :func:`~.sgd.run_sgd`.
        ranks: the numbers of virtual ranks.
        schemes: accuracy simulator schemes (AllReduce is always run: it sets the target).
        steps, lr: SGD steps and step size of every run.
        drop: the target is AllReduce's final accuracy at that ``p`` and seed less this.
        evals: evaluations per run (the resolution of the step counts).
    """
    schemes = tuple(dict.fromkeys(("allreduce",) + tuple(schemes)))
    records = []
    for seed in seeds:
        problem = problem_for(seed)
        for p in ranks:
            for s in schemes:
                if progress:
                    progress(f"accuracy: p = {p}, seed {seed}: {s}")
                r = run_sgd(problem, s, p, steps=steps, lr=lr, seed=seed, eval_every=max(1, steps // evals))
                records.append({**r, "seed": seed})
    return steps_to_target(records, lr=lr, drop=drop)


def steps_to_target(records, *, lr, drop=0.01):
    """Steps to the target of each scheme at each ``p`` in :func:`~.sgd.run_sgd` records (each
    with its ``seed``) of step size ``lr``: the target at a ``p`` and seed is AllReduce's final
    accuracy there less ``drop``; the median over seeds.

    Returns:
        ``{p: {"target": mean target, "steps": {scheme: median steps, or None when most seeds
        never reached it}}}``.
    """
    out = {}
    chosen = [r for r in records if r["lr"] == lr]
    for p in sorted({r["p"] for r in chosen}):
        at = [r for r in chosen if r["p"] == p]
        found, targets = {}, []
        for seed in sorted({r["seed"] for r in at}):
            runs = {r["scheme"]: r for r in at if r["seed"] == seed}
            if "allreduce" not in runs:
                raise ValueError(f"no AllReduce run at p = {p}, seed {seed}, lr {lr}: it sets the target")
            target = runs["allreduce"]["accuracy"][-1] - drop
            targets.append(target)
            for scheme, r in runs.items():
                found.setdefault(scheme, []).append(steps_to(r, target))
        out[p] = {"target": float(np.mean(targets)), "steps": {s: _median(v) for s, v in found.items()}}
    return out


def _median(values):
    """The median of the step counts, a run that never reached the target counted as infinite;
    None if that median is."""
    m = float(np.median([np.inf if v is None else v for v in values]))
    return None if np.isinf(m) else m


def time_to_accuracy(costs, accuracy, *, rates_gbit, per_node, mb, compute, methods, stragglers=(1.0, 2.0),
                     time_steps=10, progress=None):
    """The time model's rows (:func:`~.scaling.predict`) at each ``p`` of ``accuracy``
    (:func:`accuracy_steps`), each with ``steps_to_target`` (its scheme's, or None) and
    ``seconds_to_target`` (those steps at its steps per second per rank)."""
    unknown = [m for m in methods if m not in CURVE_OF]
    if unknown:
        raise ValueError(f"no accuracy scheme for {unknown}: the methods joined are {sorted(CURVE_OF)}")
    rows = predict(costs, ranks=sorted(accuracy), rates_gbit=rates_gbit, per_node=per_node, mb=mb, compute=compute,
                   methods=tuple(methods), steps=time_steps, stragglers=stragglers, progress=progress)
    for r in rows:
        scheme = CURVE_OF[r["method"]]
        n = accuracy[r["ranks"]]["steps"].get(scheme)
        r.update(scheme=scheme, target=accuracy[r["ranks"]]["target"], steps_to_target=n,
                 seconds_to_target=(n / r["steps_per_s"] if n is not None and r["steps_per_s"] > 0 else None))
    return rows


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
    """Per straggler setting, seconds to the target (ranks and rate down, methods across),
    the first in bold; then the steps each scheme needed and the caveats."""
    methods = list(dict.fromkeys(r["method"] for r in rows))
    best = winners(rows)
    out = []
    for factor in sorted({r["straggler"] for r in rows}):
        title = "no straggler" if factor == 1.0 else f"rank 1 {factor:g}x slow"
        out += [f"**{title}**: seconds to the target accuracy (first in bold; - : not reached in the simulated "
                "steps)", "", "| ranks | Gbit/s | " + " | ".join(methods) + " | first |",
                "|---|---|" + "---|" * (len(methods) + 1)]
        cells = {}
        for r in rows:
            if r["straggler"] == factor:
                cells.setdefault((r["ranks"], r["rate_gbit"]), {})[r["method"]] = r["seconds_to_target"]
        for (p, rate), got in cells.items():
            win = best[(factor, p, rate)]
            text = ["-" if got[m] is None else (f"**{got[m]:.1f}**" if win and m == win[0] else f"{got[m]:.1f}")
                    for m in methods]
            first = "-" if win is None else win[0]
            out.append(f"| {p} | {rate:g} | " + " | ".join(text) + f" | {first} |")
        out.append("")
    schemes = list(dict.fromkeys(s for a in accuracy.values() for s in a["steps"]))
    out += ["Steps to the target in the accuracy simulator (AllReduce's final accuracy less the drop; median over "
            "seeds):", "", "| ranks | target | " + " | ".join(schemes) + " |", "|---|---|" + "---|" * len(schemes)]
    for p, a in sorted(accuracy.items()):
        out.append(f"| {p} | {a['target']:.3f} | "
                   + " | ".join("-" if a["steps"][s] is None else f"{a['steps'][s]:g}" for s in schemes) + " |")
    out += ["", "Borrowed curves: " + ", ".join(f"{m} takes {s}'s steps" for m, s in CURVE_OF.items() if m != s)
            + ". Left out: the accuracy simulator steps all ranks together (an asynchronous method's ranks at "
            "different speeds count at their mean pace) and credits every step with its scheme's full mixing, "
            "also where the time model finds a method moving fewer models per step than it means to."]
    return "\n".join(out)
