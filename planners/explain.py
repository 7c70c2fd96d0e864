"""Why no plan fits: the tables that cannot be placed, the numbers, and the ways out."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from planners.cost import CostModel
from planners.inputs import DataType, Optimizer, TableConstraint, format_bytes
from planners.mc_cost import collision_price
from planners.model_tables import TableSet, display_name
from planners.options import Candidates
from planners.tier_cost import ROW_MAP_BYTES, SLOT_BYTES, cache_rows
from planners.types import PlanError, ShardingType
from planners.units import plural

__all__ = ["NoPlanError", "before_candidates", "before_search", "explain_no_plan", "table_footprint"]

_LISTED = 8  # tables named one per line; the rest are counted


class NoPlanError(PlanError):
    """No plan fits in memory. `tables` names the tables that do not fit; the message gives the
    numbers and concrete ways out (more ranks, another sharding type, a smaller batch)."""

    def __init__(self, message: str, tables: Sequence[str]) -> None:
        super().__init__(message)
        self.tables = tuple(tables)


def table_footprint(table, optimizer: Optimizer, con: TableConstraint | None = None) -> float:
    """Weights plus optimizer state (and, unfused, the gradient buffer) of the whole table, the
    part no sharding can shrink; for a tiered table (`con.cache_load_factor`), its cache with the
    bookkeeping (Note [pricing tiered tables] in planners/tier_cost.py)."""
    state = optimizer.state_bytes_per_row(table.embedding_dim, table.dtype.num_bytes)
    if con is not None and con.cache_load_factor is not None:
        row = table.embedding_dim * table.dtype.num_bytes + state
        slots = float(cache_rows(table.num_embeddings, con.cache_load_factor))
        return slots * (row + SLOT_BYTES) + table.num_embeddings * ROW_MAP_BYTES
    grads = 0 if optimizer.fused else table.weight_bytes
    return float(table.weight_bytes + table.num_embeddings * state + grads)


def explain_no_plan(
    table_set: TableSet,
    candidates: Candidates,
    constraints: Sequence[TableConstraint | None],
    model: CostModel,
    base_memory: float,
    unplaced: Sequence[int],
) -> NoPlanError:
    """Builds the error for the first reason that applies (see the checks below, in order);
    with `unplaced` (the search's leftovers), the last reason if no earlier one does."""
    return (
        before_candidates(table_set, constraints, model, base_memory)
        or before_search(table_set, candidates, constraints, model, base_memory)
        or _unplaced(table_set, candidates, constraints, model, base_memory, unplaced)
    )


def _where(model: CostModel) -> str:
    topo = model.topology
    return (f"each rank has {format_bytes(topo.capacity)} ({format_bytes(topo.device_memory)} "
            f"device memory, {100 * topo.reserved_fraction:.0f}% reserved)")  # fmt: skip


def _buffers(table_set: TableSet) -> str:
    """What the memory reserved on every rank holds: the batch buffers, and the managed-collision
    tables' state (Note [pricing managed collisions] in planners/mc_cost.py) where there are any."""
    if any(t.managed_collision is not None for _, t in table_set):
        return "batch buffers and managed-collision state"
    return "batch buffers"


def before_candidates(
    table_set: TableSet,
    constraints: Sequence[TableConstraint | None],
    model: CostModel,
    base_memory: float,
) -> NoPlanError | None:
    """Checks 1 and 2, which need no candidates: the batch buffers, and all weights against all
    ranks. One pass over the tables, so a hopeless input fails in well under a second."""
    topo = model.topology
    world, cap, batch = topo.world_size, float(topo.capacity), model.batch_size
    room = cap - base_memory  # what a rank has for shards
    where = _where(model)
    names = [display_name(f, t.name) for f, t in table_set]

    # 1. The batch buffers alone (every rank's own ids and pooled bags) do not fit. They grow
    # linearly with the batch, so the largest batch whose buffers leave some room is
    # ceil(cap / per_sample) - 1; at batch size 1 there is no smaller batch to suggest.
    if room <= 0:
        # the managed-collision slots do not shrink with the batch (Note [pricing managed collisions])
        slots = float(collision_price([t for _, t in table_set], model).slots.max(initial=0.0))
        per_sample = (base_memory - slots) / batch
        most = math.ceil((cap - slots) / per_sample) - 1
        if slots >= cap:
            way = (f"the managed-collision tables' slots alone take {format_bytes(slots)} per "
                   "rank; more ranks (they split over every rank) or smaller zch_size")  # fmt: skip
        elif most >= 1:
            way = f"use a batch size of at most {most} (buffers {format_bytes(per_sample)} per sample)"
        else:
            way = (f"even one sample's buffers ({format_bytes(per_sample)}) do not fit, so no "
                   "batch size helps; fewer or narrower tables")  # fmt: skip
        return NoPlanError(
            f"no plan fits: the {_buffers(table_set)} of {plural(len(table_set), 'table')} at batch size "
            f"{batch} need {format_bytes(base_memory)} per rank but {where}; {way}, or devices "
            "with more memory",
            names,
        )

    # 2. All tables together need more memory than all ranks have.
    foot = _footprints(table_set, model.optimizer, constraints)
    if foot.sum() > world * room:
        need = math.ceil(foot.sum() / room)
        big = np.argsort(-foot, kind="stable")[:5]
        biggest = ", ".join(f"{names[i]} ({format_bytes(foot[i])})" for i in big)
        ways = [f"use at least {need} ranks", "devices with more memory"]
        if any(t.dtype is DataType.FP32 for _, t in table_set):
            ways.append("fp16 weights (half the bytes; modular.shard takes them: DataType.FP16)")
        ways += _lighter_optimizers(model.optimizer)
        return NoPlanError(
            f"no plan fits: the tables need {format_bytes(foot.sum())} of weights and optimizer "
            f"state ({model.optimizer.value}) but {world} ranks have {format_bytes(world * room)} "
            f"for them ({format_bytes(room)} each after {format_bytes(base_memory)} of "
            f"{_buffers(table_set)}), {format_bytes(foot.sum() - world * room)} short; largest: {biggest}; "
            f"ways out: {'; '.join(ways)}",
            [names[i] for i in big],
        )
    return None


def before_search(
    table_set: TableSet,
    candidates: Candidates,
    constraints: Sequence[TableConstraint | None],
    model: CostModel,
    base_memory: float,
) -> NoPlanError | None:
    """Checks 3 to 5, from the candidates: a table that fits on no rank in any allowed type,
    tables that may only be data-parallel, tables pinned to ranks too small for them together."""
    topo = model.topology
    world, cap = topo.world_size, float(topo.capacity)
    room = cap - base_memory
    where = _where(model)
    names = [display_name(f, t.name) for f, t in table_set]

    # 3. Tables none of whose allowed candidates has a shard that fits on an empty rank.
    stuck = np.flatnonzero(~candidates.any_valid())
    if len(stuck):
        order = sorted(stuck, key=lambda i: (-_foot(table_set, model, constraints, i), i))
        lines = [_stuck_line(table_set[i], constraints[i], candidates, i, model, room, base_memory)
                 for i in order[:_LISTED]]  # fmt: skip
        if len(order) > _LISTED:
            lines.append(f"  ... and {plural(len(order) - _LISTED, 'more table')}")
        return NoPlanError(
            f"no plan fits: {plural(len(order), 'table')} cannot fit on any rank; {where}, of which "
            f"{format_bytes(base_memory)} holds the {_buffers(table_set)}:\n" + "\n".join(lines),
            [names[i] for i in order],
        )

    # 4. Tables that may only be data-parallel, whose copies together do not fit one rank: a
    # copy is on every rank, so more ranks do not help.
    dp = candidates.columns.index((ShardingType.DATA_PARALLEL, world))
    only_dp = [i for i in range(len(table_set))
               if candidates.valid[i, dp] and candidates.valid[i].sum() == 1
               and candidates.row_wise.lo[i] > candidates.row_wise.hi[i]]  # fmt: skip
    copies = float(sum(candidates.max_memory[i, dp] for i in only_dp))
    if only_dp and copies > room:
        order = sorted(only_dp, key=lambda i: (-candidates.max_memory[i, dp], i))
        lines = [f"  {names[i]!r}: {format_bytes(candidates.max_memory[i, dp])} a copy"
                 for i in order[:_LISTED]]  # fmt: skip
        if len(order) > _LISTED:
            lines.append(f"  ... and {plural(len(order) - _LISTED, 'more table')}")
        return NoPlanError(
            f"no plan fits: {plural(len(only_dp), 'table')} may only be data_parallel, which "
            f"keeps a whole copy (weights, optimizer state, dense gradient) on every rank: "
            f"{format_bytes(copies)} per rank, but {where} and {format_bytes(base_memory)} of "
            f"it holds the {_buffers(table_set)}; more ranks do not help: allow table_wise or row_wise "
            "for some of them, or devices with more memory:\n" + "\n".join(lines),
            [names[i] for i in order],
        )

    # 5. Tables pinned to some ranks that together need more than those ranks have (a
    # placement's pins are its only ranks, so no packing can help).
    over = _pinned_over(table_set, constraints, model.optimizer, room)
    if over is not None:
        ranks, members, need = over
        order = sorted(members, key=lambda i: (-_foot(table_set, model, constraints, i), i))
        lines = [f"  {names[i]!r}: {format_bytes(_foot(table_set, model, constraints, i))}"
                 for i in order[:_LISTED]]  # fmt: skip
        if len(order) > _LISTED:
            lines.append(f"  ... and {plural(len(order) - _LISTED, 'more table')}")
        have = len(ranks) * room
        held = f"rank {ranks[0]} has" if len(ranks) == 1 else f"those {len(ranks)} ranks have"
        return NoPlanError(
            f"no plan fits: {plural(len(members), 'table')} pinned to {_ranks_text(ranks)} need "
            f"{format_bytes(need)} of weights and optimizer state, but {held} "
            f"{format_bytes(have)} for them ({format_bytes(room)} each after "
            f"{format_bytes(base_memory)} of {_buffers(table_set)}), {format_bytes(need - have)} short; "
            f"ways out: pin them to at least {math.ceil(need / room)} ranks, unpin some of "
            "them, or fp16 weights (half the bytes):\n" + "\n".join(lines),
            [names[i] for i in order],
        )
    return None


def _unplaced(table_set: TableSet, candidates: Candidates,
              constraints: Sequence[TableConstraint | None], model: CostModel,
              base_memory: float, unplaced: Sequence[int]) -> NoPlanError:  # fmt: skip
    """6. Each table fits alone and the total fits, but packing left some without room."""
    topo = model.topology
    world, room = topo.world_size, float(topo.capacity) - base_memory
    where = _where(model)
    names = [display_name(f, t.name) for f, t in table_set]
    foot = _footprints(table_set, model.optimizer, constraints)
    order = sorted(unplaced, key=lambda i: (-_foot(table_set, model, constraints, i), i))
    fill = foot.sum() / (world * room)
    lines = []
    for i in order[:_LISTED]:
        smallest = candidates.smallest_memory(i, allowed_only=False)
        pins = constraints[i].ranks if constraints[i] is not None else ()
        pinned = f", pinned to ranks {list(pins)}" if pins else ""
        lines.append(f"  {names[i]!r}: smallest shard {format_bytes(smallest)}{pinned}")
    if len(order) > _LISTED:
        lines.append(f"  ... and {plural(len(order) - _LISTED, 'more table')}")
    need = math.ceil(foot.sum() / (0.85 * room))
    return NoPlanError(
        f"no plan fits: the tables fill {100 * fill:.0f}% of the memory of {world} ranks and "
        f"{plural(len(order), 'table')} found no rank with room left ({where}); ways out: about {need} "
        f"ranks, unpin or allow row_wise/column_wise for the tables below, a smaller batch:\n"
        + "\n".join(lines),
        [names[i] for i in order],
    )


def _stuck_line(entry, con, candidates: Candidates, i: int, model: CostModel, room: float,
                base_memory: float) -> str:  # fmt: skip
    fqn, table = entry
    name = display_name(fqn, table.name)
    topo = model.topology
    smallest = candidates.smallest_memory(i, allowed_only=True)
    foot = table_footprint(table, model.optimizer, con)
    ways = []
    dim = table.embedding_dim
    if candidates.torchrec and dim % 4:
        ways.append(f"a width that is a multiple of 4 (e.g. {dim + 4 - dim % 4}): torchrec_compatible "
                    f"lets a {dim}-wide table only be data_parallel, as TorchRec's fused kernel "
                    "takes no other; or plan without it and convert with "
                    "to_torchrec(..., compute_kernel='dense')")  # fmt: skip
    splittable = (ShardingType.ROW_WISE, ShardingType.COLUMN_WISE)
    if con is not None and con.sharding_types and not any(con.allows(k) for k in splittable):
        ways.append(f"allow row_wise for {name!r}")
    if con is not None and con.max_shards is not None:
        ways.append(f"raise max_shards above {con.max_shards}")
    if con is not None and con.ranks:
        ways.append(f"pin it to more than {len(con.ranks)} ranks")
    ranks_needed = math.ceil(foot / room)
    if ranks_needed > topo.world_size:
        ways.append(f"at least {ranks_needed} ranks (row_wise over all of them)")
    elif con is None or con.allows(ShardingType.ROW_WISE):
        ways.append(f"row_wise over {ranks_needed}+ ranks")
    buffers = float(candidates.max_memory[i][0]) - foot  # ids and bags of the table-wise shard
    if buffers > 0.25 * room:
        ways.append(f"a smaller batch (its id and output buffers alone take {format_bytes(buffers)})")
    if table.dtype is DataType.FP32:
        ways.append("fp16 weights (DataType.FP16: half the bytes)")
    ways += _lighter_optimizers(model.optimizer)
    need = format_bytes(smallest) if np.isfinite(smallest) else "n/a (no allowed sharding type)"
    return (f"  {name!r} ({table.num_embeddings:_} rows x {table.embedding_dim}, "
            f"{table.dtype.value}, {format_bytes(foot)} with optimizer state): smallest allowed "
            f"shard needs {need} but a rank has {format_bytes(room)}; ways out: "
            f"{'; '.join(ways) or 'more memory per rank'}")  # fmt: skip


# Optimizer state per row of c columns (Optimizer.state_bytes_per_row), as the ways out name it.
_STATE_PER_ROW = {
    Optimizer.ADAGRAD: "4c", Optimizer.ADAM: "8c", Optimizer.LAMB: "8c",
    Optimizer.PARTIAL_ROWWISE_ADAM: "4c + 4", Optimizer.PARTIAL_ROWWISE_LAMB: "4c + 4",
}  # fmt: skip
# The lighter optimizers of the same kind, before row-wise Adagrad's 4 bytes a row.
_LIGHTER = {
    Optimizer.ADAM: (Optimizer.PARTIAL_ROWWISE_ADAM,),
    Optimizer.LAMB: (Optimizer.PARTIAL_ROWWISE_LAMB,),
}


def _lighter_optimizers(optimizer: Optimizer) -> list[str]:
    """Ways out through the optimizer: its state per row of c columns and lighter ones."""
    if optimizer not in _STATE_PER_ROW:  # sgd (none), rowwise_adagrad (4 bytes): nothing lighter
        return []
    lighter = [f"{o.value} ({_STATE_PER_ROW[o]} bytes)" for o in _LIGHTER.get(optimizer, ())]
    lighter.append(f"{Optimizer.ROWWISE_ADAGRAD.value} (4 bytes)")
    return [
        f"an optimizer with less state than {optimizer.value}'s {_STATE_PER_ROW[optimizer]} bytes "
        f"per row of c columns: {' or '.join(lighter)}"
    ]


def _foot(table_set: TableSet, model: CostModel, constraints: Sequence[TableConstraint | None],
          i: int) -> float:  # fmt: skip
    return table_footprint(table_set[i][1], model.optimizer, constraints[i])


def _footprints(table_set: TableSet, optimizer: Optimizer,
                constraints: Sequence[TableConstraint | None]) -> np.ndarray:  # fmt: skip
    return np.array([table_footprint(t, optimizer, c) for (_, t), c in zip(table_set, constraints)])


def _ranks_text(ranks: tuple[int, ...]) -> str:
    """'rank 0', 'ranks [0, 1, 2]' (the first 16 of more, then '...')."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    shown = ", ".join(str(r) for r in ranks[:16])
    return f"ranks [{shown}{', ...' if len(ranks) > 16 else ''}]"


_PIN_SETS = 256  # distinct pin sets up to which unions are checked set by set (else each alone)


def _pinned_over(table_set: TableSet, constraints: Sequence[TableConstraint | None],
                 optimizer: Optimizer, room: float) -> tuple[tuple[int, ...], list[int], float] | None:  # fmt: skip
    """The first pin set S (by size, then ranks) whose tables -- those pinned within S, so that
    they can only be on S -- need more than len(S) * room for weights and optimizer state:
    (S, those tables, their bytes); None if every pin set has room. A necessary condition
    only: it ignores buffers and how the shards cut."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, con in enumerate(constraints):
        if con is not None and con.ranks:
            groups.setdefault(con.ranks, []).append(i)
    if not groups:
        return None
    foot = {s: sum(table_footprint(table_set[i][1], optimizer, constraints[i]) for i in g)
            for s, g in groups.items()}  # fmt: skip
    sets = sorted(groups, key=lambda s: (len(s), s))
    whole = {s: frozenset(s) for s in sets}
    for s in sets:
        inside = ([t for t in sets if len(t) <= len(s) and whole[t] <= whole[s]]
                  if len(sets) <= _PIN_SETS else [s])  # fmt: skip
        need = sum(foot[t] for t in inside)
        if need > len(s) * room:
            return s, sorted(i for t in inside for i in groups[t]), need
    return None
