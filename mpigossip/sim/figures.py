"""Figures of the time model's predictions (matplotlib, imported here only)."""

from .accuracy_time import winners


def winner_map(rows, path, measured=()):
    """A map per straggler setting: ranks across, link rate up, each cell coloured by the method
    first to the target accuracy and labelled with its time as a fraction of AllReduce's.

    Args:
        rows: :func:`~.accuracy_time.time_to_accuracy`'s rows.
        path: the PNG to write.
        measured: ``(straggler factor, ranks, rate_gbit, method, label)``: the method measured
            first on a real or emulated cluster, drawn as a star in its panel.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = winners(rows)
    factors = sorted({k[0] for k in best})
    ranks = sorted({k[1] for k in best} | {m[1] for m in measured})
    rates = sorted({k[2] for k in best} | {m[2] for m in measured})
    methods = sorted({v[0] for v in best.values() if v} | {m[3] for m in measured})
    colours = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(methods)}
    fig, axes = plt.subplots(1, len(factors), figsize=(4.2 * len(factors), 3.6), squeeze=False)
    for ax, factor in zip(axes[0], factors):
        for i, p in enumerate(ranks):
            for j, rate in enumerate(rates):
                win = best.get((factor, p, rate))
                if win is None:
                    continue
                ax.add_patch(plt.Rectangle((i - 0.5, j - 0.5), 1, 1, color=colours[win[0]], alpha=0.55))
                ratio = "" if win[2] is None else f"\n{win[2]:.2f}x AR"
                ax.text(i, j, f"{win[0]}{ratio}", ha="center", va="center", fontsize=7)
        for _, p, rate, method, label in (m for m in measured if m[0] == factor):
            ax.plot(ranks.index(p), rates.index(rate), marker="*", markersize=14, color=colours[method],
                    markeredgecolor="black")
            ax.annotate(label, (ranks.index(p), rates.index(rate)), textcoords="offset points", xytext=(0, -16),
                        ha="center", fontsize=6)
        ax.set_xticks(range(len(ranks)), [str(p) for p in ranks])
        ax.set_yticks(range(len(rates)), [f"{r:g}" for r in rates])
        ax.set_xlim(-0.5, len(ranks) - 0.5)
        ax.set_ylim(-0.5, len(rates) - 0.5)
        ax.set_xlabel("ranks")
        ax.set_ylabel("link Gbit/s")
        ax.set_title("no straggler" if factor == 1.0 else f"rank 1 {factor:g}x slow", fontsize=9)
    fig.suptitle("first to the target accuracy (predicted; time as a fraction of AllReduce's)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
