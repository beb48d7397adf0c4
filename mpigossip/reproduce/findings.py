"""The findings (a)-(e) of Jin et al. 2016 and Assran et al. 2019, each judged from the runs
by rules stated next to them. Nothing here is measured or hard-coded: every verdict is a
function of the run records of :mod:`.experiments` and :mod:`.simulate`.

Every finding is split into sub-claims, each decided from comparisons **paired by seed**
(the seeds vary the initialisation and the batches, not the data: ``--data-seed`` is fixed):
for the per-seed differences ``d``, a sub-claim "mean(d) < threshold" *holds* when the
one-sided 95% bound ``mean + t * se`` is below the threshold, is *contradicted* when
``mean - t * se`` is above it, and is *not decided* otherwise (``t``: Student's quantile for
the number of seeds; one seed decides nothing). A finding is "reproduced" only if every
sub-claim holds, "not reproduced" if any is contradicted, "partly" if some hold and none is
contradicted, "not decided" if none is decided, and "not tested" without any sub-claim.
"""

import math
import statistics

REPRODUCED, PARTLY, NOT, UNDECIDED_V, UNTESTED = ("reproduced", "partly", "not reproduced", "not decided",
                                                  "not tested")
HOLDS, CONTRADICTED, UNDECIDED = "holds", "contradicted", "not decided"

#: (c): the methods reach "about the same minimum" when their best final test losses lie
#: within this fraction of the lowest one.
SAME_MINIMUM = 0.15
#: (e): "within about 1 point" of AllReduce's test accuracy.
ACCURACY_POINTS = 0.01
#: (e): overlap SGP "tolerates slow nodes" when it keeps this fraction of its throughput with
#: one rank permanently 2x slow.
STRAGGLER_KEEP = 0.85
#: (e): the negative control: synchronous SGP waits for the slow rank at every step, so it
#: must keep less than this; if it keeps more, the measurement cannot tell a tolerant method
#: from an intolerant one and the straggler sub-claim is not decided.
CONTROL_KEEP = 0.7
#: One-sided 95% quantiles of Student's t by degrees of freedom (seeds - 1).
T95 = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860, 9: 1.833, 10: 1.812}


def auc(curve):
    """Mean test loss over the evaluations after the start: the area under the loss curve
    per step, lower = converges faster."""
    later = [p["loss"] for p in curve if p["steps"] > 0]
    return sum(later) / len(later)


class Stat:
    """Mean and spread (sample standard deviation; 0 for one seed) of one figure over seeds."""

    def __init__(self, values):
        self.values = list(values)
        self.mean = statistics.fmean(self.values)
        self.std = statistics.stdev(self.values) if len(self.values) > 1 else 0.0

    def __str__(self):
        return f"{self.mean:.4f} ± {self.std:.4f}" if len(self.values) > 1 else f"{self.mean:.4f}"


def select(records, **match):
    return [r for r in records if all(r.get(k) == v for k, v in match.items())]


def figure_of(record, figure):
    """A run's ``figure``: a summary key, or ``"auc"`` (mean test loss over the run)."""
    return auc(record["curve"]) if figure == "auc" else record[figure]


def by_seed(records, figure, **match):
    """``{seed: figure}`` over the matching runs."""
    return {r["seed"]: figure_of(r, figure) for r in select(records, **match)}


def stat(records, figure, **match):
    """:class:`Stat` of ``figure`` over the matching runs, or None."""
    values = list(by_seed(records, figure, **match).values())
    return Stat(values) if values else None


def sim_final(sim_records, key="loss", **match):
    """:class:`Stat` of the last value of ``key`` (``"loss"``, ``"accuracy"``) over the matching
    simulator runs (``scheme=``, ``p=``, ``lr=``)."""
    return Stat(r[key][-1] for r in select(sim_records, **match))


class Decision:
    """A sub-claim "mean(d) < threshold" decided from the per-seed differences ``d``."""

    def __init__(self, what, d, threshold=0.0):
        self.what, self.d, self.threshold = what, list(d), threshold
        n = len(self.d)
        self.mean = statistics.fmean(self.d) if n else math.nan
        if n < 2:
            self.outcome, self.bound = UNDECIDED, math.nan
            return
        se = statistics.stdev(self.d) / math.sqrt(n)
        self.bound = T95.get(n - 1, 1.645) * se
        if self.mean + self.bound < threshold:
            self.outcome = HOLDS
        elif self.mean - self.bound > threshold:
            self.outcome = CONTRADICTED
        else:
            self.outcome = UNDECIDED

    def __str__(self):
        if not self.d:
            return f"{self.what}: not run ({UNDECIDED})"
        spread = "" if math.isnan(self.bound) else f" ± {self.bound:.3g}"
        return f"{self.what}: {self.outcome} (paired difference {self.mean:+.4g}{spread}, {len(self.d)} seed(s))"


def paired(a, b):
    """Per-seed differences ``a[s] - b[s]`` over the seeds both have."""
    return [a[s] - b[s] for s in sorted(set(a) & set(b))]


def less(what, a, b, margin=0.0):
    """Sub-claim ``a < b - margin`` (per-seed dicts, paired)."""
    return Decision(what, paired(a, b), -margin)


def verdict(decisions):
    """The finding's verdict from its sub-claims (see the module's rule)."""
    outcomes = [d.outcome for d in decisions]
    if not outcomes:
        return UNTESTED
    if CONTRADICTED in outcomes:
        return NOT
    if all(o == HOLDS for o in outcomes):
        return REPRODUCED
    if HOLDS in outcomes:
        return PARTLY
    return UNDECIDED_V


class Finding:
    """One finding: its claim, the setting, the figures, the rule, the sub-claims and the
    computed verdict."""

    def __init__(self, key, claim, setting, rule, header=()):
        self.key, self.claim, self.setting, self.rule = key, claim, setting, rule
        self.header = list(header)
        self.rows, self.notes, self.decisions, self.verdict = [], [], [], UNTESTED
        self.extra = []   # markdown lines after the notes (figures that are not judged)

    def row(self, *cells):
        self.rows.append([str(c) for c in cells])

    def decide(self, decision):
        self.decisions.append(decision)
        self.notes.append(str(decision))
        return decision

    def close(self):
        self.verdict = verdict(self.decisions)
        return self


def _gossip(records, figure, **match):
    """The better of gossip-pull and gossip-push for ``figure`` (lower mean), as (name, Stat)."""
    found = [(g, stat(records, figure, algorithm=g, **match)) for g in ("gossip-pull", "gossip-push")]
    found = [(g, s) for g, s in found if s is not None]
    return min(found, key=lambda gs: gs[1].mean) if found else (None, None)


def _sizes(records):
    return sorted({r["world_size"] for r in records})


def speed(records, lr, key, claim):
    """(a) and (b), at every p: which methods converge faster (area under the test-loss
    curve) at one step size, and for (b) also more accurately (final test loss)."""
    small = key == "b"
    f = Finding(key, claim, f"every p ({', '.join(map(str, _sizes(records)))}), lr = {lr:g}, {_seeds(records)}",
                "faster = lower mean test loss over the run's evaluations (area under the loss curve); "
                + ("at each p AllReduce must be faster than EASGD and than the better gossip variant, and end at "
                   "a lower test loss" if small else
                   "at each p EASGD and the better gossip variant must each be faster than AllReduce")
                + "; each a paired comparison over seeds.",
                header=("p", "method", "mean test loss (speed)", "final test loss"))
    for p in _sizes(records):
        match = dict(world_size=p, lr=lr)
        ar, ar_final = by_seed(records, "auc", algorithm="allreduce", **match), \
            by_seed(records, "final_loss", algorithm="allreduce", **match)
        if not ar:
            continue
        f.row(p, "allreduce", stat(records, "auc", algorithm="allreduce", **match),
              stat(records, "final_loss", algorithm="allreduce", **match))
        g_name, _ = _gossip(records, "auc", **match)
        for name in ("easgd", g_name):
            if name is None or not select(records, algorithm=name, **match):
                f.decide(Decision(f"p = {p}: {name or 'gossip'} not run", []))
                continue
            s, final = by_seed(records, "auc", algorithm=name, **match), \
                by_seed(records, "final_loss", algorithm=name, **match)
            f.row(p, name, stat(records, "auc", algorithm=name, **match),
                  stat(records, "final_loss", algorithm=name, **match))
            if small:
                f.decide(less(f"p = {p}: AllReduce faster than {name}", ar, s))
                f.decide(less(f"p = {p}: AllReduce more accurate than {name}", ar_final, final))
            else:
                f.decide(less(f"p = {p}: {name} faster than AllReduce", s, ar))
    return f.close()


def _seeds(records):
    n = len({r["seed"] for r in records})
    return f"{n} seed{'s' if n != 1 else ''}"


def _best_lr(records, figure, p, name, lower=True):
    """The step size with the best mean ``figure`` for ``name`` at ``p`` (chosen on means)."""
    lrs = sorted({r["lr"] for r in select(records, world_size=p, algorithm=name)})
    if not lrs:
        return None
    pick = min if lower else max
    return pick(lrs, key=lambda lr: stat(records, figure, algorithm=name, world_size=p, lr=lr).mean)


def same_minimum(records, p):
    """(c): at p = 8 the methods of Jin et al. reach about the same minimum, EASGD the best."""
    f = Finding("c", "at p = 8 all methods reach about the same minimum, EASGD the best",
                f"p = {p}, best step size per method (on the means), {_seeds(records)}",
                f"'about the same' = per seed, the largest best final test loss within {SAME_MINIMUM:.0%} of the "
                "lowest (paired over seeds); 'EASGD best' = EASGD's below each other method's (paired).",
                header=("method", "step size", "best final test loss"))
    names = [n for n in ("allreduce", "easgd", "gossip-pull", "gossip-push")
             if select(records, world_size=p, algorithm=n)]
    if "easgd" not in names or len(names) < 2:
        f.notes.append("needs EASGD and another method at this p")
        return f.close()
    best = {}
    for name in names:
        lr = _best_lr(records, "final_loss", p, name)
        best[name] = by_seed(records, "final_loss", algorithm=name, world_size=p, lr=lr)
        f.row(name, f"{lr:g}", stat(records, "final_loss", algorithm=name, world_size=p, lr=lr))
    seeds = sorted(set.intersection(*(set(v) for v in best.values())))
    gaps = [max(v[s] for v in best.values()) / min(v[s] for v in best.values()) - 1 for s in seeds]
    f.decide(Decision(f"every method within {SAME_MINIMUM:.0%} of the lowest", gaps, SAME_MINIMUM))
    for name in names:
        if name != "easgd":
            f.decide(less(f"EASGD below {name}", best["easgd"], best[name]))
    return f.close()


def easgd_scaling(records, p_small, p_large):
    """(d) on real ranks, at every step size: from p_small to p_large EASGD degrades (its final
    loss relative to AllReduce's grows), and gossip ends below EASGD at p_large."""
    f = Finding("d", "at p = 16 EASGD degrades (especially with small step sizes); gossip does somewhat better",
                f"p = {p_small} vs {p_large}, every step size, {_seeds(records)}",
                "degrades = EASGD's final test loss divided by AllReduce's (per seed) grows from the smaller to the "
                "larger p; gossip better = the better gossip variant's final test loss below EASGD's at the larger "
                "p; both at every step size, paired over seeds.",
                header=("step size", "p", "EASGD final test loss", "AllReduce", "EASGD / AllReduce"))
    for lr in sorted({r["lr"] for r in select(records, world_size=p_large)}):
        ratios = {}
        for p in (p_small, p_large):
            e = by_seed(records, "final_loss", algorithm="easgd", world_size=p, lr=lr)
            a = by_seed(records, "final_loss", algorithm="allreduce", world_size=p, lr=lr)
            ratios[p] = {s: e[s] / a[s] for s in set(e) & set(a)}
            if ratios[p]:
                f.row(f"{lr:g}", p, stat(records, "final_loss", algorithm="easgd", world_size=p, lr=lr),
                      stat(records, "final_loss", algorithm="allreduce", world_size=p, lr=lr),
                      f"{statistics.fmean(ratios[p].values()):.3f}")
        f.decide(less(f"lr = {lr:g}: EASGD / AllReduce grows from p = {p_small} to {p_large}",
                      ratios[p_small], ratios[p_large]))
        g_name, _ = _gossip(records, "final_loss", world_size=p_large, lr=lr)
        easgd = by_seed(records, "final_loss", algorithm="easgd", world_size=p_large, lr=lr)
        gossip = by_seed(records, "final_loss", algorithm=g_name, world_size=p_large, lr=lr) if g_name else {}
        f.decide(less(f"lr = {lr:g}: {g_name or 'gossip'} below EASGD at p = {p_large}", gossip, easgd))
    return f.close()


def easgd_scaling_sim(sim_records, speeds=None, speed_setting=""):
    """(d) beyond 16, in the simulator: at every step size EASGD's final loss over the better
    gossip's grows from the smallest to the largest p and ends above 1. With the time model's
    ``speeds`` (rows of steps per second per rank of each scheme at each p), also each scheme's
    predicted time to the target (not judged)."""
    f = Finding("d-sim", "beyond p = 16 (simulator): EASGD degrades as p grows, gossip does better",
                "softmax regression, " + _sim_setting(sim_records),
                "per step size and seed: r(p) = EASGD's final training loss / the better gossip's (better on the "
                "means); sub-claims: r at the largest p above r at the smallest, and above 1 (paired over seeds).",
                header=("step size", "mean r(p)"))
    for lr in sorted({r["lr"] for r in sim_records}):
        sizes = sorted({r["p"] for r in sim_records if r["lr"] == lr})
        r = {}
        for p in sizes:
            g = min(("gossip-push", "gossip-pull"), key=lambda s: sim_final(sim_records, scheme=s, p=p, lr=lr).mean)
            e = {x["seed"]: x["loss"][-1] for x in select(sim_records, scheme="easgd", p=p, lr=lr)}
            b = {x["seed"]: x["loss"][-1] for x in select(sim_records, scheme=g, p=p, lr=lr)}
            r[p] = {s: e[s] / b[s] for s in set(e) & set(b)}
        f.row(f"lr = {lr:g}", ", ".join(f"p={p}: {statistics.fmean(v.values()):.4f}" for p, v in r.items()))
        f.decide(less(f"lr = {lr:g}: r(p = {sizes[-1]}) above r(p = {sizes[0]})", r[sizes[0]], r[sizes[-1]]))
        f.decide(less(f"lr = {lr:g}: r(p = {sizes[-1]}) above 1", {s: 1.0 for s in r[sizes[-1]]}, r[sizes[-1]]))
    if speeds:
        f.extra = _sim_times(sim_records, speeds, speed_setting)
    return f.close()


def _sim_times(sim_records, speeds, setting):
    """(d-sim) with time: the simulator's steps to the target over the time model's steps per
    second, per step size, p and scheme (markdown lines)."""
    from ..sim import accuracy_time
    from .simulate import TIMED_SCHEMES
    pace = {(r["ranks"], r["method"]): r["steps_per_s"] for r in speeds}
    schemes = list(dict.fromkeys(r["scheme"] for r in sim_records))
    lines = ["", f"Predicted time to the target ({setting}; the target and the steps: "
             "`timemodel accuracy`'s rule, the ranks' own models, EASGD's center; seconds, and in brackets the "
             "steps; not judged):", ""]
    rows = []
    for lr in sorted({r["lr"] for r in sim_records}):
        steps = accuracy_time.steps_to_target([r for r in sim_records if r["lr"] == lr])
        for p, a in sorted(steps.items()):
            cells = []
            for scheme in schemes:
                n = a["steps"].get(scheme)
                v = pace.get((p, TIMED_SCHEMES.get(scheme)))
                cells.append("-" if n is None else f"({n:g})" if v is None else f"{n / v:.1f} ({n:g})")
            rows.append([f"{lr:g}", str(p), f"{a['target']:.3f}"] + cells)
    lines += md_table(["step size", "p", "target"] + schemes, rows)
    missing = [s for s in schemes if s not in TIMED_SCHEMES]
    if missing:
        lines.append(f"\n{', '.join(missing)}: not in the time model (steps only).")
    return lines


def md_table(header, rows):
    """A markdown table: the header row, the rule, a row per list of cells."""
    return (["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
            + ["| " + " | ".join(r) + " |" for r in rows])


def _sim_setting(sim_records):
    sizes = sorted({r["p"] for r in sim_records})
    seeds = len({r["seed"] for r in sim_records})
    return f"p = {', '.join(map(str, sizes))}, {seeds} seed{'s' if seeds != 1 else ''}"


def sgp(records, timed, timed_on_cluster):
    """(e): SGP's accuracy within about 1 point of AllReduce's at every p; on the timed runs:
    faster per step, sooner to the target accuracy, and overlap SGP tolerating a straggler."""
    f = Finding("e", "SGP reaches consensus and an accuracy within about 1 point of AllReduce while faster per "
                "step when communication is the bottleneck; overlap SGP tolerates slow nodes",
                "accuracy: every p, best step size per method (on the means); timing: the timed runs",
                f"accuracy: AllReduce's final test accuracy minus SGP's below {ACCURACY_POINTS * 100:g} point at each "
                "p (paired over seeds); timing (only on a cluster, where communication counts; paired over "
                "repeats): SGP's time per step and its time to the target accuracy below AllReduce's; with one rank "
                f"permanently 2x slow, and with transient random delays, OSGP keeps >= {STRAGGLER_KEEP} of its "
                f"throughput, each judged only if synchronous SGP (the negative control) keeps < {CONTROL_KEEP}. The consensus distances are shown, not judged (a "
                "smaller distance than gossip's holds by construction).",
                header=("setting", "AllReduce / first", "SGP / second", ""))
    for p in _sizes(records):
        lr_ar = _best_lr(records, "final_accuracy", p, "allreduce", lower=False)
        lr_sgp = _best_lr(records, "final_accuracy", p, "sgp", lower=False)
        if lr_ar is None or lr_sgp is None:
            continue
        ar = by_seed(records, "final_accuracy", algorithm="allreduce", world_size=p, lr=lr_ar)
        s = by_seed(records, "final_accuracy", algorithm="sgp", world_size=p, lr=lr_sgp)
        f.row(f"p = {p}", f"accuracy AllReduce {stat(records, 'final_accuracy', algorithm='allreduce', world_size=p, lr=lr_ar)}",
              f"SGP {stat(records, 'final_accuracy', algorithm='sgp', world_size=p, lr=lr_sgp)}", "")
        f.decide(Decision(f"p = {p}: SGP within {ACCURACY_POINTS * 100:g} point of AllReduce",
                          paired(ar, s), ACCURACY_POINTS))
        for lr in sorted({r["lr"] for r in select(records, world_size=p, algorithm="sgp")}):
            c = stat(records, "consensus_distance", algorithm="sgp", world_size=p, lr=lr)
            g = stat(records, "consensus_distance", algorithm="gossip-push", world_size=p, lr=lr)
            f.row(f"p = {p}, lr = {lr:g}", f"consensus distance SGP {c}", f"gossip-push {g}" if g else "", "shown")
    timing = timing_checks(f, timed)
    if timed_on_cluster:
        for d in timing:
            f.decide(d)
    elif timing:
        f.notes.append("the timed runs ran on one machine, where communication is nearly free: their timing "
                       "sub-claims are shown but not judged (run with --timed-mpiexec on a cluster): "
                       + "; ".join(str(d) for d in timing))
    return f.close()


def time_to_accuracy(curve, target):
    """Training time (evaluations excluded) until the consensus model first reaches
    ``target`` test accuracy, or None."""
    for p in curve:
        if p["accuracy"] >= target:
            return p["time_s"]
    return None


def target_accuracy(timed):
    """The timed runs' target: 95% of the lowest final accuracy among the runs without a
    straggler (so that every method reaches it)."""
    normal = select(timed, case="normal")
    return 0.95 * min(r["final_accuracy"] for r in normal) if normal else None


def _by_repeat(timed, case, name, value):
    return {r.get("repeat", 0): value(r) for r in select(timed, case=case, algorithm=name)}


def timing_checks(f, timed):
    """Rows of the timed runs (time per step, time to accuracy, throughput kept with a
    straggler) and their sub-claims (:class:`Decision`, paired over repeats)."""
    if not timed:
        return []
    target, out = target_accuracy(timed), []
    ms = lambda r: r["time_per_step_s"] * 1e3  # noqa: E731
    ar, s = _by_repeat(timed, "normal", "allreduce", ms), _by_repeat(timed, "normal", "sgp", ms)
    if ar and s:
        f.row("timed", f"ms/step AllReduce {Stat(ar.values())}", f"SGP {Stat(s.values())}", "")
        out.append(less("timed: SGP faster per step than AllReduce", s, ar))
        never = 1e9  # a run that never reaches the target counts as very late
        tta = lambda r: time_to_accuracy(r["curve"], target) or never  # noqa: E731
        t_ar, t_s = _by_repeat(timed, "normal", "allreduce", tta), _by_repeat(timed, "normal", "sgp", tta)
        f.row(f"time to {target:.3f} accuracy (s)", f"AllReduce {_secs(t_ar)}", f"SGP {_secs(t_s)}", "")
        out.append(less("timed: SGP sooner to the target accuracy", t_s, t_ar))
    for case, what in (("straggler", "rank 1 permanently 2x slow"), ("delays", "transient random delays")):
        keep = {}
        for name in sorted({r["algorithm"] for r in select(timed, case=case)}):
            a, b = _by_repeat(timed, "normal", name, throughput), _by_repeat(timed, case, name, throughput)
            keep[name] = {k: b[k] / a[k] for k in set(a) & set(b)}
        if not any(keep.values()):
            continue
        f.row(f"{what}: throughput kept",
              ", ".join(f"{k} {statistics.fmean(v.values()):.2f}" for k, v in keep.items() if v), "", "")
        if "osgp" not in keep:
            continue
        control = keep.get("sgp", {})
        sound = less(f"timed, {what}: synchronous SGP (the control) keeps less than {CONTROL_KEEP}",
                     control, {k: CONTROL_KEEP for k in control})
        f.notes.append(str(sound))
        claim = Decision(f"timed, {what}: OSGP keeps at least {STRAGGLER_KEEP}",
                         [STRAGGLER_KEEP - v for v in keep["osgp"].values()])
        if sound.outcome != HOLDS:
            f.notes.append(f"{what}: the negative control does not show the slowdown's cost, so this measurement "
                           "cannot tell a tolerant method from an intolerant one: not decided")
            claim = Decision(claim.what + " (the control failed)", [])
        out.append(claim)
    return out


def throughput(record):
    """Steps per second summed over ranks, each rank at its own pace (the network benchmark's
    P4 measure); runs recorded before it existed: ranks / the slowest rank's time per step."""
    if record.get("throughput_steps_s"):
        return record["throughput_steps_s"]
    return record["world_size"] / record["time_per_step_s"]


def _secs(t):
    values = [v for v in t.values() if v < 1e9]
    if not values:
        return "never"
    return str(Stat(values)) + ("" if len(values) == len(t) else f" ({len(t) - len(values)} never)")


def judge(records, timed, sim_records, *, timed_on_cluster, sim_speeds=None, speed_setting=""):
    """Every finding, in order (``sim_speeds``: the time model's, for (d-sim)'s times)."""
    sizes = _sizes(records)
    lrs = sorted({r["lr"] for r in records})
    head = 8 if 8 in sizes else sizes[len(sizes) // 2]
    out = [speed(records, max(lrs), "a", "with large step sizes the asynchronous methods (EASGD, gossip) "
                 "converge faster than AllReduce"),
           speed(records, min(lrs), "b", "with small step sizes AllReduce converges faster and more "
                 "accurately"),
           same_minimum(records, head)]
    if len(sizes) > 1:   # the two largest: 8 and 16 in the full run, 2 and 4 in the quick one
        out.append(easgd_scaling(records, sizes[-2], sizes[-1]))
    if sim_records:
        out.append(easgd_scaling_sim(sim_records, sim_speeds, speed_setting))
    out.append(sgp(records, timed, timed_on_cluster))
    return out
