"""The time model against measurements: predicted and measured rows side by side.

:func:`p4_table` reads the P4 benchmark's result files (``benchmarks/bench_network.py --parts
p4``: throughput of every method with and without a rank twice as slow), simulates each row
with the calibrated :class:`~.timing.Costs` (nothing refitted), and returns rows with both
figures and the relative error; :func:`reproduction_table` does the same for a reproduction's
timed runs (training on the emulated cluster) and :func:`outer_table` for ``bench_outer``'s
runs at two link rates; :func:`markdown` writes them as a table.
"""

import dataclasses
import json
import math
import re
import statistics

from .timing import Workload, simulate

__all__ = ["p4_rows", "row_costs", "p4_table", "reproduction_table", "outer_table", "markdown", "TOLERANCE"]

#: The relative error a prediction must stay within.
TOLERANCE = 0.15


def p4_rows(paths):
    """The P4 rows of the result files at ``paths`` (each ``{"meta", "rows"}``), with their meta."""
    out = []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        for row in data["rows"]:
            if "steps_per_s_straggler" in row:
                out.append((row, data.get("meta", {}), path))
    return out


def _nodes(row):
    ranks, nodes = int(row["ranks"]), int(row.get("nodes") or row["ranks"])
    if ranks % nodes:
        raise ValueError(f"{ranks} ranks on {nodes} nodes: not the same on every node")
    return nodes, ranks // nodes


def row_costs(row, costs, *, nominal_gbit=1.0):
    """The costs a P4 row is predicted with, and its regime's name: the calibration's, its link
    scaled to the row's ``rate_gbit`` (where the row has one; the calibration ran at
    ``nominal_gbit``); where every rank of the row had a core of its own (``ranks`` <= the
    machine's ``cores``), the regime the predictions past this machine assume
    (:func:`.scaling.cluster_costs`: a core pool per node, a core per rank, no CPU per byte on the
    wire; the rows' one-sided gets as the calibration's transport has them), else the
    calibration's shared cores."""
    from .scaling import cluster_costs
    rate = float(row.get("rate_gbit", nominal_gbit))
    nodes, per_node = _nodes(row)
    if "cores" in row and int(row["ranks"]) <= int(row["cores"]):
        return (cluster_costs(costs, rate, per_node=per_node, gets_shared=costs.gets_shared, nominal_gbit=nominal_gbit),
                "core per rank")
    return _at_rate(costs, rate, nominal_gbit), "shared cores" if costs.cores_shared else "calibrated cores"


def _at_rate(costs, gbit, nominal_gbit):
    """``costs`` with the calibration's link (measured at ``nominal_gbit``) scaled to ``gbit``."""
    return dataclasses.replace(costs, link_rate=costs.link_rate * gbit / nominal_gbit)


def p4_table(paths, costs, *, seed=0, nominal_gbit=1.0):
    """Predicted vs measured for every P4 row: a list of dicts (one per row and case), each
    predicted with :func:`row_costs`."""
    table = []
    for row, meta, path in p4_rows(paths):
        nodes, per_node = _nodes(row)
        at, regime = row_costs(row, costs, nominal_gbit=nominal_gbit)
        for case, key, straggler in (("no straggler", "steps_per_s", {}),
                                     ("rank 1 2x slow", "steps_per_s_straggler", {1: 2.0})):
            work = Workload(mb=row["mb"], compute=row["compute_ms"] / 1e3, straggler=straggler,
                            steps=int(row.get("steps", 30)))
            out = simulate(row["algorithm"], nodes, per_node, work, at, seed=seed)
            predicted, measured = out["steps_per_s"], row[key]
            runs = [r[0 if key == "steps_per_s" else 1] for r in row.get("runs", [])]
            each = row.get("rank_" + key)   # every repeat's rate of each rank, where the row has them
            table.append({"ranks": row["ranks"], "nodes": nodes, "mb": row["mb"], "algorithm": row["algorithm"],
                          "case": case, "rate_gbit": float(row.get("rate_gbit", nominal_gbit)), "regime": regime,
                          "measured": measured, "measured_range": [min(runs), max(runs)] if runs else None,
                          "predicted": predicted, "error": predicted / measured - 1,
                          "predicted_by_rank": [1.0 / s if s > 0 else math.inf for s in out["step_s"]],
                          "measured_by_rank": [statistics.median(r) for r in zip(*each)] if each else None,
                          "source": f"{path} ({meta.get('commit', '?')})"})
    return table


#: The reproduction's timed cases the time model can state, as its straggler (rank 1 2x slow).
REPRODUCTION_CASES = {"normal": ("no straggler", {}), "straggler": ("rank 1 2x slow", {1: 2.0})}


def _method(algorithm):
    """The time model's name of a timed run's algorithm (OSGP at the package's default delay of
    one step: ``osgp:1``), or ``None`` where the model has none (gossip-push)."""
    from .methods import METHODS
    if algorithm == "osgp":
        return "osgp:1"
    return algorithm if algorithm in METHODS else None


def reproduction_table(path, costs, *, mb, compute, nodes, per_node, seed=0):
    """Predicted vs measured for the timed runs of a reproduction's ``results.json`` (their
    throughput: the sum over ranks of each rank's steps per second, as P4's), per case the
    model states (:data:`REPRODUCTION_CASES`) and algorithm it has. ``mb``, ``compute`` (s),
    ``nodes`` and ``per_node``: the runs' model size, fixed compute and placement."""
    with open(path) as f:
        runs = json.load(f)["timed_runs"]
    groups = {}
    for r in runs:
        if r.get("case") in REPRODUCTION_CASES and _method(r["algorithm"]):
            groups.setdefault((r["case"], r["algorithm"]), []).append(r["throughput_steps_s"])
    table = []
    for (case, algorithm), measured in sorted(groups.items()):
        label, straggler = REPRODUCTION_CASES[case]
        work = Workload(mb=mb, compute=compute, straggler=straggler, steps=30)
        predicted = simulate(_method(algorithm), nodes, per_node, work, costs, seed=seed)["steps_per_s"]
        mean = sum(measured) / len(measured)
        table.append({"ranks": nodes * per_node, "nodes": nodes, "mb": mb, "algorithm": algorithm, "case": label,
                      "measured": mean, "measured_range": [min(measured), max(measured)], "predicted": predicted,
                      "error": predicted / mean - 1, "source": f"{path} (timed runs)"})
    return table


#: bench_outer's rows the time model states (no wire format; not the outer step over gossip),
#: by their flags: the model's method.
OUTER_ROWS = {("allreduce", ""): "allreduce", ("sgp", ""): "sgp", ("localsgd", ""): "localsgd",
              ("diloco", "--momentum 0"): "localsgd", ("slowmo", "--base sgp --inner-mixing"): "slowmo"}


def outer_table(path, costs, *, mb, nominal_gbit=1.0, seed=0):
    """Predicted vs measured for ``benchmarks/bench_outer.py``'s runs (its ``outer.json``: one
    rank per emulated node, each link rate; their throughput as P4's), for the rows
    :data:`OUTER_ROWS` states, at each run's link rate (the calibration's link scaled from
    ``nominal_gbit``, everything else as calibrated). ``mb``: the runs' model in MB."""
    with open(path) as f:
        data = json.load(f)
    meta = data["meta"]
    groups = {}
    for r in data["runs"]:
        flags = " ".join(r["flags"]) if isinstance(r["flags"], list) else str(r["flags"])
        method = OUTER_ROWS.get((r["algorithm"], flags))
        if method:
            method += f":{meta['inner_steps']}" if method in ("localsgd", "slowmo") else ""
            groups.setdefault((r["rate"], r["row"], method), []).append(r["throughput_steps_s"])
    table = []
    for (rate, row, method), measured in sorted(groups.items()):
        gbit = _gbit(rate)
        at_rate = _at_rate(costs, gbit, nominal_gbit)
        work = Workload(mb=mb, compute=meta["compute_ms"] / 1e3, steps=3 * int(meta["inner_steps"]))
        predicted = simulate(method, int(meta["ranks"]), 1, work, at_rate, seed=seed)["steps_per_s"]
        mean = sum(measured) / len(measured)
        table.append({"ranks": meta["ranks"], "nodes": meta["ranks"], "mb": mb, "algorithm": row,
                      "case": "no straggler", "rate_gbit": gbit, "measured": mean,
                      "measured_range": [min(measured), max(measured)], "predicted": predicted, "error": predicted / mean - 1,
                      "source": f"{path} ({meta.get('commit', '?')})"})
    return table


def _gbit(rate):
    """``"100mbit"`` -> 0.1."""
    m = re.fullmatch(r"([0-9.]+)([kmg]?)bit", rate)
    if not m:
        raise ValueError(f"a link rate such as 100mbit or 1gbit, got {rate!r}")
    return float(m.group(1)) * {"": 1e-9, "k": 1e-6, "m": 1e-3, "g": 1.0}[m.group(2)]


def markdown(table, tolerance=TOLERANCE):
    """The table as markdown, and a last line counting the rows within ``tolerance``."""
    lines = ["| ranks (nodes) | Gbit/s | MB | algorithm | case | measured steps/s (range) | predicted | error |",
             "|---|---|---|---|---|---|---|---|"]
    for t in table:
        rng = t["measured_range"]
        span = f" ({rng[0]:.2f}-{rng[1]:.2f})" if rng else ""
        mark = "" if abs(t["error"]) <= tolerance else " **miss**"
        case = t["case"] + (f", {t['regime']}" if t.get("regime") == "core per rank" else "")
        lines.append(f"| {t['ranks']} ({t.get('nodes', '?')}) | {t.get('rate_gbit', 1.0):g} | {t['mb']:g} | "
                     f"{t['algorithm']} | {case} | {t['measured']:.2f}{span} | {t['predicted']:.2f} | "
                     f"{t['error']:+.0%}{mark} |")
    within = sum(abs(t["error"]) <= tolerance for t in table)
    lines.append("")
    lines.append(f"{within} of {len(table)} rows within {tolerance:.0%}.")
    return "\n".join(lines)
