"""Predictions of the time model past this machine: steps per second of each method as the
number of ranks and the link rate grow, with and without a straggler.

The calibrated :class:`~.timing.Costs` are kept except what describes the cluster predicted:
its link rate (the calibrated payload fraction of the nominal rate), one core pool per node
with a core per rank, and no CPU per byte on the wire unless asked (the emulated cluster's
TCP runs on two cores shared by every node; a real node's NIC and cores are its own).
"""

import dataclasses

import numpy as np

from .timing import Workload, simulate

__all__ = ["cluster_costs", "delay_deciles", "predict", "markdown"]

#: Methods predicted by default.
DEFAULT_METHODS = ("allreduce", "sgp", "osgp:2", "agp", "gossip-pull", "adpsgd", "easgd")


def cluster_costs(costs, rate_gbit, *, per_node, wire_cpu=0.0, gets_shared=False, nominal_gbit=1.0):
    """``costs`` for a cluster whose links run at ``rate_gbit`` (the calibration ran at
    ``nominal_gbit``: its measured payload fraction is kept) with a core per rank, no CPU per
    byte on the wire and one-sided gets at their links' rate (``wire_cpu``, ``gets_shared``:
    the TCP transport's instead, as measured here)."""
    fraction = costs.link_rate / (nominal_gbit * 1e9 / 8)
    return dataclasses.replace(costs, link_rate=rate_gbit * 1e9 / 8 * fraction, cores=per_node,
                               cores_shared=False, wire_cpu=wire_cpu, gets_shared=gets_shared)


def delay_deciles(delays):
    """The 5th, 15th, ..., 95th percentiles of AGP's message delays (steps; values that occur),
    ten numbers that stand for the distribution; ``[]`` where no share was combined. A share a
    slower rank took in at a step number below the sender's (a straggler's steps lag) counts
    as taken at once (0)."""
    if not len(delays):
        return []
    d = np.sort(np.maximum(np.asarray(delays, dtype=np.int64), 0))
    n = len(d)   # the smallest value with at least (2k + 1) / 20 of them at or below it, in integers
    return [int(d[-(-(2 * k + 1) * n // 20) - 1]) for k in range(10)]


def predict(costs, *, ranks, rates_gbit, per_node, mb, compute, methods=DEFAULT_METHODS, steps=10,
            stragglers=(1.0, 2.0), nominal_gbit=1.0, progress=None):
    """One row per (ranks, rate, straggler factor, method): ``steps_per_s`` per rank (the mean
    over ranks of each one's own rate) and ``vs_allreduce`` where AllReduce is among them, at
    each method's steady state (:func:`~.timing.simulate` with ``until_steady``; ``steps`` is
    the least number of timed steps). Each row also has ``models_moved_per_step`` (delivered),
    ``internode_models_per_step``, ``steps`` (simulated), ``steady``, and AGP's ``held`` and
    ``delays`` (:func:`delay_deciles` of its message delays)."""
    rows = []
    for p in ranks:
        if p % per_node:
            raise ValueError(f"{p} ranks are not a whole number of nodes of {per_node}")
        for rate in rates_gbit:
            c = cluster_costs(costs, rate, per_node=per_node, nominal_gbit=nominal_gbit)
            for factor in stragglers:
                straggler = {1: factor} if factor != 1.0 else {}
                got = {}
                for m in methods:
                    if progress:
                        progress(f"p = {p}, {rate:g} Gbit, straggler x{factor:g}: {m}")
                    work = Workload(mb=mb, compute=compute, straggler=straggler, steps=steps)
                    res = simulate(m, p // per_node, per_node, work, c, until_steady=True)
                    got[m] = (res["steps_per_s"] / p, res)
                for m, (v, res) in got.items():
                    row = {"ranks": p, "per_node": per_node, "rate_gbit": rate, "straggler": factor, "method": m,
                           "mb": mb, "compute_s": compute, "steps_per_s": v,
                           "models_moved_per_step": res["models_moved_per_step"],
                           "internode_models_per_step": res["internode_models_per_step"], "steps": res["steps"],
                           "steady": res["steady"], "held": res["held"]}
                    if "message_delays" in res:
                        row["delays"] = delay_deciles(res["message_delays"])
                    if "allreduce" in got:
                        row["vs_allreduce"] = v / got["allreduce"][0]
                    rows.append(row)
    return rows


def markdown(rows):
    """A table per straggler setting: ranks and rate down, methods across (steps/s per rank),
    and the method with the most steps per second."""
    out = []
    methods = list(dict.fromkeys(r["method"] for r in rows))
    for factor in sorted({r["straggler"] for r in rows}):
        title = "no straggler" if factor == 1.0 else f"rank 1 {factor:g}x slow"
        out += [f"**{title}** (steps/s per rank, and in brackets the models each rank's messages moved per "
                "step; fastest in bold)", "",
                "| ranks | Gbit/s | " + " | ".join(methods) + " |",
                "|---|---|" + "---|" * len(methods)]
        cells = {}
        for r in rows:
            if r["straggler"] == factor:
                cells.setdefault((r["ranks"], r["rate_gbit"]), {})[r["method"]] = (r["steps_per_s"],
                                                                                r["models_moved_per_step"])
        for (p, rate), got in cells.items():
            best = max(got, key=lambda m: got[m][0])
            text = [(f"**{got[m][0]:.2f}**" if m == best else f"{got[m][0]:.2f}") + f" ({got[m][1]:.2f})"
                    for m in methods]
            out.append(f"| {p} | {rate:g} | " + " | ".join(text) + " |")
        out.append("")
    out.append("Steps per second are not time to accuracy: a method that moves fewer models per step mixes "
               "less, and its steps count for less (`timemodel accuracy` joins the accuracy simulator's steps).")
    return "\n".join(out)
