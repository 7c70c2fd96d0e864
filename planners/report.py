"""What a placement engineer reads: which table went where, and how two plans differ.

`format_tables` is the per-table view (type, ranks, shard sizes, memory and cost per shard),
`tables_csv` the same one row per shard for scripts; `setting_differences` says in which settings
two plans' pricing differs and `moved_tables` names every table that moved between them.
"""

from __future__ import annotations

import csv
import io
from typing import Mapping, NamedTuple, Sequence

import numpy as np

from planners.cost import CostModel, TableArrays
from planners.mc_cost import collision_price
from planners.inputs import Table, TableConstraint, format_bytes
from planners.model_tables import match_constraints
from planners.options import Candidates, enumerate_candidates
from planners.stats import PlanStats, TableStats
from planners.suggest import did_you_mean
from planners.types import PlanError, ShardingType, rank_ranges
from planners.units import format_seconds, time_unit

__all__ = [
    "SORT_KEYS", "Move", "describe_counts", "format_tables", "moved_tables", "pick_tables",
    "setting_differences", "shard_sizes", "table_moves", "tables_csv", "why_lines",
]  # fmt: skip

# --sort: table order as planned, or the largest first
SORT_KEYS = {
    "order": None,
    "name": lambda t: t.name,
    "cost": lambda t: (-t.max_cost, t.name),
    "total": lambda t: (-t.total_cost, t.name),
    "memory": lambda t: (-t.max_memory, t.name),
    "type": lambda t: (t.sharding_type.value, t.name),
    "shards": lambda t: (-len(t.shards), t.name),
}


def shard_sizes(t: TableStats) -> str:
    """'whole', 'copy', '48+80 cols', '3x62_501+13x62_500 rows'."""
    if t.sharding_type is ShardingType.TABLE_WISE:
        return "whole"
    if t.sharding_type is ShardingType.DATA_PARALLEL:
        return "copy"
    axis = "cols" if t.sharding_type is ShardingType.COLUMN_WISE else "rows"
    runs: list[list[int]] = []
    for size in t.sizes:
        if runs and runs[-1][0] == size:
            runs[-1][1] += 1
        else:
            runs.append([size, 1])
    return "+".join(f"{n}x{size:_}" if n > 1 else f"{size:_}" for size, n in runs) + f" {axis}"


def pick_tables(stats: PlanStats, names: Sequence[str] | None, sort: str = "order") -> list[TableStats]:
    """The tables named (all when `names` is empty), sorted by one of `SORT_KEYS`.

    Raises PlanError for a name the plan does not hold, with the closest one."""
    tables = list(stats.tables)
    if names:
        known = [t.name for t in tables] + [t.name.rsplit(".", 1)[-1] for t in tables]
        picked = []
        for name in names:
            match = [t for t in tables if name in (t.name, t.name.rsplit(".", 1)[-1])]
            if not match:
                hint = did_you_mean(name, known)
                raise PlanError(f"--table {name!r}: no such table in the plan"
                                + (f"; {hint}" if hint else ""))  # fmt: skip
            picked.extend(m for m in match if m not in picked)
        tables = picked
    key = SORT_KEYS[sort]
    return tables if key is None else sorted(tables, key=key)


def format_tables(stats: PlanStats, tables: Sequence[TableStats]) -> str:
    """The per-table view: one line per table, largest shard's memory and cost; where any is a
    managed-collision table, a column gives each one's zch_size; where any is tiered, columns
    give each tiered one's cache (load factor and policy), cache rows and estimated hit rate."""
    world = len(stats.ranks)
    unit, scale = time_unit(max((t.max_cost for t in tables), default=stats.max_cost))
    name_w = max([5] + [len(t.name) for t in tables])
    rows_ = [(t.name, t.sharding_type.value, rank_ranges(t.ranks, world), shard_sizes(t),
              format_bytes(t.max_memory), f"{scale * t.max_cost:.3f}",
              f"{scale * t.total_cost:.3f}") for t in tables]  # fmt: skip
    head = ("table", "type", "ranks", "shard sizes", "mem/shard", f"{unit}/shard", f"{unit} total")
    widths = [max(len(h), *(len(r[i]) for r in rows_)) if rows_ else len(h)
              for i, h in enumerate(head)]
    widths[0] = max(widths[0], name_w)
    left = [True, True, True, True, False, False, False]
    if any(t.managed_collision is not None for t in tables):
        head += ("zch_size",)
        rows_ = [r + (f"{t.zch_size:_}" if t.zch_size is not None else "-",) for r, t in zip(rows_, tables)]
        widths.append(max(len(r[-1]) for r in rows_ + [head]))
        left.append(False)
    if any(t.cache_load_factor is not None for t in tables):  # Note [pricing tiered tables]
        head += ("cache", "cache rows", "hit")
        rows_ = [r + ((f"{t.cache_load_factor:g} {t.cache_policy}", f"{t.cache_rows:_}",
                       f"{t.hit_rate:.3f}") if t.cache_load_factor is not None else ("-",) * 3)
                 for r, t in zip(rows_, tables)]  # fmt: skip
        widths += [max(len(r[i]) for r in rows_ + [head]) for i in range(-3, 0)]
        left += [False] * 3

    def line(cells: Sequence[str]) -> str:
        return " ".join(c.ljust(w) if l else c.rjust(w)
                        for c, w, l in zip(cells, widths, left)).rstrip()  # fmt: skip

    return "\n".join([line(head)] + [line(r) for r in rows_])


def tables_csv(stats: PlanStats, tables: Sequence[TableStats]) -> str:
    """One row per shard: table, type, rank, rows and columns of the block, bytes, seconds."""
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    parts = ("lookup", "input_dist", "output_dist", "grad_sync", "stat_exchange")
    mc = any(t.managed_collision is not None for t in tables)  # a zch_size column where any
    tiered = any(t.cache_load_factor is not None for t in tables)  # and the tier's where any
    tier_head = ("cache_load_factor", "cache_policy", "cache_rows", "hit_rate", "tier_bytes", "tier_s")
    w.writerow(("table", "sharding_type", "rank", "row_offset", "num_rows", "col_offset",
                "num_cols", "memory_bytes", "cost_s", *(p + "_s" for p in parts))
               + (("zch_size",) if mc else ()) + (tier_head if tiered else ()))  # fmt: skip
    for t in tables:
        for s in t.shards:
            tier = ((t.cache_load_factor, t.cache_policy, s.cache_rows, f"{s.hit_rate:.6g}",
                     f"{s.tier_bytes:.0f}", f"{s.tier:.9g}") if t.cache_load_factor is not None
                    else ("",) * len(tier_head))  # fmt: skip
            w.writerow((t.name, t.sharding_type.value, s.rank, s.row_offset, s.num_rows,
                        s.col_offset, s.num_cols, f"{s.memory:.0f}", f"{s.cost:.9g}",
                        *(f"{getattr(s, p):.9g}" for p in parts))
                       + ((t.zch_size or "",) if mc else ()) + (tier if tiered else ()))  # fmt: skip
    return out.getvalue()


def _placement_text(t: TableStats, world: int) -> str:
    return f"{t.sharding_type.value} on {rank_ranges(t.ranks, world)} ({shard_sizes(t)})"


def setting_differences(stats: tuple[PlanStats, PlanStats], settings: tuple[dict, dict]) -> list[str]:
    """The settings two plans were priced under that differ (world size, hosts, batch,
    optimizer, device, constraints, tables), one line each, and what that means."""
    a, b = stats
    lines = []
    for key, label in (("world_size", "world size"), ("ranks_per_host", "ranks per host"),
                       ("batch_size", "batch size per rank"), ("optimizer", "optimizer"),
                       ("column_wise_statistic", "column_wise_statistic"),
                       ("comm_dtype", "comm_dtype"),
                       ("torchrec_compatible", "torchrec_compatible"),
                       ("device_memory", "device memory"),
                       ("reserved_fraction", "reserved fraction"),
                       ("device_memory_bandwidth", "memory bandwidth"),
                       ("intra_host_bandwidth", "intra-host bandwidth"),
                       ("cross_host_bandwidth", "cross-host bandwidth"), ("module", "module"),
                       ("constraints", "constraints"),
                       ("tables_digest", "tables")):  # fmt: skip
        va, vb = settings[0].get(key), settings[1].get(key)
        if va != vb:
            if key == "device_memory":
                va, vb = (format_bytes(v) if isinstance(v, (int, float)) else v for v in (va, vb))
            if key in ("constraints", "tables_digest"):
                va, vb = ((", ".join(sorted(v)[:5]) + (", ..." if len(v) > 5 else "") or "none")
                          if key == "constraints" else str(v)[:12] for v in (va, vb))  # fmt: skip
            lines.append(f"DIFFERENT {label}: {va} vs {vb}")
    if len(a.ranks) != len(b.ranks) or a.batch_size != b.batch_size:
        ga, gb = len(a.ranks) * a.batch_size, len(b.ranks) * b.batch_size
        lines.append(f"the global batches differ ({ga:_} vs {gb:_} samples per step): the step "
                     "times below are for different work")  # fmt: skip
    return lines


class Move(NamedTuple):
    """One table placed differently in two plans, and in what: 'type', 'ranks', 'sizes'."""

    table: str
    before: TableStats
    after: TableStats
    what: tuple[str, ...]


def table_moves(a: PlanStats, b: PlanStats) -> list[Move]:
    """Every table of both plans placed differently (type, ranks or shard sizes), in `a`'s
    order. A data-parallel table is on every rank of either world: it moves only if its type
    changes."""
    by_b = {t.name: t for t in b.tables}
    moves = []
    for ta in a.tables:
        tb = by_b.get(ta.name)
        if tb is None or ta.sharding_type is tb.sharding_type is ShardingType.DATA_PARALLEL:
            continue
        what = []
        if ta.sharding_type is not tb.sharding_type:
            what.append("type")
        if ta.ranks != tb.ranks:
            what.append("ranks")
        if ta.sizes != tb.sizes and ta.sharding_type is tb.sharding_type:
            what.append("sizes")
        if what:
            moves.append(Move(ta.name, ta, tb, tuple(what)))
    return moves


def moved_tables(names: tuple[str, str], stats: tuple[PlanStats, PlanStats]) -> list[str]:
    """`table_moves` as text, one line each, then the ratio of the slowest ranks."""
    a, b = stats
    lines = []
    moves = table_moves(a, b)
    only = sorted({t.name for t in a.tables} ^ {t.name for t in b.tables})
    if only:
        lines.append(f"tables in one plan only: {', '.join(only)}")
    lines.append(f"tables placed differently: {len(moves)} of {len(a.tables)}")
    width = max([5] + [len(m.table) for m in moves])
    for m in moves:
        lines.append(f"  {m.table:<{width}} {_placement_text(m.before, len(a.ranks))} -> "
                     f"{_placement_text(m.after, len(b.ranks))}  [{', '.join(m.what)}]")  # fmt: skip
    ratio = b.max_cost / a.max_cost if a.max_cost > 0 else 1.0
    lines.append(f"slowest rank of {names[1]} / {names[0]}: {ratio:.3f}")
    return lines


def why_lines(stats: PlanStats, tables: Sequence[Table], name: str,
              constraints: Mapping[str, TableConstraint] | None) -> list[str]:  # fmt: skip
    """Why table `name` is placed as it is: for each sharding type, the placement of that type
    the search would weigh against the plan's slowest rank (the fewest-work one whose largest
    shard is under it, else the one with the smallest largest shard), or why there is none."""
    model = CostModel(stats.topology, stats.batch_size, stats.optimizer,
                      column_wise_statistic=stats.column_wise_statistic,
                      comm_dtype=stats.comm_dtype)  # fmt: skip
    table_set = tuple(("", t) for t in tables)
    cons = match_constraints(table_set, constraints, stats.topology.world_size)
    i = next(j for j, t in enumerate(tables) if name in (t.name, stats.tables[j].name))
    chosen = stats.tables[i]
    room = (stats.topology.capacity - model.batch_buffer_bytes(TableArrays.of(list(tables)))
            - collision_price(list(tables), model).reserve)
    c = enumerate_candidates([tables[i]], model, [cons[i]], room,
                             torchrec=stats.torchrec_compatible)  # fmt: skip
    slowest = stats.max_cost
    lines = [f"  why: the slowest rank takes {format_seconds(slowest)} (lower bound "
             f"{format_seconds(stats.lower_bound)}); per sharding type, the best this table "
             "could have:"]  # fmt: skip
    fractions = tables[i].batch_fractions
    if any(f != 1.0 for f in fractions):  # Table.batch_fraction: a deduplicated feature
        per = ", ".join(f"{f!r} {b:g}" for f, b in zip(tables[i].features, fractions))
        lines.insert(0, f"  batch fraction (bags per sample, priced at that batch): {per}")
    for kind in ShardingType:
        rows = _kind_rows(c, kind)  # (k, largest shard s, total s, bytes, valid, allowed)
        if not rows:
            continue
        valid = [r for r in rows if r[4]]
        if not valid:
            if cons[i] is not None and not any(r[5] for r in rows):
                reason = "not allowed by its constraint (or its shape)"
            elif not any(r[5] for r in rows):
                reason = "not possible for its shape"
            else:
                reason = "no shard of it fits in a rank's memory"
            lines.append(f"    {kind.value:<22} {reason}")
            continue
        under = [r for r in valid if r[1] <= slowest * (1 + 1e-9)]
        k, largest, total, memory = (min(under, key=lambda r: (r[2], r[0])) if under
                                     else min(valid, key=lambda r: (r[1], r[0])))[:4]  # fmt: skip
        label = kind.value
        if kind not in (ShardingType.TABLE_WISE, ShardingType.DATA_PARALLEL):
            label += f" over {k}"
        per = "per copy" if kind is ShardingType.DATA_PARALLEL else "largest shard"
        verdict = "" if under else "  (slower than the slowest rank)"
        lines.append(f"    {label:<22} {per} {format_seconds(largest)}, total "
                     f"{format_seconds(total)}, {format_bytes(memory)}{verdict}")  # fmt: skip
    over = "" if chosen.sharding_type is ShardingType.DATA_PARALLEL else f" over {len(chosen.shards)}"
    lines.append(f"  chosen: {chosen.sharding_type.value}{over} ({shard_sizes(chosen)}), largest "
                 f"shard {format_seconds(chosen.max_cost)}, total {format_seconds(chosen.total_cost)}")  # fmt: skip
    lines.append("  (the rows above split evenly; a largest shard above the slowest rank would "
                 "slow the plan, and under it the total is work the other ranks must absorb)")  # fmt: skip
    return lines


def _kind_rows(c: Candidates, kind: ShardingType) -> list[tuple]:
    """The candidates of one table (the only one in `c`) of one type, each as (shards, largest
    shard seconds, total seconds, bytes, valid, allowed); row-wise over every allowed k."""
    if kind is not ShardingType.ROW_WISE:
        return [(k, float(c.max_cost[0, j]), float(c.total[0, j]), float(c.max_memory[0, j]),
                 bool(c.valid[0, j]), bool(c.allowed[0, j]))
                for j, (kd, k) in enumerate(c.columns) if kd is kind]  # fmt: skip
    rw = c.row_wise
    if min(rw.model.topology.world_size, int(rw.t.rows[0])) < 2:
        return []  # no row-wise candidate exists at all
    ks = np.arange(int(rw.allowed_lo[0]), int(rw.allowed_hi[0]) + 1)
    if not len(ks):
        return [(2, np.inf, np.inf, np.inf, False, False)]  # shown only as "not allowed"
    zero = np.zeros(len(ks), dtype=np.int64)
    return list(zip(ks.tolist(), rw.cost(zero, ks).tolist(), rw.total(zero, ks).tolist(),
                    rw.memory(zero, ks).tolist(), rw.valid(zero, ks).tolist(), [True] * len(ks)))


def describe_counts(stats: PlanStats) -> str:
    """'table_wise 20, row_wise 4, data_parallel 2'."""
    counts: dict[str, int] = {}
    for t in stats.tables:
        counts[t.sharding_type.value] = counts.get(t.sharding_type.value, 0) + 1
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
