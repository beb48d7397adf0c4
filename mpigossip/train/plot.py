"""``python -m mpigossip plot DIR...``: PNG figures of training runs written by ``train --out``.

Each DIR is a run folder (``summary.json`` + ``metrics-rank*.jsonl``) or a folder of them
(``train --algorithm all``, ``compare``). One line per run.
"""

import json
import os


def find_runs(paths):
    runs = []
    for path in paths:
        if os.path.isfile(os.path.join(path, "metrics-rank0.jsonl")):
            runs.append(path)
        elif os.path.isdir(path):
            runs += sorted(os.path.join(path, d) for d in os.listdir(path)
                           if os.path.isfile(os.path.join(path, d, "metrics-rank0.jsonl")))
    return runs


def load_run(folder):
    with open(os.path.join(folder, "metrics-rank0.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    label = os.path.basename(os.path.normpath(folder))
    summary = os.path.join(folder, "summary.json")
    if os.path.isfile(summary):
        with open(summary) as f:
            s = json.load(f)
        label = f"{s['algorithm']} lr={s['lr']:g}"
    return label, records


def main(args):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = find_runs(args.dirs)
    if not runs:
        print(f"python -m mpigossip plot: error: no runs (metrics-rank0.jsonl) under {' '.join(args.dirs)}")
        return 1
    out = args.out or args.dirs[0]
    os.makedirs(out, exist_ok=True)
    loaded = [load_run(r) for r in runs]
    figures = {
        "loss.png": [("steps_done", "test_loss", "steps"), ("time_s", "test_loss", "wall time (s)")],
        "accuracy.png": [("steps_done", "test_accuracy", "steps"), ("time_s", "test_accuracy", "wall time (s)")],
        "consensus.png": [("steps_done", "consensus_distance", "steps")],
    }
    written = []
    for name, panels in figures.items():
        fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.2), squeeze=False)
        for ax, (xkey, ykey, xlabel) in zip(axes[0], panels):
            for label, records in loaded:
                # evaluations: from the model before training (0 steps) to the last step
                pts = [(r.get(xkey, r["step"] + 1), r[ykey]) for r in records if ykey in r]
                if pts:
                    ax.plot(*zip(*pts), marker="o", markersize=3, label=label)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ykey.replace("_", " "))
            if ykey == "consensus_distance":
                ax.set_yscale("symlog", linthresh=1e-6)
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=8)
        what = "distance of the rank models from their mean" if name == "consensus.png" else \
            "test metrics of the consensus model (mean over ranks)"
        fig.suptitle(f"{what}, {len(loaded)} run(s)")
        fig.tight_layout()
        path = os.path.join(out, name)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    print("wrote " + ", ".join(written))
    return 0
