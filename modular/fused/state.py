"""A fused module's optimizer state: how it is laid out, read, written and checked.

See Note [fused tables] in modular/fused/choice.py. The functions take the module's `FusedTables`
(and, to read, its table weights, whose layout the state follows).
"""

from __future__ import annotations

import dataclasses

import enum
from typing import Optional

import torch
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata

from modular.comm import all_reduce
from modular.fused.config import ColumnWiseStatistic
from modular.fused.tables import FusedTables
from modular.tables.forms import dtensor_from_pieces, is_sharded, local_pieces
from modular.tables.weights import frozen, local_shard_metadata, sharded_from_metadata
from planners.types import ShardingType, ShardSpec

__all__ = [
    "StateForm",
    "check_fused_state",
    "column_statistic_mismatch",
    "fused_state",
    "load_fused_state",
    "load_unsharded_fused_state",
    "local_piece",
]


class StateForm(enum.Enum):
    """How a table's optimizer state is laid out (Note [fused tables] in modular/fused/choice.py)."""

    WEIGHT = "weight"  # like the weight (Adagrad's `sum`)
    ROWS = "rows"  # one value per row (row-wise Adagrad)
    PIECES = "pieces"  # one per row and column piece: (rows, pieces), column j is piece j's

    def shape(self, table, pieces: int) -> tuple[int, ...]:
        rows = table.num_embeddings
        return {
            StateForm.WEIGHT: (rows, table.embedding_dim),
            StateForm.ROWS: (rows,),
            StateForm.PIECES: (rows, pieces),
        }[self]

    def offsets(self, spec: ShardSpec, pieces: dict[int, int]) -> list[int]:
        """Where shard `spec`'s state starts in the table's state."""
        if self is StateForm.WEIGHT:
            return [spec.row_offset, spec.col_offset]
        if self is StateForm.ROWS:
            return [spec.row_offset]
        return [spec.row_offset, pieces[spec.col_offset]]

    def region(self, spec: ShardSpec, pieces: dict[int, int]) -> tuple:
        """Shard `spec`'s state in the table's whole state tensor (an index)."""
        rows = slice(spec.row_offset, spec.row_offset + spec.num_rows)
        if self is StateForm.WEIGHT:
            return rows, slice(spec.col_offset, spec.col_offset + spec.num_cols)
        if self is StateForm.ROWS:
            return (rows,)
        return rows, pieces[spec.col_offset]

    def shard(self, m: ShardMetadata, pieces: dict[int, int]) -> Optional[ShardMetadata]:
        """The state's shard for the weight's shard `m`; None for a row-wise table's column
        shards after the first, which hold copies of the first one's rows."""
        (row, col), (rows, _) = m.shard_offsets, m.shard_sizes
        if self is StateForm.WEIGHT:
            return m
        if self is StateForm.ROWS:
            return None if col != 0 else ShardMetadata([row], [rows], m.placement)
        return ShardMetadata([row, pieces[col]], [rows, 1], m.placement)


def column_statistic_mismatch(
    what: str,
    got: tuple[int, ...],
    expected: tuple[int, ...],
    statistic: ColumnWiseStatistic,
    dim: int,
) -> Optional[str]:
    """Why row-wise Adagrad state of shape `got` cannot load where shape `expected` is kept, if
    the two differ in column pieces only: one statistic per row (exact, or a table not cut into
    column pieces) against one per row and piece (`column_wise_statistic="per_shard"`), or
    another number of pieces. None when they differ otherwise (another table size, or a state
    as wide as the `dim`-column table, Adagrad's)."""
    if got == expected or {len(got), len(expected)} - {1, 2} or got[0] != expected[0]:
        return None
    if any(len(shape) == 2 and shape[1] >= dim for shape in (got, expected)):
        return None
    exact = statistic is ColumnWiseStatistic.EXACT

    def held(shape: tuple[int, ...]) -> str:
        if len(shape) == 1:
            return "one statistic per row, over all its columns"
        return f"one statistic per row for each of {shape[1]} column pieces"

    if len(got) == 1:
        saved = "column_wise_statistic='exact', or the table not cut into column pieces"
    else:
        saved = "column_wise_statistic='per_shard' on a plan that cut the table so"
    if len(expected) == 2:
        keeps = "column_wise_statistic='per_shard' on this plan"
    elif exact:
        keeps = "column_wise_statistic='exact'"
    else:
        keeps = "this plan does not cut the table into column pieces"
    if len(expected) == 2 and len(got) == 1:
        fix = (
            "fuse with column_wise_statistic='exact', or shard the table without cutting its "
            "columns, to load it (a piece's own statistic cannot be recovered from the whole "
            "row's)"
        )
    elif exact:
        fix = (
            f"fuse with column_wise_statistic='per_shard' and shard the table into {got[1]} "
            "column pieces, as when it was saved, to load it"
        )
    else:
        fix = (
            f"shard the table into {got[1]} column pieces, as when it was saved, to load it "
            "(per-piece statistics belong to the pieces that made them)"
        )
    return (
        f"{what} has shape {got}, {held(got)} ({saved}), but this optimizer keeps {expected}, "
        f"{held(expected)} ({keeps}); {fix}"
    )


def local_piece(
    source: torch.Tensor, form: StateForm, spec: ShardSpec, pieces: dict[int, int]
) -> Optional[torch.Tensor]:
    """The local shard of `source` (a ShardedTensor or a table DTensor) that holds `spec`'s
    state, or None (row-wise column copies)."""
    want = tuple(form.offsets(spec, pieces))
    for piece in local_pieces(source):
        if piece.offsets == want:
            return piece.tensor
    if form is StateForm.ROWS and spec.col_offset != 0:
        return None
    raise ValueError(
        f"optimizer state has no local shard at offsets {want}; load it through "
        "modular.checkpoint (DCP reshards it to this plan)"
    )


def _state_form(fused: FusedTables, table: str, name: str) -> StateForm:
    if not fused.config.optimizer.row_state(name):
        return StateForm.WEIGHT
    return StateForm.PIECES if table in fused.per_piece else StateForm.ROWS


def _pieces(fused: FusedTables, t: int) -> dict[int, int]:
    """Column offset -> index of each column piece of table `t`, left to right."""
    offsets = sorted({s.col_offset for s in fused.at.layout.shards[t]})
    return {offset: i for i, offset in enumerate(offsets)}


def fused_state(
    fused: FusedTables, weights: dict[str, torch.Tensor]
) -> dict[str, dict[str, torch.Tensor]]:
    """Per table, its optimizer state: ShardedTensors laid out as Note [fused tables] says (like
    the table's weight in `weights`; row-wise: one value per row, or per row and column piece),
    plain tensors for data-parallel tables; the Adam family's `step` too, a plain scalar (Note
    [fused Adam and LAMB] in modular/fused/adam.py)."""
    layout = fused.at.layout
    states = fused.states()
    out: dict[str, dict[str, torch.Tensor]] = {t.name: {} for t in layout.tables}
    for t, table in enumerate(layout.tables):
        for name in fused.config.optimizer.state_names():
            out[table.name][name] = _table_state(fused, t, name, weights[table.name], states)
        if fused.config.optimizer.adam_family():
            out[table.name]["step"] = torch.tensor(fused.steps.value, dtype=torch.int64)
    return out


def _table_state(
    fused: FusedTables, t: int, name: str, weight: torch.Tensor, states
) -> torch.Tensor:
    """Table `t`'s state `name`, laid out like its `weight` (`fused_state`)."""
    layout, at = fused.at.layout, fused.at
    table = layout.tables[t]
    if not is_sharded(weight):
        return states[(table.name, at.shard_of_rank(t))][name]
    form, pieces = _state_form(fused, table.name, name), _pieces(fused, t)
    if not isinstance(weight, ShardedTensor):  # a DTensor (Note [table tensor types])
        return _dtensor_state(fused, t, form, pieces, states, name)
    meta = frozen(weight.metadata())
    meta = ShardedTensorMetadata(
        [s for m in meta.shards_metadata if (s := form.shard(m, pieces)) is not None],
        torch.Size(form.shape(table, len(pieces))),
        # FP32 whatever the table's dtype (Note [low-precision tables]).
        dataclasses.replace(meta.tensor_properties, dtype=torch.float32),
    )
    local = []
    for j, shard_meta in local_shard_metadata(layout.shards[t], at.rank, weight):
        state_meta = form.shard(shard_meta, pieces)
        if state_meta is None:
            continue  # column shards after the first hold copies of the same rows
        tensor = states[(table.name, j)][name].view(state_meta.shard_sizes)
        local.append(Shard(tensor=tensor, metadata=state_meta))
    return sharded_from_metadata(local, meta, at.group)


def _dtensor_state(
    fused: FusedTables, t: int, form: StateForm, pieces: dict[int, int], states, name: str
) -> torch.Tensor:
    """Table `t`'s state `name` as a DTensor laid out like its weight's (Note [fused tables])."""
    layout, at = fused.at.layout, fused.at
    table = layout.tables[t]
    local = []
    for j, spec in enumerate(layout.shards[t]):
        if spec.rank != at.rank or (form is StateForm.ROWS and spec.col_offset != 0):
            continue  # column shards after the first hold copies of the same rows
        sizes = {
            StateForm.WEIGHT: (spec.num_rows, spec.num_cols),
            StateForm.ROWS: (spec.num_rows,),
            StateForm.PIECES: (spec.num_rows, 1),
        }[form]
        local.append((tuple(form.offsets(spec, pieces)), states[(table.name, j)][name].view(sizes)))
    column_wise = form is StateForm.WEIGHT and layout.placements[t].sharding_type is (
        ShardingType.COLUMN_WISE
    )
    return dtensor_from_pieces(
        local, form.shape(table, len(pieces)), group=at.group, device=at.device,
        column_wise=column_wise, replicas=at.replicas,
    )  # fmt: skip


@torch.no_grad()
def load_fused_state(fused: FusedTables, per_table: dict[str, dict[str, torch.Tensor]]) -> None:
    """Copies optimizer state into this rank's shards from full tensors or ShardedTensors laid
    out like `fused_state()` (any plan's, once DCP has resharded them), and the Adam family's
    step count."""
    kind = fused.config.optimizer
    if not kind.state_names():
        return
    check_fused_state(fused, per_table)  # every table before any is copied
    layout, rank = fused.at.layout, fused.at.rank
    states = fused.states()
    for t, table in enumerate(layout.tables):
        for name in kind.state_names():
            source = per_table[table.name][name]
            form, pieces = _state_form(fused, table.name, name), _pieces(fused, t)
            for j, spec in enumerate(layout.shards[t]):
                if spec.rank != rank:
                    continue
                target = states[(table.name, j)][name]
                if is_sharded(source):
                    piece = local_piece(source, form, spec, pieces)
                    if piece is None:
                        target.zero_()  # filled by the all-reduce below
                        continue
                else:
                    piece = source[form.region(spec, pieces)]
                target.copy_(piece.view(target.shape))
            if form is StateForm.ROWS and table.name in fused.column_rowwise and is_sharded(source):
                # every column shard needs the first one's row state
                _sync_column_shard_rows(fused, t, name, states)
    if kind.adam_family():
        fused.steps.value = int(per_table[layout.tables[0].name]["step"])


@torch.no_grad()
def load_unsharded_fused_state(
    fused: FusedTables, per_table: dict[str, dict[str, torch.Tensor]]
) -> None:
    """Loads the state of the module's unsharded, fused twin (`modular.shard` after
    `fuse_optimizer`). A table that keeps a statistic per column piece (Note [fused tables])
    starts every piece from the whole row's, the only one an uncut table has (zero if it never
    trained)."""
    layout = fused.at.layout
    per_table = dict(per_table)
    for table in fused.per_piece:
        pieces = len(layout.shards[layout.table_index(table)])
        name = "row_sum"  # per_piece: row-wise Adagrad's per_shard statistic only
        rows = per_table[table][name]
        per_table[table] = {**per_table[table], name: rows.unsqueeze(1).expand(-1, pieces)}
    load_fused_state(fused, per_table)


def check_fused_state(fused: FusedTables, per_table) -> None:
    """Every table's state has the whole table's shape as `fused_state()` lays it out, whatever
    this rank copies of it: a slice of a wrong-shaped tensor would copy. The Adam family's step
    counts must be one count, a module's (Note [fused Adam and LAMB])."""
    module, optimizer = fused.at.module, fused.config.optimizer
    where = f" in module {module!r}" if module else ""
    steps: dict[str, int] = {}
    for t, table in enumerate(fused.at.layout.tables):
        names = optimizer.state_names() + (("step",) if optimizer.adam_family() else ())
        for name in names:
            if name not in per_table[table.name]:
                raise ValueError(
                    f"the optimizer state of table {table.name!r}{where} has no {name!r}, which "
                    f"fused {optimizer.value!r} keeps; load the state this optimizer saved"
                )
        for name in optimizer.state_names():
            _check_shape(fused, t, name, tuple(per_table[table.name][name].size()), where)
        if optimizer.adam_family():
            step = per_table[table.name]["step"]
            if step.numel() != 1:
                raise ValueError(
                    f"optimizer state 'step' of table {table.name!r}{where} has shape "
                    f"{tuple(step.shape)}, not one count; load the state this optimizer saved"
                )
            steps[table.name] = int(step)
    if len(set(steps.values())) > 1:
        raise ValueError(
            f"the step counts of the tables{where} differ ({steps}), but a module's tables share "
            "one (it corrects Adam's moments); load the state one module saved"
        )


def _check_shape(fused: FusedTables, t: int, name: str, got: tuple[int, ...], where: str) -> None:
    optimizer = fused.config.optimizer
    table = fused.at.layout.tables[t]
    rows, dim = table.num_embeddings, table.embedding_dim
    pieces = len(_pieces(fused, t))
    form = _state_form(fused, table.name, name)
    expected = form.shape(table, pieces)
    if got == expected:
        return
    what = f"optimizer state {name!r} of table {table.name!r}{where}"
    if optimizer.rowwise():
        statistic = fused.config.column_wise_statistic
        why = column_statistic_mismatch(what, got, expected, statistic, dim)
        if why is not None:
            raise ValueError(why)
    per = {
        StateForm.WEIGHT: "one value per weight",
        StateForm.ROWS: "one value per row",
        StateForm.PIECES: f"one value per row of each of its {pieces} column pieces",
    }[form]
    raise ValueError(
        f"{what} has shape {got}, but this optimizer keeps {expected} ({per} of the "
        f"{rows} x {dim} table); load the state saved for this table by the same fused "
        "optimizer"
    )


def _sync_column_shard_rows(fused: FusedTables, t: int, name: str, states) -> None:
    layout, at = fused.at.layout, fused.at
    table = layout.tables[t]
    acc = torch.zeros(table.num_embeddings, device=at.device)
    for j, spec in enumerate(layout.shards[t]):
        if spec.rank == at.rank and spec.col_offset == 0:
            acc += states[(table.name, j)][name]
    all_reduce(acc, group=at.group, what=f"the row statistic of table {table.name!r}")
    for j, spec in enumerate(layout.shards[t]):
        if spec.rank == at.rank:
            states[(table.name, j)][name].copy_(acc)
