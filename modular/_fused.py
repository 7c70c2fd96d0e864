"""The fused-optimizer half of a sharded EBC: swapping kernels, and their state in and out.

See Note [fused tables] in modular/optim.py.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata

from modular._deferred import (
    ROW_FORM_IDS,
    ROW_FORM_ROWS,
    DeferredFusedKernel,
    ReplicaFusedKernel,
    RowStatsFusedKernel,
)
from modular._emulated import EmulatedFusedKernel
from modular._fused_state import StateForm, column_statistic_mismatch, local_piece
from modular._kernels import FusedKernel
from modular._comm import all_to_all
from modular._layout import odd_width
from modular._lookups import Lookup, gather_batch, gather_lengths
from planners.types import ShardingType, ShardSpec


class FusedTables:
    """Mixed into ShardedEmbeddingBagCollection; uses its layout, kernels and tables."""

    __slots__ = ()  # keeps the object layout of nn.Module, so shard() can swap a root EBC's class

    def fuse(self, config) -> None:
        """Swaps every kernel for a fused one (weights copied); called by `fuse_optimizer`.

        One kernel at a time, after the table weights (which alias the dense buffers) are let
        go: each dense buffer is freed once its fused twin holds the weights, so fusing needs
        one kernel's worth of extra memory, not a second copy of every shard.
        """
        if self.fused is not None:
            raise ValueError(f"module {self._module_fqn!r} is already fused")
        cw_rowwise = self._column_wise_rowwise_tables(config)
        layouts = {}
        for t, table in enumerate(self.layout.tables):
            holder = self.embedding_bags[table.name]
            weight = holder._parameters["weight"]
            if isinstance(weight, ShardedTensor):
                layouts[table.name] = (weight.metadata(), self._local_shard_metadata(t, weight))
            holder._parameters["weight"] = None
        del weight
        for kernels, is_local in ((self._kernels, False), (self._local_kernels, True)):
            for i in range(len(kernels)):
                old = kernels[i]
                new = self._fused_kernel(old.group, old.sizes, config, cw_rowwise, is_local)
                with torch.no_grad():
                    for a, b in zip(new.views, old.views):
                        a.copy_(b)
                kernels[i] = new
                del old
        self._become_fused(config, cw_rowwise, layouts)

    def _mark_fused(self, config, cw_rowwise) -> None:
        """Records the fused config and which kernels update at the end of backward."""
        self.fused = config
        self._cw_rowwise = cw_rowwise
        # Column-cut tables whose pieces keep their own row statistic (Note [fused tables]).
        self._per_piece = self._column_cut_tables(config) if config.per_shard_rows else ()
        self._emulated = [  # kernels with work at the end of backward
            k
            for k in (*self._kernels, *self._local_kernels)
            if isinstance(k, (EmulatedFusedKernel, DeferredFusedKernel))
        ]
        # A rank holding no shard of the column-wise tables still joins their statistics'
        # all-to-all (with nothing to send), or the ranks that hold them wait on it forever.
        self._end_of_backward = bool(self._emulated) or (bool(cw_rowwise) and not self._local_only)

    def _become_fused(self, config, cw_rowwise, layouts) -> None:
        """Points the tables at the fused kernels' weights (no collective: layouts are known)."""
        self._mark_fused(config, cw_rowwise)
        views = self._local_views()
        for t, table in enumerate(self.layout.tables):
            holder = self.embedding_bags[table.name]
            if table.name in layouts:
                metadata, local_metadata = layouts[table.name]
                local = [
                    Shard(tensor=views[(table.name, j)], metadata=shard_meta)
                    for j, shard_meta in local_metadata
                ]
                holder._parameters["weight"] = _sharded(local, _frozen(metadata), self._pg)
            else:
                holder._parameters["weight"] = views[(table.name, self._rank_shard(t))]
        self._replicate_data_parallel_kernels()

    def _column_wise_rowwise_tables(self, config) -> tuple[str, ...]:
        """The tables whose column pieces exchange row statistics (Note [row statistics across
        column shards]): none unless row-wise Adagrad keeps the exact statistic."""
        if config.per_shard_rows:
            return ()
        return self._column_cut_tables(config)

    def _column_cut_tables(self, config) -> tuple[str, ...]:
        """Tables cut into two or more column pieces, under row-wise Adagrad."""
        if not config.optimizer.rowwise():
            return ()
        return tuple(
            t.name
            for t, p, shards in zip(self.layout.tables, self.layout.placements, self.layout.shards)
            if p.sharding_type is ShardingType.COLUMN_WISE and len(shards) > 1
        )

    def _emulates(self, config, widths, deferred: bool) -> bool:
        """Whether a fused kernel over shards of these widths takes the torch emulation (Note
        [fused tables] in modular/optim.py); `deferred`: it must run fbgemm's backward ops
        itself (column-wise row statistics, replicas)."""
        on_cpu = self._device.type == "cpu"
        return (
            # fbgemm's CPU kernels ignore weight decay (fbgemm-gpu-cpu 1.8.0).
            (config.weight_decay > 0 and on_cpu)
            or any(odd_width(cols) for cols in widths)
            # Note [row statistics across column shards] and Note [fused replicas] run
            # fbgemm's CPU backward ops directly; other devices take the torch emulation.
            or (deferred and not on_cpu)
        )

    def _fused_kernel(self, group, sizes, config, cw_rowwise, is_local: bool):
        column_rows = any(table in cw_rowwise for table, _ in group.shards)
        replica = is_local and self._world > 1
        if self._emulates(config, [cols for _, cols in sizes], column_rows or replica):
            return EmulatedFusedKernel(group, sizes, self._device, config)
        if replica:
            return ReplicaFusedKernel(group, sizes, self._device, config)
        if column_rows:
            forms = tuple(
                None if table not in cw_rowwise else self._row_form(table, config)
                for table, _ in group.shards
            )
            return RowStatsFusedKernel(group, sizes, self._device, config, forms)
        return FusedKernel(group, sizes, self._device, config)

    def _row_form(self, table: str, config) -> str:
        """How every holder of column-wise `table` exchanges its row statistics: per id, unless
        one of its shards is emulated, whose statistics come per unique row (Note [row
        statistics across column shards])."""
        widths = [s.num_cols for s in self.layout.shards[self.layout.table_index(table)]]
        return ROW_FORM_ROWS if self._emulates(config, widths, True) else ROW_FORM_IDS

    def _local_shard_metadata(self, t: int, weight: ShardedTensor):
        out = []
        for j, spec in enumerate(self.layout.shards[t]):
            if spec.rank == self._rank:
                for shard in weight.local_shards():
                    if list(shard.metadata.shard_offsets) == [spec.row_offset, spec.col_offset]:
                        out.append((j, shard.metadata))
        return out

    def _rank_shard(self, t: int) -> int:
        return _index_of_rank(self.layout.shards[t], self._rank)

    def _kernel_states(self) -> dict[tuple[str, int], dict[str, torch.Tensor]]:
        states = {}
        for k in (*self._kernels, *self._local_kernels):
            for key, st in zip(k.group.shards, k.states):
                states[key] = st
        return states

    def fused_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Per table, its optimizer state: ShardedTensors laid out as Note [fused tables] says
        (like the weight; row-wise: one value per row, or per row and column piece), plain
        tensors for data-parallel tables."""
        if self.fused is None:
            return {}
        name = self.fused.optimizer.state_name()
        if name is None:
            return {t.name: {} for t in self.layout.tables}
        states = self._kernel_states()
        out = {}
        for t, table in enumerate(self.layout.tables):
            weight = self.embedding_bags[table.name]._parameters["weight"]
            if not isinstance(weight, ShardedTensor):
                out[table.name] = {name: states[(table.name, self._rank_shard(t))][name]}
                continue
            form, pieces = self._state_form(table.name), self._pieces(t)
            meta = _frozen(weight.metadata())
            meta = ShardedTensorMetadata(
                [s for m in meta.shards_metadata if (s := form.shard(m, pieces)) is not None],
                torch.Size(form.shape(table, len(pieces))),
                meta.tensor_properties,
            )
            local = []
            for j, shard_meta in self._local_shard_metadata(t, weight):
                state_meta = form.shard(shard_meta, pieces)
                if state_meta is None:
                    continue  # column shards after the first hold copies of the same rows
                tensor = states[(table.name, j)][name].view(state_meta.shard_sizes)
                local.append(Shard(tensor=tensor, metadata=state_meta))
            out[table.name] = {name: _sharded(local, meta, self._pg)}
        return out

    def _state_form(self, table: str) -> StateForm:
        if not self.fused.optimizer.rowwise():
            return StateForm.WEIGHT
        return StateForm.PIECES if table in self._per_piece else StateForm.ROWS

    def _pieces(self, t: int) -> dict[int, int]:
        """Column offset -> index of each column piece of table `t`, left to right."""
        offsets = sorted({s.col_offset for s in self.layout.shards[t]})
        return {offset: i for i, offset in enumerate(offsets)}

    @torch.no_grad()
    def load_fused_state(self, per_table: dict[str, dict[str, torch.Tensor]]) -> None:
        """Copies optimizer state into this rank's shards from full tensors or ShardedTensors
        laid out like `fused_state()` (any plan's, once DCP has resharded them)."""
        name = self.fused.optimizer.state_name() if self.fused is not None else None
        if name is None:
            return
        self.check_fused_state(per_table)  # every table before any is copied
        states = self._kernel_states()
        for t, table in enumerate(self.layout.tables):
            source = per_table[table.name][name]
            form, pieces = self._state_form(table.name), self._pieces(t)
            for j, spec in enumerate(self.layout.shards[t]):
                if spec.rank != self._rank:
                    continue
                target = states[(table.name, j)][name]
                if isinstance(source, ShardedTensor):
                    piece = local_piece(source, form, spec, pieces)
                    if piece is None:
                        target.zero_()  # filled by the all-reduce below
                        continue
                else:
                    piece = source[form.region(spec, pieces)]
                target.copy_(piece.view(target.shape))
            if table.name in self._cw_rowwise and isinstance(source, ShardedTensor):
                # every column shard needs the first one's row state
                self._sync_column_shard_rows(t, name, states)

    @torch.no_grad()
    def load_unsharded_fused_state(self, per_table: dict[str, dict[str, torch.Tensor]]) -> None:
        """Loads the state of this module's unsharded, fused twin (`modular.shard` after
        `fuse_optimizer`). A table that keeps a statistic per column piece (Note [fused tables])
        starts every piece from the whole row's, the only one an uncut table has (zero if it
        never trained)."""
        name = self.fused.optimizer.state_name()
        per_table = dict(per_table)
        for table in self._per_piece:
            pieces = len(self.layout.shards[self.layout.table_index(table)])
            rows = per_table[table][name]
            per_table[table] = {**per_table[table], name: rows.unsqueeze(1).expand(-1, pieces)}
        self.load_fused_state(per_table)

    def check_fused_state(self, per_table) -> None:
        """Every table's state has the whole table's shape as `fused_state()` lays it out,
        whatever this rank copies of it: a slice of a wrong-shaped tensor would copy."""
        where = f" in module {self._module_fqn!r}" if self._module_fqn else ""
        name = self.fused.optimizer.state_name()
        for t, table in enumerate(self.layout.tables):
            rows, dim = table.num_embeddings, table.embedding_dim
            if name not in per_table[table.name]:
                raise ValueError(
                    f"the optimizer state of table {table.name!r}{where} has no {name!r}, which "
                    f"fused {self.fused.optimizer.value!r} keeps; load the state this optimizer "
                    "saved"
                )
            got = tuple(per_table[table.name][name].size())
            pieces = len(self._pieces(t))
            form = self._state_form(table.name)
            expected = form.shape(table, pieces)
            if got == expected:
                continue
            what = f"optimizer state {name!r} of table {table.name!r}{where}"
            if self.fused.optimizer.rowwise():
                why = column_statistic_mismatch(
                    what, got, expected, self.fused.column_wise_statistic, dim
                )
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

    def _sync_column_shard_rows(self, t: int, name: str, states) -> None:
        table = self.layout.tables[t]
        acc = torch.zeros(table.num_embeddings, device=self._device)
        for j, spec in enumerate(self.layout.shards[t]):
            if spec.rank == self._rank and spec.col_offset == 0:
                acc += states[(table.name, j)][name]
        dist.all_reduce(acc, group=self._pg)
        for j, spec in enumerate(self.layout.shards[t]):
            if spec.rank == self._rank:
                states[(table.name, j)][name].copy_(acc)

    def _queue_emulated_updates(self, grad: torch.Tensor) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(self._apply_emulated_updates)

    def _apply_emulated_updates(self) -> None:
        """End of backward (Note [emulated fused kernels], Note [row statistics across column
        shards]): one all-to-all of the column-wise tables' row statistics, then the data-parallel
        gradients kernel by kernel (the same collectives in the same order on every rank), then
        each kernel's update on the rows it touched."""
        emulated = [k for k in self._emulated if isinstance(k, EmulatedFusedKernel)]
        two_pass = [k for k in self._emulated if isinstance(k, RowStatsFusedKernel)]
        grads = {id(k): k.take_pending() for k in emulated}
        stats = {id(k): k.row_stats() for k in two_pass}
        row_means: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        if self._cw_rowwise:
            row_means = self._column_row_means(emulated, grads, two_pass, stats)
        for k in emulated:
            g = grads[id(k)]
            if k in self._local_kernels and self._world > 1:
                g = k.all_gather_mean(g, world=self._world, group=self._pg)
            means = [row_means.get(name) for name, _ in k.group.shards]
            k.apply(g, [None if m is None else m[1] for m in means])
        for k in two_pass:
            if stats[id(k)] is None:
                continue
            k.update(
                [
                    None if piece is None or table not in row_means
                    else (piece[0], row_means[table][1] - piece[1])
                    for (table, _), piece in zip(k.group.shards, stats[id(k)])
                ]
            )  # fmt: skip
        for k in self._emulated:
            if isinstance(k, ReplicaFusedKernel):
                batch = self._global_batch(k, k.take_batch())
                if batch is not None:
                    k.run_backward(batch)

    def _global_batch(self, k: ReplicaFusedKernel, mine: Optional[Lookup]) -> Optional[Lookup]:
        """Every rank's lookup batch for replica kernel `k`, merged in rank order, gradients
        divided by the world size (Note [fused replicas]); the same collectives on every rank."""
        if mine is None:  # no lookup on any rank: forward ran on all or none
            return None
        lengths = gather_lengths(mine, self._pg, self._world)
        return gather_batch(mine, lengths, len(k.group.routes), self._pg, self._world)

    def _column_row_means(self, emulated, grads, two_pass, stats):
        """Per column-wise table this rank holds, its rows (one per id, or per touched row) and
        the whole row's mean of grad**2 on each (Note [row statistics across column shards]):
        this rank's shards' sums of g**2, plus those of the other ranks holding the table,
        exchanged in one all-to-all (every rank calls it; a rank sends a peer one float per row
        of each table both hold, tables in `_cw_rowwise` order)."""
        local: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for k in emulated:
            for t, ((table, _), g) in enumerate(zip(k.group.shards, grads[id(k)])):
                if table in self._cw_rowwise:
                    if g is None:
                        rows = torch.zeros(0, dtype=torch.int64, device=self._device)
                        local.setdefault(table, []).append((rows, rows.float()))
                    else:
                        decayed = k.decayed(t, g)
                        local.setdefault(table, []).append((g.rows, (decayed * decayed).sum(1)))
        for k in two_pass:
            pieces = stats[id(k)]
            for (table, _), (_, cols), piece in zip(k.group.shards, k.sizes, pieces or ()):
                if piece is not None:  # a column-wise table's (rows, s): one per id or per row
                    rows, s = piece
                    local.setdefault(table, []).append((rows, s * cols))  # s: mean over cols
        mine: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for table, parts in local.items():
            rows, total = parts[0][0], parts[0][1].clone()
            for other_rows, part in parts[1:]:  # this rank's other shards: the same rows
                if other_rows.numel() != rows.numel():
                    raise RuntimeError(
                        f"column shards of table {table!r} on rank {self._rank} reported "
                        f"{rows.numel()} and {other_rows.numel()} row statistics in one step; "
                        "they look up the same ids and must agree"
                    )
                total += part
            mine[table] = (rows, total)
        holders = {
            name: {spec.rank for spec in self.layout.shards[self.layout.table_index(name)]}
            for name in self._cw_rowwise
        }
        shared = [  # per peer, the tables both hold, in _cw_rowwise order
            [n for n in self._cw_rowwise if n in mine and p in holders[n]] if p != self._rank
            else []
            for p in range(self._world)
        ]
        splits = [sum(mine[n][0].numel() for n in names) for names in shared]
        if any(splits):
            send = torch.cat([mine[n][1] for names in shared for n in names])
        else:
            send = torch.zeros(0, device=self._device)
        if not self._local_only:
            received = all_to_all(
                send, input_splits=splits, output_splits=splits, group=self._pg,
                what="the all-to-all of column-wise row statistics",
            )  # fmt: skip
            for names, chunk in zip(shared, received.split(splits)):
                for n, piece in zip(names, chunk.split([mine[n][0].numel() for n in names])):
                    mine[n][1].add_(piece)
        return {
            n: (rows, total.div_(self.layout.table(n).embedding_dim))
            for n, (rows, total) in mine.items()
        }


def _frozen(metadata: ShardedTensorMetadata) -> ShardedTensorMetadata:
    """The same layout for tensors that take no gradient (fused weights, optimizer state)."""
    props = dataclasses.replace(metadata.tensor_properties, requires_grad=False)
    return dataclasses.replace(metadata, tensor_properties=props)


def _sharded(local: list[Shard], metadata: ShardedTensorMetadata, group) -> ShardedTensor:
    """A ShardedTensor from known global metadata (no collective: the plan is already agreed)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            local, metadata, process_group=group
        )


def _index_of_rank(shards: tuple[ShardSpec, ...], rank: int) -> int:
    for j, s in enumerate(shards):
        if s.rank == rank:
            return j
    raise KeyError(rank)
