"""Time to accuracy at scale: the accuracy simulator (:mod:`.sgd`) joined to the time model
(:mod:`.scaling`).

For each cluster (ranks ``p``, link rate, straggler) the time model gives each method's steps
per second per rank and, for AGP, the schedule of its messages; that sets how the accuracy
simulator mixes for it (:func:`mixing_of`): SGP a PushSum round every step, OSGP:D with its
messages D rounds in flight, AGP as :class:`~mpigossip.AsyncPushSum` runs it (a share to an
out-peer each step, per out-peer one message in flight and one accumulating, the weight
floor), each message combined after a delay drawn from the time model's own (the steps
between a share leaving and its receiver taking it in, at the steady state: where the link
cannot keep up, messages wait, fewer leave and each carries more). The accuracy simulator then gives the steps each mixing needs to reach the target
(AllReduce's best accuracy in the first half of its steps at that ``p`` less ``drop``), and their ratio to the steps per
second the time to the target.

What a rank holds is what is evaluated (``evaluate="ranks"``: the mean accuracy of the ranks'
own models; EASGD's center, which is its output), or the exact mean of the ranks' models
(``"mean"``: a final AllReduce, where every scheme looks alike on a convex problem).

What the join leaves out (the caveats every table states): the accuracy simulator steps all
ranks together, so an asynchronous method whose ranks run at different speeds is counted at
their mean pace (AGP's delays, in the receiver's steps, mix a slow rank's and a fast one's);
AGP's delays are drawn independently per message from the steady state's distribution
(their order and which pair of ranks, e.g. within or between nodes, are not kept).
"""

import numpy as np

from .scaling import predict
from .sgd import run_sgd

__all__ = ["MIXING", "mixing_of", "label", "accuracy_steps", "steps_to", "steps_to_target", "assign_mixing", "join",
           "time_to_accuracy", "winners", "markdown"]

#: The accuracy simulator's scheme and message delay (rounds) of each time-model method
#: (AGP's delays come from the time model's schedule: :func:`mixing_of`).
MIXING = {"allreduce": ("allreduce", 0), "sgp": ("sgp", 0), "agp": ("agp", 0), "gossip-pull": ("gossip-pull", 0),
          "easgd": ("easgd", 0)}


def mixing_of(method, delays=None):
    """``(scheme, tau, delay, delays)``: how the accuracy simulator mixes for ``method``
    (``osgp:D``: PushSum with its messages ``D`` rounds in flight; ``agp``: its messages'
    ``delays`` as the time model found them, :func:`~.scaling.delay_deciles`, required)."""
    if method.startswith("osgp"):
        _, _, d = method.partition(":")
        return "sgp", 1, int(d or 1), None
    if method not in MIXING:
        raise ValueError(f"no accuracy scheme for {method!r}: the methods joined are "
                         f"{sorted(MIXING) + ['osgp:D']}")
    scheme, delay = MIXING[method]
    if scheme == "agp":
        if delays is None:
            raise ValueError("agp: the accuracy simulator mixes it by the time model's message delays; none given")
        return scheme, 1, delay, tuple(int(d) for d in delays)
    return scheme, 1, delay, None


def label(scheme, tau=1, delay=0, delays=None):
    """A mixing's name in the tables and the JSON: ``sgp``, ``sgp every 3``, ``sgp delay 1``,
    ``agp delays 1,1,2,...`` (AGP's ten delay deciles; ``agp never`` where none arrives)."""
    if delays is not None:
        return scheme + (" delays " + ",".join(map(str, delays)) if len(delays) else " never")
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
    """Run the accuracy simulator for each ``(p, scheme, tau, delay, delays)`` of ``settings`` (and
    AllReduce at each ``p``: it sets the target) and give :func:`steps_to_target` of its runs.

    Args:
        problem_for: ``problem_for(seed)`` -> a problem for :func:`~.sgd.run_sgd`.
        steps, lr, skew: SGD steps, step size and data skew of every run.
        drop: the target is AllReduce's best accuracy in its first half at that ``p`` and seed
            less this.
        evals: evaluations per run (the resolution of the step counts).
        evaluate: ``"ranks"`` or ``"mean"`` (the module's docstring).
    """
    settings = sorted(set(settings) | {(p, "allreduce", 1, 0, None) for p, *_ in settings},
                      key=lambda s: (s[0], s[1], s[2], s[3], s[4] or ()))
    records = []
    for seed in seeds:
        problem = problem_for(seed)
        for p, scheme, tau, delay, delays in settings:
            if progress:
                progress(f"accuracy: p = {p}, seed {seed}: {label(scheme, tau, delay, delays)}")
            r = run_sgd(problem, scheme, p, steps=steps, lr=lr, seed=seed, tau=tau, delay=delay, skew=skew,
                        delays=delays, eval_every=max(1, steps // evals))
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
                key = label(r["scheme"], r.get("tau", 1), r.get("delay", 0), r.get("delays"))
                found.setdefault(key, []).append(steps_to(r, target, _metric(r["scheme"], evaluate)))
        out[p] = {"target": float(np.mean(targets)), "steps": {s: _median(v) for s, v in found.items()}}
    return out


def _median(values):
    """The median of the step counts, a run that never reached the target counted as infinite;
    None if that median is."""
    m = float(np.median([np.inf if v is None else v for v in values]))
    return None if np.isinf(m) else m


def assign_mixing(rows):
    """Give each time-model row the accuracy simulator's ``scheme``, ``tau``, ``delay`` and
    ``delays`` for it (:func:`mixing_of`; AGP's from the row's ``delays``) and their ``mixing``
    label. Returns ``rows``."""
    for r in rows:
        scheme, tau, delay, delays = mixing_of(r["method"], r.get("delays"))
        r.update(scheme=scheme, tau=tau, delay=delay, delays=None if delays is None else list(delays),
                 mixing=label(scheme, tau, delay, delays))
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
                     skew=0.0, evaluate="ranks", evals=50, progress=None, predictions=None):
    """The time model's rows (:func:`~.scaling.predict`) at each ``p`` and rate, each with the
    accuracy simulator's mixing for it (``scheme``, ``tau``, ``delay``, ``mixing``), its steps
    to the target and the seconds they take (:func:`join`). ``predictions``: rows
    :func:`~.scaling.predict` made before (``timemodel predict``'s JSON), taken instead of
    simulating again (:func:`taken_predictions`: every cell asked for must be there, made
    with the same model size, compute and ranks per node).

    Returns:
        ``(rows, accuracy)``: ``accuracy`` as :func:`steps_to_target`'s.
    """
    for m in methods:
        mixing_of(m, ())   # an unknown method fails before any simulation
    if predictions is not None:
        rows = taken_predictions(predictions, ranks=sorted(ranks), rates_gbit=rates_gbit, per_node=per_node, mb=mb,
                                 compute=compute, methods=methods, stragglers=stragglers)
    else:
        rows = predict(costs, ranks=sorted(ranks), rates_gbit=rates_gbit, per_node=per_node, mb=mb, compute=compute,
                       methods=tuple(methods), steps=time_steps, stragglers=stragglers, progress=progress)
    assign_mixing(rows)
    settings = {(r["ranks"], r["scheme"], r["tau"], r["delay"], None if r["delays"] is None else tuple(r["delays"]))
                for r in rows}
    accuracy = accuracy_steps(problem_for, settings, steps=sim_steps, lr=lr, seeds=seeds, drop=drop, evals=evals,
                              skew=skew, evaluate=evaluate, progress=progress)
    return join(rows, accuracy), accuracy


def taken_predictions(predictions, *, ranks, rates_gbit, per_node, mb, compute, methods, stragglers):
    """The rows of ``predictions`` (:func:`~.scaling.predict`'s) for each (ranks, rate,
    straggler, method) asked for, copied, in :func:`~.scaling.predict`'s order. Raises
    ValueError naming a cell that is missing, or one made with another model size, compute or
    ranks per node."""
    found = {}
    for r in predictions:
        found[(r["ranks"], float(r["rate_gbit"]), float(r["straggler"]), r["method"])] = r
    rows = []
    for p in ranks:
        for rate in rates_gbit:
            for factor in stragglers:
                for m in methods:
                    r = found.get((p, float(rate), float(factor), m))
                    if r is None:
                        raise ValueError(f"--predictions: no row for {m} at {p} ranks, {rate:g} Gbit, straggler "
                                         f"x{factor:g} (make it with `timemodel predict`)")
                    made = (r["per_node"], r["mb"], r["compute_s"])
                    if not np.allclose(made, (per_node, mb, compute)):
                        raise ValueError(f"--predictions: the row for {m} at {p} ranks, {rate:g} Gbit was made with "
                                         f"{made[0]} ranks a node, {made[1]:g} MB, {made[2] * 1e3:g} ms of compute, "
                                         f"not {per_node}, {mb:g} MB, {compute * 1e3:g} ms")
                    rows.append(dict(r))
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
    """Per straggler setting, seconds to the target (ranks and rate down, methods across; AGP's
    median message delay in brackets), the first in bold; then the steps each mixing needed
    (AGP's per delay schedule) and the caveats."""
    methods = list(dict.fromkeys(r["method"] for r in rows))
    best = winners(rows)
    out = []
    for factor in sorted({r["straggler"] for r in rows}):
        title = "no straggler" if factor == 1.0 else f"rank 1 {factor:g}x slow"
        out += [f"**{title}**: seconds to the target accuracy (first in bold; - : not reached in the simulated "
                "steps; AGP's median message delay in brackets, in steps, as the time model found it)", "",
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
                if r.get("delays") is not None:
                    cell += f" (delay {_median_delay(r['delays'])})"
                text.append(cell)
            first = "-" if win is None else win[0]
            ratio = "-" if win is None or win[2] is None else f"{win[2]:.2f}"
            out.append(f"| {p} | {rate:g} | " + " | ".join(text) + f" | {first} | {ratio} |")
        out.append("")
    every = {s for a in accuracy.values() for s in a["steps"]}
    mixings = sorted(s for s in every if not s.startswith("agp "))
    out += ["Steps to the target in the accuracy simulator (AllReduce's best accuracy in its first half of the "
            "steps less the drop; median over seeds; - : not reached):", "", "| ranks | target | " + " | ".join(mixings) + " |",
            "|---|---|" + "---|" * len(mixings)]
    for p, a in sorted(accuracy.items()):
        out.append(f"| {p} | {a['target']:.3f} | "
                   + " | ".join("" if s not in a["steps"] else "-" if a["steps"][s] is None else f"{a['steps'][s]:g}"
                                for s in mixings) + " |")
    agp = sorted({(r["ranks"], r["rate_gbit"], r["straggler"], r["mixing"]) for r in rows if r.get("delays") is not None})
    if agp:
        out += ["", "AGP's steps to the target, mixed by its own message delays (the time model's, in steps; their "
                "5th, 15th, ..., 95th percentiles):", "", "| ranks | Gbit/s | straggler | delays | steps |",
                "|---|---|---|---|---|"]
        for p, rate, factor, mixing in agp:
            n = accuracy[p]["steps"].get(mixing)
            out.append(f"| {p} | {rate:g} | x{factor:g} | {mixing.removeprefix('agp ').removeprefix('delays ')} | {'-' if n is None else f'{n:g}'} |")
    out += ["", "Mixing per method: osgp:D as sgp delay D; AGP as AsyncPushSum runs it (a share to an out-peer each "
            "step, one message in flight and one accumulating per out-peer, the weight floor), each message "
            "combined a delay after it left drawn from the time model's. Left out: the accuracy simulator steps all "
            "ranks together (an asynchronous method's ranks at different speeds count at their mean pace) on the "
            "one problem named above; AGP's delays are drawn per message from their distribution (not their order, "
            "nor whether the pair of ranks shares a node)."]
    return "\n".join(out)


def _median_delay(delays):
    return "never" if not len(delays) else f"{float(np.median(delays)):g}"
