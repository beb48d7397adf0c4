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


#: Line styles after the 20 colours of matplotlib's ``tab20`` (runs 21-40 dashed, ...).
LINESTYLES = ("-", "--", ":", "-.")


def styles(n):
    """A distinct (colour index in ``tab20``, line style) for each of ``n`` runs: every run has
    its own colour up to 20 runs, and its own colour and style pair up to 80."""
    return [(i % 20, LINESTYLES[(i // 20) % len(LINESTYLES)]) for i in range(n)]


def zoom(series, part=0.5, margin=0.1):
    """``(x0, x1, y0, y1)`` of the last ``part`` of the runs' x range, y fitted to the points
    there (with ``margin`` of their spread around), or None: where curves crowd in one band
    at the top (accuracies near 1), this shows their differences."""
    xs = [x for pts in series for x, _ in pts]
    if not xs:
        return None
    x1 = max(xs)
    x0 = min(xs) + (x1 - min(xs)) * (1 - part)
    ys = [y for pts in series for x, y in pts if x >= x0]
    if len(ys) < 2 or max(ys) == min(ys):
        return None
    pad = (max(ys) - min(ys)) * margin
    return x0, x1, min(ys) - pad, max(ys) + pad


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
    palette = plt.get_cmap("tab20")
    looks = styles(len(loaded))
    for name, panels in figures.items():
        columns = min(len(loaded), 4)
        rows = -(-len(loaded) // columns)   # the legend's rows, below the panels
        fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.2 + 0.22 * rows), squeeze=False)
        for ax, (xkey, ykey, xlabel) in zip(axes[0], panels):
            series = []
            for (label, records), (colour, style) in zip(loaded, looks):
                # evaluations: from the model before training (0 steps) to the last step
                pts = [(r.get(xkey, r["step"] + 1), r[ykey]) for r in records if ykey in r]
                if pts:
                    ax.plot(*zip(*pts), marker="o", markersize=3, label=label, color=palette(colour),
                            linestyle=style)
                    series.append((pts, colour, style))
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ykey.replace("_", " "))
            if ykey == "consensus_distance":
                ax.set_yscale("symlog", linthresh=1e-6)
            box = zoom([pts for pts, _, _ in series]) if ykey != "consensus_distance" and len(series) > 1 else None
            if box:   # the last half, enlarged: the runs' differences where the full axis shows one band
                inset = ax.inset_axes([0.45, 0.3, 0.5, 0.4])
                for pts, colour, style in series:
                    inset.plot(*zip(*pts), marker="o", markersize=2, color=palette(colour), linestyle=style)
                inset.set_xlim(box[0], box[1])
                inset.set_ylim(box[2], box[3])
                inset.tick_params(labelsize=6)
                inset.grid(alpha=0.3)
                inset.set_title("last half", fontsize=7)
            ax.grid(alpha=0.3)
        handles, labels = axes[0][0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=columns, fontsize=8, frameon=False)
        what = "distance of the rank models from their mean" if name == "consensus.png" else \
            "test metrics of the consensus model (mean over ranks)"
        fig.suptitle(f"{what}, {len(loaded)} run(s)")
        fig.tight_layout(rect=(0, 0.22 * rows / (4.2 + 0.22 * rows) + 0.02, 1, 1))
        path = os.path.join(out, name)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    print("wrote " + ", ".join(written))
    return 0
