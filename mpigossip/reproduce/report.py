"""The report of ``reproduce``: ``report.md`` (verdicts, tables) and PNG figures."""

import os

from .findings import Stat, auc, select, sim_final, target_accuracy, throughput, time_to_accuracy
from .findings import md_table as _table


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _mean_curve(runs, key, x="steps"):
    """Mean over seeds of ``key`` at each evaluation, with the min and max (runs share steps)."""
    n = min(len(r["curve"]) for r in runs)
    xs = [runs[0]["curve"][i][x] for i in range(n)]
    cols = [[r["curve"][i][key] for r in runs] for i in range(n)]
    return xs, [sum(c) / len(c) for c in cols], [min(c) for c in cols], [max(c) for c in cols]


def curves_figure(records, p, path):
    """Loss, accuracy and consensus distance vs steps at ``p``: one row per step size, one
    line per algorithm (mean over seeds, the band from the lowest to the highest seed)."""
    plt = _plt()
    lrs = sorted({r["lr"] for r in select(records, world_size=p)})
    fig, axes = plt.subplots(len(lrs), 3, figsize=(15, 3.8 * len(lrs)), squeeze=False)
    for row, lr in zip(axes, lrs):
        for name in dict.fromkeys(r["algorithm"] for r in select(records, world_size=p, lr=lr)):
            runs = select(records, world_size=p, lr=lr, algorithm=name)
            for ax, key in zip(row, ("loss", "accuracy", "consensus")):
                xs, mean, lo, hi = _mean_curve(runs, key)
                line, = ax.plot(xs, mean, marker="o", markersize=2.5, label=name)
                if len(runs) > 1:
                    ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.15)
        for ax, label in zip(row, ("test loss", "test accuracy", "consensus distance")):
            ax.set_xlabel("steps")
            ax.set_ylabel(label)
            ax.set_title(f"p = {p}, lr = {lr:g}")
            ax.grid(alpha=0.3)
        row[2].set_yscale("symlog", linthresh=1e-3)
        row[0].legend(fontsize=8)
    fig.suptitle("consensus model (mean over ranks) on the test split; mean over seeds, band = seed range")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def timed_figure(timed, path):
    """Test accuracy vs training time (evaluations excluded), one panel per case, the first
    repeat; the panels share both axes and each algorithm keeps its colour."""
    plt = _plt()
    cases = list(dict.fromkeys(r["case"] for r in timed))
    fig, axes = plt.subplots(1, len(cases), figsize=(5.5 * len(cases), 4), sharex=True, sharey=True, squeeze=False)
    target = target_accuracy(timed)
    colours = {name: f"C{i}" for i, name in enumerate(dict.fromkeys(r["algorithm"] for r in timed))}
    titles = {"normal": "no straggler", "straggler": "rank 1 permanently 2x slow", "delays": "transient random delays"}
    for ax, case in zip(axes[0], cases):
        for r in select(timed, case=case):
            if r.get("repeat", 0) != 0:
                continue
            ax.plot([q["time_s"] for q in r["curve"]], [q["accuracy"] for q in r["curve"]], marker="o",
                    markersize=2.5, label=r["algorithm"], color=colours[r["algorithm"]])
        if target is not None:
            ax.axhline(target, color="grey", linestyle=":", label=f"target {target:.3f}")
        ax.set_xlabel("training time (s), evaluations excluded")
        ax.set_ylabel("test accuracy")
        ax.set_title(titles.get(case, case))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def sim_consensus_figure(curves, p, path):
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, ys in curves.items():
        ax.plot(range(1, len(ys) + 1), ys, label=name)
    ax.set_yscale("log")
    ax.set_xlabel("PushSum steps")
    ax.set_ylabel("consensus error / initial")
    ax.set_title(f"simulator, p = {p}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def sim_scaling_figure(sim_records, path):
    """Final training loss of each scheme vs p, one panel per step size (mean over seeds)."""
    plt = _plt()
    lrs = sorted({r["lr"] for r in sim_records})
    fig, axes = plt.subplots(1, len(lrs), figsize=(6.5 * len(lrs), 4), squeeze=False)
    for ax, lr in zip(axes[0], lrs):
        for scheme in dict.fromkeys(r["scheme"] for r in sim_records):
            sizes = sorted({r["p"] for r in sim_records if r["lr"] == lr and r["scheme"] == scheme})
            stats = [sim_final(sim_records, scheme=scheme, p=p, lr=lr) for p in sizes]
            ax.errorbar(sizes, [s.mean for s in stats], yerr=[s.std for s in stats], marker="o", capsize=3,
                        label=scheme)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("p (virtual ranks)")
        ax.set_ylabel("final training loss")
        ax.set_title(f"simulator, softmax regression, lr = {lr:g}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)




def _runs_table(records):
    rows = []
    for p in sorted({r["world_size"] for r in records}):
        for lr in sorted({r["lr"] for r in select(records, world_size=p)}):
            for name in dict.fromkeys(r["algorithm"] for r in select(records, world_size=p, lr=lr)):
                rs = select(records, world_size=p, lr=lr, algorithm=name)
                rank = [r["rank_accuracy_mean"] for r in rs if "rank_accuracy_mean" in r]
                rows.append([str(p), f"{lr:g}", name, str(Stat(r["final_accuracy"] for r in rs)),
                             f"{Stat(rank).mean:.4f}" if rank else "-",
                             str(Stat(r["final_loss"] for r in rs)), str(Stat(auc(r["curve"]) for r in rs)),
                             f"{Stat(r['consensus_distance'] for r in rs).mean:.2e}",
                             f"{Stat(r['time_per_step_s'] for r in rs).mean * 1e3:.1f}"])
    return _table(["p", "lr", "algorithm", "test accuracy (EASGD: center; others: mean model)",
                   "ranks' own models, mean accuracy", "final test loss", "mean test loss (speed)",
                   "consensus dist.", "ms/step"], rows)


def _timed_table(timed):
    target = target_accuracy(timed)
    rows = [[r["case"], str(r.get("repeat", 0)), r["algorithm"], f"{r['final_accuracy']:.4f}",
             f"{r['final_loss']:.4f}", f"{r['time_per_step_s'] * 1e3:.1f}", f"{throughput(r):.2f}",
             f"{r.get('compute_time_s', 0):.2f}",
             f"{r['comm_time_s']:.2f}", f"{r.get('wait_time_s', 0):.2f}",
             (lambda t: "never" if t is None else f"{t:.1f}")(time_to_accuracy(r["curve"], target))]
            for r in timed]
    return _table(["case", "repeat", "algorithm", "test accuracy", "test loss",
                   "ms/step (slowest rank, no evaluations)", "steps/s (sum of the ranks' own)",
                   "compute s/rank", "comm s/rank", "of which waiting", f"s to {target:.3f} accuracy"], rows)


def _sim_table(sim_records):
    lrs = sorted({r["lr"] for r in sim_records})
    sizes = sorted({r["p"] for r in sim_records})
    rows = []
    for lr in lrs:
        for scheme in dict.fromkeys(r["scheme"] for r in sim_records):
            cells = [f"{sim_final(sim_records, scheme=scheme, p=p, lr=lr).mean:.4f} / "
                     f"{sim_final(sim_records, 'accuracy', scheme=scheme, p=p, lr=lr).mean:.3f}" for p in sizes]
            rows.append([f"{lr:g}", scheme] + cells)
    return _table(["lr", "scheme"] + [f"p = {p}" for p in sizes], rows)


def write(out, *, findings, records, timed, sim_records, curves, consensus_p, header):
    """Write ``report.md`` and the figures into ``out``; returns the report's path."""
    figures = []
    for p in sorted({r["world_size"] for r in records}):
        curves_figure(records, p, os.path.join(out, f"curves-p{p}.png"))
        figures.append((f"curves-p{p}.png", f"p = {p}: test loss, accuracy and consensus distance vs steps"))
    if timed:
        timed_figure(timed, os.path.join(out, "timed.png"))
        figures.append(("timed.png", "timed runs: test loss and accuracy vs wall time"))
    if curves:
        sim_consensus_figure(curves, consensus_p, os.path.join(out, "sim-consensus.png"))
        figures.append(("sim-consensus.png", f"simulator: PushSum consensus error per graph at p = {consensus_p}"))
    if sim_records:
        sim_scaling_figure(sim_records, os.path.join(out, "sim-scaling.png"))
        figures.append(("sim-scaling.png", "simulator: final training loss of each scheme vs p"))

    lines = ["# Reproducing Jin et al. 2016 and Assran et al. 2019 with mpigossip", ""] + header + [""]
    lines += ["## Verdicts", ""]
    lines += _table(["finding", "claim", "verdict"], [[f.key, f.claim, f"**{f.verdict}**"] for f in findings])
    for f in findings:
        lines += ["", f"## ({f.key}) {f.claim}", "", f"- setting: {f.setting}", f"- rule: {f.rule}",
                  f"- verdict: **{f.verdict}**", ""]
        if f.rows:
            width = max(len(r) for r in f.rows)
            head = (f.header + [""] * width)[:width]
            lines += _table(head, [r + [""] * (width - len(r)) for r in f.rows])
        lines += [""] + [f"- {n}" for n in f.notes] + list(f.extra)
    lines += ["", "## All accuracy runs (mean ± spread over seeds)", ""] + _runs_table(records)
    if timed:
        lines += ["", "## Timed runs", ""] + _timed_table(timed)
    if sim_records:
        lines += ["", "## Simulator: final training loss / test accuracy of the mean (center for EASGD) model", ""]
        lines += _sim_table(sim_records)
    if curves:
        lines += ["", f"Consensus at p = {consensus_p}: relative error after the last simulated step: "
                  + ", ".join(f"{k} {v[-1]:.1e}" for k, v in curves.items())]
    lines += ["", "## Figures", ""] + [f"![{caption}]({name})" for name, caption in figures]
    path = os.path.join(out, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path
