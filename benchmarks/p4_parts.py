"""The P4 step part by part, measured beside the time model's (#43, item 4): where a method's
measured pace and the model's part.

    python benchmarks/p4_parts.py P4.json [--costs CALIBRATION] [--out BASE]

``P4.json``: rows of ``bench_network.py --parts p4`` (its ``rank_parts``, from
``benchmarks/_p4_probe.py``; a ``heldout.sh`` file or a bare list of rows). Each row is simulated
at its own shape and link rate as ``timemodel validate`` does (``validation.row_costs``), and
every rank's parts are tabled beside the model's: steps/s; CPU per step (the process's, the
whole machine's shared by the ranks, the model's charge: the rank's work and the network stack's
on both sides of its messages); gossip pull's reads per step, a read's time, the wait for its own
window's exclusive lock; AGP's messages sent and combined per step. Medians over the repeats.
Writes ``BASE.{md,json}`` (default: print the table).
"""

import argparse
import json
import statistics
import sys

from mpigossip.core import provenance
from mpigossip.sim import validation
from mpigossip.sim.timing import Costs, Workload, simulate

CASES = (("no straggler", "", {}), ("rank 1 2x slow", "_straggler", {1: 2.0}))


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def compare(rows, costs):
    """One dict per row, case and rank: measured and modelled parts."""
    out = []
    for row in rows:
        if "rank_parts" not in row:
            continue
        nodes, per_node = validation._nodes(row)
        at, regime = validation.row_costs(row, costs)
        for case, suffix, straggler in CASES:
            work = Workload(mb=row["mb"], compute=row["compute_ms"] / 1e3, straggler=straggler,
                            steps=int(row.get("steps", 30)))
            model = simulate(row["algorithm"], nodes, per_node, work, at)
            repeats = row["rank_parts" + suffix]
            rates = row["rank_steps_per_s" + suffix]
            for rank in range(row["ranks"]):
                mine = [rep[rank] for rep in repeats]

                def got(key, mine=mine):
                    return _median([p.get(key) for p in mine])
                parts = model["parts"][rank]
                reads, read_s = got("reads"), got("read_ms")
                steps = row.get("steps", 30)
                m_reads = parts.get("reads")
                out.append({
                    "algorithm": row["algorithm"], "mb": row["mb"], "ranks": row["ranks"], "nodes": nodes,
                    "rate_gbit": row.get("rate_gbit"), "regime": regime, "case": case, "rank": rank,
                    "steps_per_s": _median([r[rank] for r in rates]), "model_steps_per_s": 1.0 / model["step_s"][rank],
                    "cpu_ms": got("cpu_ms"),
                    "machine_cpu_ms_per_rank": (got("machine_cpu_ms") / row["ranks"]
                                                if got("machine_cpu_ms") is not None else None),
                    "model_cpu_ms": model["cpu_s"][rank] * 1e3,
                    "reads_per_step": reads / steps if reads is not None else None,
                    "model_reads_per_step": m_reads,
                    "read_ms_each": read_s * steps / reads if reads else None,
                    "model_read_ms_each": parts["read"] / m_reads * 1e3 if m_reads else None,
                    "publish_lock_ms": got("publish_lock_ms"),
                    "model_publish_lock_ms": parts["publish_lock"] * 1e3 if "publish_lock" in parts else None,
                    "sent_per_step": got("sent_per_step"), "model_sent_per_step": parts.get("sent"),
                    "combined_per_step": got("combined_per_step"), "model_combined_per_step": parts.get("combined"),
                })
    return out


def _f(v, digits=0):
    return "-" if v is None else f"{v:.{digits}f}"


def markdown(table, meta):
    lines = [f"The P4 step part by part, measured and modelled (`{meta['command']}` at {meta['commit']}; "
             f"{meta['versions']}; calibration `{meta['calibration']}`). Per rank, medians over the repeats; "
             "each pair is measured / model. CPU per step: the rank's process (every thread); the whole "
             "machine's busy time over the rank's steps divided by the ranks (the kernel's network stack "
             "included); the model's charge (the rank's work and the network stack's on both sides of its "
             "messages).", "",
             "| method | case | rank | steps/s | CPU ms: process / machine per rank / model | reads a step | "
             "a read, ms | own lock wait, ms a step | AGP sent a step | AGP combined a step |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        lines.append(
            f"| {r['algorithm']} | {r['case']} | {r['rank']} | {_f(r['steps_per_s'], 2)} / "
            f"{_f(r['model_steps_per_s'], 2)} | {_f(r['cpu_ms'])} / {_f(r['machine_cpu_ms_per_rank'])} / "
            f"{_f(r['model_cpu_ms'])} | {_f(r['reads_per_step'], 2)} / {_f(r['model_reads_per_step'], 2)} | "
            f"{_f(r['read_ms_each'])} / {_f(r['model_read_ms_each'])} | {_f(r['publish_lock_ms'])} / "
            f"{_f(r['model_publish_lock_ms'])} | {_f(r['sent_per_step'], 2)} / {_f(r['model_sent_per_step'], 2)} | "
            f"{_f(r['combined_per_step'], 2)} / {_f(r['model_combined_per_step'], 2)} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("p4", help="P4 rows with rank_parts (bench_network.py --parts p4)")
    parser.add_argument("--costs", default="benchmarks/results/time-calibration-1gbit.json")
    parser.add_argument("--out", help="write BASE.md and BASE.json")
    args = parser.parse_args()
    with open(args.p4) as f:
        data = json.load(f)
    rows = data["rows"] if isinstance(data, dict) else data
    table = compare(rows, Costs.load(args.costs))
    source = data.get("meta", {}) if isinstance(data, dict) else {}
    meta = {"commit": provenance.commit(), "versions": provenance.versions(), "calibration": args.costs,
            "command": "python benchmarks/p4_parts.py " + " ".join(sys.argv[1:]), "measured": source}
    text = markdown(table, meta)
    if args.out:
        with open(args.out + ".md", "w") as f:
            f.write(text)
        with open(args.out + ".json", "w") as f:
            json.dump({"meta": meta, "rows": table}, f, indent=2)
    print(text)


if __name__ == "__main__":
    main()
