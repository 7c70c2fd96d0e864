"""Pictures of a plan (matplotlib): per-rank cost by part of the step, which tables sit on which
rank, and memory against capacity; `plot_compare` puts two plans side by side."""

from __future__ import annotations

import textwrap
from typing import Any, Sequence

from planners.cost import COMPONENTS
from planners.stats import PlanStats
from planners.types import ShardingType
from planners.units import plural, time_unit

__all__ = ["compare_figure", "plot_compare", "plot_stats", "stats_figure"]

GiB = 1024**3
_PART_COLOURS = ("#4C72B0", "#DD8452", "#55A868", "#8172B3", "#C44E52", "#937860", "#DA8BC3")
_PART_LABELS = ("lookup", "input dist", "output dist", "data-parallel\ngradient sync",
                "column-piece\nstatistic exchange", "cross-replica\nsync",
                "tier: misses,\nbookkeeping")  # COMPONENTS, short enough for a legend
_TYPE_COLOURS = {
    ShardingType.TABLE_WISE: "#4C72B0",
    ShardingType.ROW_WISE: "#DD8452",
    ShardingType.TABLE_ROW_WISE: "#937860",
    ShardingType.COLUMN_WISE: "#55A868",
    ShardingType.DATA_PARALLEL: "#8C8C8C",
}
_LEGEND = dict(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, framealpha=0.95,
               borderaxespad=0.0)  # right of the axes, so it hides no bar  # fmt: skip
_LABELLED_RANKS = 64  # table names are written inside the bars up to this many ranks


def plot_stats(stats: PlanStats, path: str, title: str = "", colour_by: str = "type") -> None:
    """Draws three panels into `path` (PNG, SVG or PDF by extension): per-rank cost by part
    (lookup, input dist, output dist, data-parallel gradient sync, column-piece statistic
    exchange) with the mean and the lower bound; the tables on each rank, one block per shard
    sized by its cost, coloured by sharding type (or `colour_by="table"`) and named where the
    block is tall enough; and per-rank memory against capacity. Hosts are marked and labelled.

        plot_stats(planners.plan_with_stats(tables, topology, batch_size=512).stats, "plan.png")
    """
    _save(stats_figure(stats, title, colour_by), path)


def stats_figure(stats: PlanStats, title: str = "", colour_by: str = "type") -> Any:
    """The matplotlib Figure that `plot_stats` saves (its axes: cost, tables, memory)."""
    plt = _pyplot()
    world = len(stats.ranks)
    fig, axes = plt.subplots(3, 1, figsize=(_width(world) + 2.6, 10.5), sharex=True,
                             gridspec_kw={"height_ratios": (1.0, 1.3, 0.8)})  # fmt: skip
    _draw(fig, axes, stats, title or _title(stats), colour_by, legends=True)
    fig.tight_layout()
    return fig


def plot_compare(
    stats: Sequence[PlanStats], names: Sequence[str], path: str, colour_by: str = "type"
) -> None:
    """Two plans side by side, one column each, with the same cost and memory scales."""
    _save(compare_figure(stats, names, colour_by), path)


def compare_figure(stats: Sequence[PlanStats], names: Sequence[str], colour_by: str = "type") -> Any:
    """The Figure that `plot_compare` saves: axes[row, column], a column per plan."""
    plt = _pyplot()
    worlds = [len(s.ranks) for s in stats]
    fig, axes = plt.subplots(3, 2, figsize=(sum(_width(w) for w in worlds) + 2.8, 10.5),
                             sharex="col", sharey="row",
                             gridspec_kw={"height_ratios": (1.0, 1.3, 0.8), "width_ratios": worlds})  # fmt: skip
    slowest = max(x.max_cost for x in stats)
    kinds = {t.sharding_type for x in stats for t in x.tables}  # one legend for both plans
    tops = [_draw(fig, axes[:, col], s, f"{name}: {_title(s)}", colour_by, legends=col == 1,
                  unit=time_unit(slowest), slowest=slowest, kinds=kinds)
            for col, (s, name) in enumerate(zip(stats, names))]  # fmt: skip
    for row in range(3):  # one scale per row, so that the taller bars are the slower plan's
        axes[row, 0].set_ylim(0, max(t[row] for t in tops))
    fig.tight_layout()
    return fig


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _width(world: int) -> float:
    return max(7.0, min(22.0, 0.14 * world + 5))


def _title(stats: PlanStats) -> str:
    slow = stats.slowest_rank
    unit, scale = time_unit(stats.max_cost)
    return (f"{plural(stats.num_tables, 'table')} on {plural(len(stats.ranks), 'rank')}, batch "
            f"{stats.batch_size}: slowest rank {slow.rank} {scale * slow.cost:.3f} {unit}, "
            f"max/mean {stats.imbalance:.3f}, max/bound {stats.bound_ratio:.3f}")  # fmt: skip


def _draw(fig: Any, axes: Sequence[Any], stats: PlanStats, title: str, colour_by: str,
          legends: bool, unit: tuple[str, float] | None = None, slowest: float | None = None,
          kinds: set[ShardingType] | None = None) -> tuple[float, float, float]:  # fmt: skip
    """Draws one plan into three stacked axes; returns the top of each axis' y range."""
    ax_cost, ax_tab, ax_mem = axes
    ranks = [r.rank for r in stats.ranks]
    world = len(ranks)
    unit, scale = unit or time_unit(stats.max_cost)
    width = 0.85

    bottom = [0.0] * world
    for (attr, _, _), label, colour in zip(COMPONENTS, _PART_LABELS, _PART_COLOURS):
        values = [scale * getattr(r, attr) for r in stats.ranks]
        if not any(values):
            continue
        ax_cost.bar(ranks, values, width, bottom=bottom, label=label, color=colour)
        bottom = [b + v for b, v in zip(bottom, values)]
    # side by side (kinds given), one legend serves two plans: no one plan's figures in it
    bound, mean = ("", "") if kinds else (f" {scale * stats.lower_bound:.3f} {unit}",
                                          f" {scale * stats.mean_cost:.3f} {unit}")  # fmt: skip
    ax_cost.axhline(scale * stats.lower_bound, color="black", linestyle="--", linewidth=1,
                    label=f"lower bound{bound}")  # fmt: skip
    ax_cost.axhline(scale * stats.mean_cost, color="grey", linestyle=":", linewidth=1,
                    label=f"mean{mean}")  # fmt: skip
    ax_cost.set_ylabel(f"cost per step ({unit})")
    chars = int(8.5 * ax_cost.get_position().width * fig.get_figwidth())  # ~chars per line
    ax_cost.set_title("\n".join(textwrap.wrap(title, max(30, chars))), fontsize=9)
    ax_cost.set_ylim(0, max(bottom + [scale * stats.lower_bound]) * 1.08)

    _draw_tables(fig, ax_tab, stats, scale, colour_by, legends, scale * (slowest or stats.max_cost),
                 kinds or {t.sharding_type for t in stats.tables})
    ax_tab.set_ylabel(f"tables: cost per shard ({unit})")

    mem = [r.memory / GiB for r in stats.ranks]
    colours = ["#C44E52" if r.memory > r.capacity else "#64B5CD" for r in stats.ranks]
    ax_mem.bar(ranks, mem, width, color=colours, label="memory used")
    cap = stats.ranks[0].capacity / GiB
    ax_mem.axhline(cap, color="#C44E52", linestyle="--", linewidth=1,
                   label=f"capacity {cap:.1f} GiB\n({100 * stats.topology.reserved_fraction:.0f}% "
                   "of device reserved)")  # fmt: skip
    ax_mem.set_ylabel("memory (GiB)")
    ax_mem.set_xlabel("rank")
    ax_mem.set_ylim(0, max(mem + [cap]) * 1.08)
    if legends:
        ax_cost.legend(**_LEGEND)
        ax_mem.legend(**_LEGEND)
    if world <= 64:
        ax_mem.set_xticks(ranks)
        ax_mem.tick_params(axis="x", labelsize=7 if world > 16 else 9)
    _mark_hosts(axes, stats)
    ax_mem.set_xlim(-0.6, world - 0.4)
    return tuple(ax.get_ylim()[1] for ax in axes)  # type: ignore[return-value]


def _draw_tables(fig: Any, ax: Any, stats: PlanStats, scale: float, colour_by: str, legend: bool,
                 top: float, kinds: set[ShardingType]) -> None:  # fmt: skip
    """One block per shard on its rank, stacked slowest first, sized by the shard's cost; a
    block is named where its name fits in it at the y scale `top` (the slowest rank shown)."""
    world = len(stats.ranks)
    palette = _table_colours(stats) if colour_by == "table" else None
    per_rank: list[list[tuple[float, str, Any]]] = [[] for _ in range(world)]
    for t in stats.tables:
        colour = palette[t.name] if palette else _TYPE_COLOURS[t.sharding_type]
        for s in t.shards:
            per_rank[s.rank].append((scale * s.cost, t.name, colour))
    top = top or 1.0
    points = ax.get_position().height * fig.get_figheight() * 72  # the axis' height in points
    fontsize = 6 if world > 16 else 7
    for rank, blocks in enumerate(per_rank):
        base = 0.0
        for cost, name, colour in sorted(blocks, key=lambda b: (-b[0], b[1])):
            ax.bar(rank, cost, 0.85, bottom=base, color=colour, edgecolor="white", linewidth=0.4)
            if world <= _LABELLED_RANKS and cost / top * points > 0.55 * fontsize * len(name) + 3:
                ax.text(rank, base + cost / 2, name, ha="center", va="center", rotation=90,
                        fontsize=fontsize, clip_on=True, gid="table-label")  # fmt: skip
            base += cost
    ax.set_ylim(0, top * 1.05)
    if legend:
        from matplotlib.patches import Patch

        if palette is None:
            handles = [Patch(color=c, label=k.value) for k, c in _TYPE_COLOURS.items() if k in kinds]
        else:
            names = list(palette)[:20]
            handles = [Patch(color=palette[n], label=n) for n in names]
            if len(palette) > 20:
                handles.append(Patch(color="white", label=f"... {len(palette) - 20} more"))
        ax.legend(handles=handles, title="colour: " + ("table" if palette else "sharding type"),
                  title_fontsize=8, **_LEGEND)  # fmt: skip


def _table_colours(stats: PlanStats) -> dict[str, Any]:
    import matplotlib

    cmap = matplotlib.colormaps["tab20"]
    return {t.name: cmap(i % 20) for i, t in enumerate(stats.tables)}


def _mark_hosts(axes: Sequence[Any], stats: PlanStats) -> None:
    """A line between hosts on every panel, and 'host h' above the first."""
    world = len(stats.ranks)
    host = int(stats.topology.ranks_per_host or world)
    for h in range(host, world, host):
        for ax in axes:
            ax.axvline(h - 0.5, color="dimgrey", linewidth=0.8, linestyle="-", zorder=0)
    hosts = world // host
    step = max(1, hosts // 16)  # at most ~16 labels
    top = axes[0].secondary_xaxis("top")
    top.set_xticks([h * host + (host - 1) / 2 for h in range(0, hosts, step)],
                   labels=[f"host {h}" for h in range(0, hosts, step)])
    top.tick_params(length=0, labelsize=7 if hosts > 8 else 8)


def _save(fig: Any, path: str) -> None:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)
