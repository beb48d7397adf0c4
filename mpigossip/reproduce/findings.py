"""The findings (a)-(e) of Jin et al. 2016 and Assran et al. 2019, each judged from the runs
by a rule stated next to it. Nothing here is measured or hard-coded: every verdict is a
function of the run records of :mod:`.experiments` and :mod:`.simulate`.

Figures are means over seeds with their standard deviation (the spread). A difference
smaller than the spread is reported as such ("within the spread"), and a finding whose
every comparison holds only within the spread is at most "partly" reproduced.
"""

import statistics

REPRODUCED, PARTLY, NOT, UNTESTED = "reproduced", "partly", "not reproduced", "not tested"

#: (c): the methods reach "about the same minimum" when their best final test losses lie
#: within this fraction of the lowest one.
SAME_MINIMUM = 0.15
#: (e): "within about 1 point" of AllReduce's test accuracy.
ACCURACY_POINTS = 0.01
#: (e): OSGP "tolerates slow nodes" when it keeps this fraction of its throughput with one
#: rank 2x slow (issue #11's target) and more than AllReduce keeps.
STRAGGLER_KEEP = 0.85
#: ... judged only when the straggler costs AllReduce at least a quarter of its throughput
#: (else the steps are dominated by communication and the case tests nothing).
STRAGGLER_MEANINGFUL = 0.75


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


def stat(records, figure, **match):
    """:class:`Stat` of ``figure`` (a summary key, or ``"auc"``) over the matching runs, or None."""
    rs = select(records, **match)
    if not rs:
        return None
    return Stat(auc(r["curve"]) if figure == "auc" else r[figure] for r in rs)


def sim_final(sim_records, key="loss", **match):
    """:class:`Stat` of the last value of ``key`` (``"loss"``, ``"accuracy"``) over the matching
    simulator runs (``scheme=``, ``p=``, ``lr=``)."""
    return Stat(r[key][-1] for r in select(sim_records, **match))


def beats(a, b):
    """``(a lower than b, clearly: by more than the larger spread)`` for two :class:`Stat`."""
    return a.mean < b.mean, b.mean - a.mean > max(a.std, b.std)


def _verdict(checks):
    """From a list of (holds, clearly): all hold clearly -> reproduced; none hold -> not;
    else partly."""
    if not checks:
        return UNTESTED
    if all(h and c for h, c in checks):
        return REPRODUCED
    if not any(h for h, _ in checks):
        return NOT
    return PARTLY


class Finding:
    """One finding: its claim, the setting, the figures, the rule and the computed verdict."""

    def __init__(self, key, claim, setting, rule, header=()):
        self.key, self.claim, self.setting, self.rule = key, claim, setting, rule
        self.header = list(header)
        self.rows, self.notes, self.verdict = [], [], UNTESTED

    def row(self, *cells):
        self.rows.append([str(c) for c in cells])


def _gossip(records, figure, **match):
    """The better of gossip-pull and gossip-push for ``figure`` (lower mean), as (name, Stat)."""
    found = [(g, stat(records, figure, algorithm=g, **match)) for g in ("gossip-pull", "gossip-push")]
    found = [(g, s) for g, s in found if s is not None]
    return min(found, key=lambda gs: gs[1].mean) if found else (None, None)


def speed(records, p, lr, key, claim):
    """(a) and (b): which methods converge faster (area under the test-loss curve) at one
    step size, and (b) also: more accurately (final test loss)."""
    small = key == "b"
    f = Finding(key, claim, f"p = {p}, lr = {lr:g}, {_seeds(records, p)}",
                "faster = lower mean test loss over the run's evaluations (area under the loss curve); "
                + ("AllReduce must beat EASGD and the better gossip variant in speed and in final test loss"
                   if small else "EASGD and the better gossip variant must each beat AllReduce")
                + "; 'clearly' = by more than the spread over seeds. All comparisons clearly: reproduced; "
                "none: not reproduced; else partly.",
                header=("method", "mean test loss (speed)", "final test loss", "comparison"))
    ar = stat(records, "auc", algorithm="allreduce", world_size=p, lr=lr)
    if ar is None:
        f.notes.append("no AllReduce run in this setting")
        return f
    ar_final = stat(records, "final_loss", algorithm="allreduce", world_size=p, lr=lr)
    f.row("allreduce", ar, ar_final, "")
    checks = []
    for name, s in (("easgd", stat(records, "auc", algorithm="easgd", world_size=p, lr=lr)),
                    _gossip(records, "auc", world_size=p, lr=lr)):
        if s is None:
            continue
        final = stat(records, "final_loss", algorithm=name, world_size=p, lr=lr)
        if small:
            fast, acc = beats(ar, s), beats(ar_final, final)
            checks += [fast, acc]
            f.row(name, s, final, _words(fast, "AllReduce faster") + "; " + _words(acc, "AllReduce more accurate"))
        else:
            fast = beats(s, ar)
            checks.append(fast)
            f.row(name, s, final, _words(fast, f"{name} faster than AllReduce"))
    f.verdict = _verdict(checks)
    return f


def _words(check, what):
    holds, clearly = check
    return (what + (" (clearly)" if clearly else " (within the spread)")) if holds else "not " + what


def _seeds(records, p):
    n = len({r["seed"] for r in select(records, world_size=p)})
    return f"{n} seed{'s' if n != 1 else ''}"


def minima(records, p):
    """Each algorithm's best (over step sizes) mean final test loss at ``p``: {name: Stat}."""
    out = {}
    for name in sorted({r["algorithm"] for r in select(records, world_size=p)}):
        stats = [stat(records, "final_loss", algorithm=name, world_size=p, lr=lr)
                 for lr in sorted({r["lr"] for r in select(records, world_size=p, algorithm=name)})]
        out[name] = min(stats, key=lambda s: s.mean)
    return out


def same_minimum(records, p):
    """(c): at p = 8 the methods of Jin et al. reach about the same minimum, EASGD the best."""
    f = Finding("c", "at p = 8 all methods reach about the same minimum, EASGD the best",
                f"p = {p}, best step size per method, {_seeds(records, p)}",
                f"'about the same' = every method's best final test loss within {SAME_MINIMUM:.0%} of the "
                "lowest; 'EASGD best' = EASGD's is the lowest (clearly: by more than the spread). Both: "
                "reproduced; one: partly; neither: not reproduced.",
                header=("method", "best final test loss", "distance"))
    m = {k: v for k, v in minima(records, p).items() if k in ("allreduce", "easgd", "gossip-pull", "gossip-push")}
    if "easgd" not in m or len(m) < 2:
        f.notes.append("needs EASGD and another method at this p")
        return f
    low = min(s.mean for s in m.values())
    for name, s in sorted(m.items(), key=lambda kv: kv[1].mean):
        f.row(name, s, f"{(s.mean - low) / low:+.1%} from the lowest")
    same = all(s.mean <= low * (1 + SAME_MINIMUM) for s in m.values())
    others = [s for k, s in m.items() if k != "easgd"]
    best = beats(m["easgd"], min(others, key=lambda s: s.mean))
    f.notes.append(f"same minimum: {'yes' if same else 'no'}; EASGD best: {_words(best, 'EASGD lowest')}")
    f.verdict = _verdict([(same, same), best])
    return f


def easgd_scaling(records, p_small, p_large, lr):
    """(d) on real ranks: from p_small to p_large EASGD degrades (its final loss relative to
    AllReduce's grows), and gossip ends below EASGD at p_large."""
    f = Finding("d", "at p = 16 EASGD degrades (especially with small step sizes); gossip does somewhat better",
                f"p = {p_small} vs {p_large}, lr = {lr:g}",
                "degrades = EASGD's final test loss divided by AllReduce's grows from the smaller to the larger p; "
                "gossip better = the better gossip variant's final test loss below EASGD's at the larger p "
                "(clearly: by more than the spread). Both: reproduced; one: partly; neither: not reproduced.",
                header=("world size", "EASGD final test loss", "AllReduce", "better gossip", "ratio"))
    ratios = {}
    for p in (p_small, p_large):
        e = stat(records, "final_loss", algorithm="easgd", world_size=p, lr=lr)
        a = stat(records, "final_loss", algorithm="allreduce", world_size=p, lr=lr)
        if e is None or a is None:
            f.notes.append(f"needs EASGD and AllReduce at p = {p}, lr = {lr:g}")
            return f
        ratios[p] = e.mean / a.mean
        g_name, g = _gossip(records, "final_loss", world_size=p, lr=lr)
        f.row(f"p = {p}", f"EASGD {e}", f"AllReduce {a}", f"{g_name} {g}" if g else "no gossip run",
              f"EASGD / AllReduce {ratios[p]:.3f}")
    degrades = ratios[p_large] > ratios[p_small]
    checks = [(degrades, degrades)]
    g_name, g = _gossip(records, "final_loss", world_size=p_large, lr=lr)
    if g is not None:
        checks.append(beats(g, stat(records, "final_loss", algorithm="easgd", world_size=p_large, lr=lr)))
        f.notes.append(_words(checks[-1], f"{g_name} below EASGD at p = {p_large}"))
    f.notes.insert(0, f"EASGD / AllReduce {ratios[p_small]:.3f} -> {ratios[p_large]:.3f}: "
                   + ("degrades" if degrades else "does not degrade"))
    f.verdict = _verdict(checks)
    return f


def easgd_scaling_sim(sim_records):
    """(d) beyond 16, in the simulator: EASGD's final loss over the better gossip's grows
    with p and ends above 1, at every step size."""
    f = Finding("d-sim", "beyond p = 16 (simulator): EASGD degrades as p grows, gossip does better",
                "softmax regression, " + _sim_setting(sim_records),
                "per step size: r(p) = EASGD's final training loss / the better gossip's; EASGD degrades if "
                "r at the largest p exceeds r at the smallest p and exceeds 1. At every step size: reproduced; "
                "at some: partly; at none: not reproduced.",
                header=("step size", "r(p)", "EASGD"))
    checks = []
    for lr in sorted({r["lr"] for r in sim_records}):
        sizes = sorted({r["p"] for r in sim_records if r["lr"] == lr})
        r = {}
        for p in sizes:
            e = sim_final(sim_records, scheme="easgd", p=p, lr=lr)
            g = min((sim_final(sim_records, scheme=s, p=p, lr=lr) for s in ("gossip-push", "gossip-pull")),
                    key=lambda s: s.mean)
            r[p] = e.mean / g.mean
        holds = r[sizes[-1]] > r[sizes[0]] and r[sizes[-1]] > 1
        checks.append((holds, holds))
        f.row(f"lr = {lr:g}", ", ".join(f"p={p}: {v:.4f}" for p, v in r.items()),
              "degrades" if holds else "does not degrade")
    f.verdict = _verdict(checks)
    return f


def _sim_setting(sim_records):
    sizes = sorted({r["p"] for r in sim_records})
    seeds = len({r["seed"] for r in sim_records})
    return f"p = {', '.join(map(str, sizes))}, {seeds} seed{'s' if seeds != 1 else ''}"


def sgp(records, timed, timed_on_cluster):
    """(e): SGP's accuracy within about 1 point of AllReduce's and its consensus, at every p;
    on the timed runs: faster per step, sooner to the target accuracy, and OSGP tolerating a
    straggler."""
    f = Finding("e", "SGP reaches consensus and an accuracy within about 1 point of AllReduce while faster per "
                "step when communication is the bottleneck; overlap SGP tolerates slow nodes",
                "accuracy: every p, best step size per method; timing: the timed runs",
                f"accuracy: SGP's best mean final test accuracy at most {ACCURACY_POINTS * 100:g} point below "
                "AllReduce's at each p; consensus: SGP's final consensus distance at most gossip-push's (same "
                "number of messages) at each p and step size; timing (only on a cluster, where communication "
                "counts): SGP's time per step and time to the target accuracy below AllReduce's, OSGP keeps "
                f">= {STRAGGLER_KEEP} of its throughput with one rank 2x slow and more than AllReduce keeps (judged only if "
                f"AllReduce keeps <= {STRAGGLER_MEANINGFUL}). "
                "All hold: reproduced; none: not reproduced; else partly.",
                header=("setting", "AllReduce / first", "SGP / second", "comparison"))
    checks = []
    for p in sorted({r["world_size"] for r in records}):
        best = {}
        for name in ("allreduce", "sgp"):
            lrs = sorted({r["lr"] for r in select(records, world_size=p, algorithm=name)})
            stats = [stat(records, "final_accuracy", algorithm=name, world_size=p, lr=lr) for lr in lrs]
            if stats:
                best[name] = max(stats, key=lambda s: s.mean)
        if len(best) == 2:
            gap = best["allreduce"].mean - best["sgp"].mean
            ok = gap <= ACCURACY_POINTS
            checks.append((ok, ok))
            f.row(f"p = {p}", f"accuracy AllReduce {best['allreduce']}", f"SGP {best['sgp']}",
                  (f"SGP ahead by {-gap * 100:.2f} points" if gap < 0 else
                   f"SGP behind by {gap * 100:.2f} points: " + ("within" if ok else "beyond") + " 1 point"))
        for lr in sorted({r["lr"] for r in select(records, world_size=p, algorithm="sgp")}):
            s = stat(records, "consensus_distance", algorithm="sgp", world_size=p, lr=lr)
            g = stat(records, "consensus_distance", algorithm="gossip-push", world_size=p, lr=lr)
            if g is not None:
                ok = s.mean <= g.mean
                checks.append((ok, ok))
                f.row(f"p = {p}, lr = {lr:g}", f"consensus distance SGP {s}", f"gossip-push {g}",
                      "SGP tighter" if ok else "SGP looser")
    timing = timing_checks(f, timed)
    if timed_on_cluster:
        checks += timing
    elif timing:
        f.notes.append("the timed runs ran on one machine, where communication is nearly free: their timing "
                       "checks are shown but not judged (run with --timed-mpiexec on a cluster)")
    f.verdict = _verdict(checks)
    return f


def time_to_accuracy(curve, target):
    """Wall time until the consensus model first reaches ``target`` test accuracy, or None."""
    for p in curve:
        if p["accuracy"] >= target:
            return p["time_s"]
    return None


def target_accuracy(timed):
    """The timed runs' target: 95% of the lowest final accuracy among the runs without a
    straggler (so that every method reaches it)."""
    normal = select(timed, case="normal")
    return 0.95 * min(r["final_accuracy"] for r in normal) if normal else None


def timing_checks(f, timed):
    """Rows and checks of the timed runs (time per step, time to accuracy, straggler)."""
    if not timed:
        return []
    target, checks = target_accuracy(timed), []
    by = {(r["case"], r["algorithm"]): r for r in timed}
    ar, s = by.get(("normal", "allreduce")), by.get(("normal", "sgp"))
    if ar and s:
        faster = s["time_per_step_s"] < ar["time_per_step_s"]
        t_ar, t_s = time_to_accuracy(ar["curve"], target), time_to_accuracy(s["curve"], target)
        sooner = t_s is not None and (t_ar is None or t_s < t_ar)
        checks += [(faster, faster), (sooner, sooner)]
        f.row("timed", f"ms/step AllReduce {ar['time_per_step_s'] * 1e3:.1f}",
              f"SGP {s['time_per_step_s'] * 1e3:.1f}", f"SGP/AllReduce {s['time_per_step_s'] / ar['time_per_step_s']:.2f}")
        f.row(f"time to {target:.3f} accuracy", f"AllReduce {_secs(t_ar)}", f"SGP {_secs(t_s)}",
              "SGP sooner" if sooner else "SGP not sooner")
    keep = {}
    for name in ("allreduce", "sgp", "osgp"):
        a, b = by.get(("normal", name)), by.get(("straggler", name))
        if a and b:
            keep[name] = a["time_per_step_s"] / b["time_per_step_s"]
    if "osgp" in keep and "allreduce" in keep:
        kept = ", ".join(f"{k} keeps {v:.2f}" for k, v in keep.items())
        if keep["allreduce"] > STRAGGLER_MEANINGFUL:
            f.row("straggler (rank 1 2x slow)", kept, "", "not judged: it hardly slowed AllReduce")
            f.notes.append(f"the straggler cost AllReduce less than {1 - STRAGGLER_MEANINGFUL:.0%} of its throughput "
                           "(communication dominates these steps), so it tests no tolerance: not judged")
        else:
            ok = keep["osgp"] >= STRAGGLER_KEEP and keep["osgp"] > keep["allreduce"]
            checks.append((ok, ok))
            f.row("straggler (rank 1 2x slow)", kept, "", "OSGP tolerates it" if ok else "OSGP does not tolerate it")
    return checks


def _secs(t):
    return "never" if t is None else f"{t:.1f} s"


def judge(records, timed, sim_records, *, timed_on_cluster):
    """Every finding, in order."""
    sizes = sorted({r["world_size"] for r in records})
    lrs = sorted({r["lr"] for r in records})
    head = 8 if 8 in sizes else sizes[len(sizes) // 2]
    out = [speed(records, head, max(lrs), "a", "with large step sizes the asynchronous methods (EASGD, gossip) "
                 "converge faster than AllReduce"),
           speed(records, head, min(lrs), "b", "with small step sizes AllReduce converges faster and more "
                 "accurately"),
           same_minimum(records, head)]
    if 16 in sizes and head != 16:
        out.append(easgd_scaling(records, head, 16, min(lrs)))
    if sim_records:
        out.append(easgd_scaling_sim(sim_records))
    out.append(sgp(records, timed, timed_on_cluster))
    return out
