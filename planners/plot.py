"""Per-rank bars of a plan: cost by pipeline step, and memory against capacity (matplotlib)."""

from __future__ import annotations

from planners.stats import PlanStats

__all__ = ["plot_stats"]

GiB = 1024**3


def plot_stats(stats: PlanStats, path: str, title: str = "") -> None:
    """Draws two panels into `path` (PNG, SVG or PDF by extension): stacked per-rank cost
    (lookup / input dist / output dist / data-parallel sync) with the mean and the lower bound,
    and per-rank memory with the capacity line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = [r.rank for r in stats.ranks]
    world = len(ranks)
    fig, (ax_cost, ax_mem) = plt.subplots(
        2, 1, figsize=(max(8.0, min(24.0, 0.12 * world + 6)), 7.5), sharex=True
    )
    width = 0.85
    bottom = [0.0] * world
    parts = (("lookup", "lookup", "#4C72B0"), ("input_dist", "input dist", "#DD8452"),
             ("output_dist", "output dist", "#55A868"), ("grad_sync", "data-parallel sync", "#8172B3"))  # fmt: skip
    for attr, label, color in parts:
        values = [1e3 * getattr(r, attr) for r in stats.ranks]
        if not any(values):
            continue
        ax_cost.bar(ranks, values, width, bottom=bottom, label=label, color=color)
        bottom = [b + v for b, v in zip(bottom, values)]
    slow = stats.slowest_rank
    ax_cost.axhline(1e3 * stats.lower_bound, color="black", linestyle="--", linewidth=1,
                    label=f"lower bound {1e3 * stats.lower_bound:.3f} ms")  # fmt: skip
    ax_cost.axhline(1e3 * stats.mean_cost, color="grey", linestyle=":", linewidth=1,
                    label=f"mean {1e3 * stats.mean_cost:.3f} ms")  # fmt: skip
    ax_cost.set_ylabel("cost per step (ms)")
    ax_cost.set_title(
        title or f"{stats.num_tables} tables on {world} ranks: slowest rank {slow.rank} "
        f"{1e3 * slow.cost:.3f} ms, max/mean {stats.imbalance:.3f}, "
        f"max/bound {stats.bound_ratio:.3f}"
    )
    top = max(bottom + [1e3 * stats.lower_bound])
    ax_cost.set_ylim(0, top * 1.3)  # headroom for the legend, which must not hide any bar
    ax_cost.legend(loc="upper center", fontsize=8, ncol=6, framealpha=0.95)

    mem = [r.memory / GiB for r in stats.ranks]
    colors = ["#C44E52" if r.memory > r.capacity else "#64B5CD" for r in stats.ranks]
    ax_mem.bar(ranks, mem, width, color=colors, label="memory used")
    cap = stats.ranks[0].capacity / GiB
    ax_mem.axhline(cap, color="#C44E52", linestyle="--", linewidth=1,
                   label=f"capacity {cap:.1f} GiB "
                   f"({100 * stats.topology.reserved_fraction:.0f}% of device reserved)")  # fmt: skip
    ax_mem.set_ylabel("memory (GiB)")
    ax_mem.set_xlabel("rank")
    ax_mem.set_ylim(0, max(mem + [cap]) * 1.25)
    ax_mem.legend(loc="upper center", fontsize=8, ncol=2, framealpha=0.95)
    host = stats.topology.ranks_per_host or world
    if world <= 64:
        ax_mem.set_xticks(ranks)
        ax_mem.tick_params(axis="x", labelsize=7 if world > 16 else 9)
    for h in range(host, world, host):  # host boundaries
        for ax in (ax_cost, ax_mem):
            ax.axvline(h - 0.5, color="lightgrey", linewidth=0.8, zorder=0)
    ax_mem.set_xlim(-0.6, world - 0.4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
