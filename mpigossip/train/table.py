"""Tables of finished runs: ``python -m mpigossip table DIR...`` (no MPI, no torch) and the
one ``compare`` prints."""

import json
import os

from ..core.registry import ALGORITHMS

COLUMNS = [("algorithm", "algorithm", "{}"), ("lr", "lr", "{:g}"), ("final_accuracy", "test accuracy", "{:.4f}"),
           ("final_loss", "test loss", "{:.4f}"), ("time_per_step_s", "ms/step", "{:.2f}"),
           ("comm_time_s", "comm s", "{:.2f}"), ("consensus_distance", "consensus dist.", "{:.2e}")]


def run_dir(out, algorithm, lr):
    """Where ``compare --out OUT`` writes the run of ``algorithm`` at ``lr``."""
    return os.path.join(out, f"{algorithm}-lr{lr:g}")


def markdown(summaries):
    def cell(s, key, fmt):
        value = s[key] * 1e3 if key == "time_per_step_s" else s[key]
        return fmt.format(value)
    lines = ["| " + " | ".join(title for _, title, _ in COLUMNS) + " |",
             "|" + "|".join("---" for _ in COLUMNS) + "|"]
    lines += ["| " + " | ".join(cell(s, k, f) for k, _, f in COLUMNS) + " |" for s in summaries]
    return "\n".join(lines)


def collect(folders):
    """Summaries of every run folder (``summary.json``) under ``folders``, sorted by algorithm order and lr."""
    found = []
    for folder in folders:
        for root, _, files in os.walk(folder):
            if "summary.json" in files:
                with open(os.path.join(root, "summary.json")) as f:
                    found.append(json.load(f))
    order = {a: i for i, a in enumerate(ALGORITHMS)}
    return sorted(found, key=lambda s: (order.get(s["algorithm"], 99), s["lr"]))


def write_table(out, summaries):
    """The markdown table of ``summaries``; with ``out``, also written: ``out`` ending in
    ``.md`` is the table's file (its rows in the ``.json`` beside it), else a folder that gets
    ``compare.md`` and ``compare.json``."""
    table = markdown(summaries)
    if out:
        if out.endswith(".md"):
            md, rows = out, out[:-3] + ".json"
            os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        else:
            os.makedirs(out, exist_ok=True)
            md, rows = os.path.join(out, "compare.md"), os.path.join(out, "compare.json")
        with open(rows, "w") as f:
            json.dump(summaries, f, indent=2)
        with open(md, "w") as f:
            f.write(table + "\n")
    return table


def table_main(args):
    """``python -m mpigossip table DIR...``: one table from finished runs (e.g. an array job's)."""
    summaries = collect(args.dirs)
    if not summaries:
        print(f"python -m mpigossip table: error: no summary.json under {' '.join(args.dirs)}")
        return 1
    print(write_table(args.out, summaries))
    return 0
