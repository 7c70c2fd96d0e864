"""`unshard`: a sharded model's tables as full tensors for a while, written back on exit.

    with modular.unshard(model, tables=["ads_id"]) as full:
        full["sparse.embedding_bags.ads_id.weight"][:1000] = imported_rows   # in place
    # the shards, the next forward and the fused optimizer now use the new rows

Both kinds of sharded collection are unsharded alike: an EmbeddingBagCollection's tables under
`embedding_bags.<table>.weight`, an EmbeddingCollection's under `embeddings.<table>.weight`
(the attribute is the kind's, `tables_name`), whether the tables are ShardedTensors or DTensors:
what moves is each rank's shards (`local_shard_views`, the kernels' own weights), never the
tensor type that shows them.

# Note [unshard memory]
Tables are gathered one at a time, shard by shard, each shard received straight into its slice
of the full table (a column shard, not contiguous there, through one shard-sized buffer). Inside
the context every selected table is held in full, so the peak on a rank that holds them (every
rank, or rank 0 with `rank0_only`) is the sum of the selected tables' full sizes plus one shard
in flight, on the CPU with `offload_to_cpu` (the default), else on the tables' device. Naming
fewer `tables` lowers it; `writeback` allocates nothing more (each rank copies its slices out of
the full tables, or with `rank0_only` rank 0 sends each shard to its owner, one at a time).

# Note [agreeing on unshard]
Entry and exit each start with one small all-gather per sharded module, over its process group,
that every member joins: on entry each rank's selection of tables (ranks that select differently
raise before any table moves), on exit each rank's verdict (a table whose shape changed inside,
or an exception raised inside the `with` body). If any rank has a problem, every rank restores
its shards untouched and raises, naming the table or rank, so no rank is left alone in the
writeback's collectives.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from modular.collection import ShardedCollectionModule
from modular.comm import broadcast, collective_device, recv, send
from modular.errors import ShardingError
from modular.sharded_types import tables_name
from modular.optim import fuse_marked
from modular.sharding import sharded_modules
from planners.types import ShardingType, ShardSpec

__all__ = ["unshard"]


@contextlib.contextmanager
def unshard(
    model: nn.Module,
    *,
    tables: Optional[Iterable[str]] = None,
    rank0_only: bool = False,
    writeback: bool = True,
    offload_to_cpu: bool = True,
) -> Iterator[dict[str, torch.Tensor]]:
    """Holds the full tensors of the sharded tables of `model` for the `with` block.

    Collective: every rank of each sharded module's process group enters it. Inside, each
    selected table's weight (`model.<...>.embedding_bags.<table>.weight` of an
    EmbeddingBagCollection, `model.<...>.embeddings.<table>.weight` of an EmbeddingCollection)
    is its full tensor, in the table's dtype, and the context yields them by FQN; with
    `rank0_only` only the group's rank 0 holds them (the other ranks get an empty dict and keep
    their shards). Change them in place (or assign a tensor of the same shape to the weight): on
    exit with `writeback` each rank copies its
    shards' slices back (with `rank0_only`, rank 0 sends every shard its rows), so the next
    forward, its gradients and the fused optimizer use the new values. The fused optimizer's
    state is left as it is. Change a table the same way on every rank, or use `rank0_only`:
    each rank writes its own shards from its own copy.

    `tables` names the tables to gather, by weight FQN or by table name (every sharded table when
    None). Memory: Note [unshard memory]. A forward inside the block still reads the shards.
    Changing a table's shape, or an exception inside the block on any rank, raises on every rank
    and writes nothing back (Note [agreeing on unshard]).
    """
    fuse_marked(model)  # a one-process model's fused tables (Note [fusing at shard])
    modules = list(sharded_modules(model))
    if not modules:
        raise ShardingError(
            "modular.unshard: the model has no sharded EmbeddingBagCollection or "
            "EmbeddingCollection (call modular.shard first)"
        )
    selected = _select(modules, tables)
    held: list[_Held] = []
    for fqn, module in modules:  # the same order on every rank: gathering is collective
        held.append(_Held(fqn, module, selected[fqn], rank0_only=rank0_only))
    try:
        for h in held:
            h.gather(offload_to_cpu)
    except BaseException:
        for h in held:
            h.restore()
        raise
    raised: Optional[BaseException] = None
    try:
        yield {name: t for h in held for name, t in h.full_by_fqn().items()}
    except BaseException as e:  # every rank must learn of it before anyone writes back
        raised = e
    problems = []
    try:
        for h in held:
            problem = h.agree(raised)
            if problem is None and writeback:
                h.write_back()
            elif problem is not None:
                problems.append(problem)
    finally:
        for h in held:
            h.restore()
    if raised is not None:
        raise raised
    if problems:
        raise ShardingError(problems[0])


def _select(
    modules: list[tuple[str, ShardedCollectionModule]], tables: Optional[Iterable[str]]
) -> dict[str, list[str]]:
    """Module FQN -> the names of its tables to gather, from weight FQNs or table names."""
    by_fqn = {}
    attr = {fqn: tables_name(module) for fqn, module in modules}
    for fqn, module in modules:
        for t in module.layout.tables:
            by_fqn[_weight_fqn(fqn, attr[fqn], t.name)] = (fqn, t.name)
    if tables is None:
        chosen = set(by_fqn.values())
    else:
        if isinstance(tables, str):
            raise ShardingError(
                f"modular.unshard(tables={tables!r}): pass a list of table names or weight FQNs, "
                f"e.g. tables=[{tables!r}]"
            )
        chosen = set()
        for name in tables:
            if name in by_fqn:
                chosen.add(by_fqn[name])
                continue
            matches = [key for key in by_fqn.values() if key[1] == name]
            if len(matches) != 1:
                why = "is not a sharded table of the model" if not matches else (
                    "names tables of several modules: "
                    + ", ".join(repr(_weight_fqn(m, attr[m], t)) for m, t in matches)
                )
                raise ShardingError(
                    f"modular.unshard: {name!r} {why}; name a table by its weight FQN, one of "
                    f"{sorted(by_fqn)}"
                )
            chosen.add(matches[0])
    return {
        fqn: [t.name for t in module.layout.tables if (fqn, t.name) in chosen]
        for fqn, module in modules
    }


def _weight_fqn(module: str, attr: str, table: str) -> str:
    """A table's weight FQN: `<module>.<attr>.<table>.weight`, `attr` its kind's (`tables_name`)."""
    return f"{module}.{attr}.{table}.weight" if module else f"{attr}.{table}.weight"


class _Held:
    """One sharded module's selected tables while they are unsharded."""

    def __init__(
        self, fqn: str, module: ShardedCollectionModule, names: list[str], *, rank0_only: bool
    ) -> None:
        self.fqn, self.module, self.names = fqn, module, names
        self.attr = tables_name(module)  # `embedding_bags` or `embeddings`
        self.holders: nn.ModuleDict = getattr(module, self.attr)
        self.local = module.is_local  # every table whole on every rank, nothing to send
        self.group: Optional[ProcessGroup] = module.process_group
        self.rank = 0 if self.local else dist.get_rank(self.group)
        self.rank0_only = rank0_only
        self.holds = not rank0_only or self.rank == 0
        self.sharded = module.table_weights()  # restored on exit
        self.full: dict[str, torch.Tensor] = {}
        self.views = module.local_shard_views()
        self.comm_device = torch.device("cpu") if self.local else collective_device(self.group)
        self._agree_on_selection()

    def _agree_on_selection(self) -> None:
        if self.local:
            return
        chosen: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(chosen, self.names, group=self.group)
        if any(c != self.names for c in chosen):
            listing = "; ".join(f"rank {r}: {c}" for r, c in enumerate(chosen))
            raise ShardingError(
                f"modular.unshard: the ranks of module {self.fqn!r} select different tables "
                f"({listing}); pass the same `tables` on every rank"
            )

    # -- in ------------------------------------------------------------------------------------

    @torch.no_grad()
    def gather(self, offload_to_cpu: bool) -> None:
        layout = self.module.layout
        for name in self.names:  # one table at a time (Note [unshard memory])
            t = layout.table_index(name)
            table = layout.tables[t]
            device = torch.device("cpu") if offload_to_cpu else self.module.device
            full = None
            if self.holds:  # in the table's dtype: shards travel as they are (FP16 ones too)
                full = torch.empty(
                    table.num_embeddings, table.embedding_dim, dtype=table.dtype, device=device
                )
            if layout.placements[t].sharding_type is ShardingType.DATA_PARALLEL:
                if full is not None:
                    full.copy_(self.sharded[name].detach())
            else:
                for j, spec in enumerate(layout.shards[t]):
                    self._gather_shard(full, spec, self.views.get((name, j)))
            if full is not None:
                self.full[name] = full
                self.holders[name]._parameters["weight"] = full

    def _gather_shard(
        self, full: Optional[torch.Tensor], spec: ShardSpec, mine: Optional[torch.Tensor]
    ) -> None:
        region = None if full is None else _region(full, spec)
        if self.rank0_only:
            if spec.rank == 0 == self.rank:
                region.copy_(mine)
            elif spec.rank == self.rank:
                piece = mine.detach().contiguous().to(self.comm_device)
                send(piece, dst=0, group=self.group, what="unshard's send of a shard to rank 0")
            elif self.rank == 0:
                buf = self._buffer(region, spec)
                recv(buf, src=spec.rank, group=self.group, what=f"unshard's receive of a shard of {spec.rank}")
                if buf is not region:
                    region.copy_(buf)
            return
        if spec.rank == self.rank:
            buf = mine.detach().contiguous().to(self.comm_device)
        else:
            buf = self._buffer(region, spec)
        broadcast(buf, src=spec.rank, group=self.group, what=f"unshard's broadcast of a shard of {spec.rank}")
        if buf is not region:
            region.copy_(buf)

    def _buffer(self, region: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
        if region.device == self.comm_device and region.is_contiguous():
            return region
        return torch.empty(
            spec.num_rows, spec.num_cols, dtype=region.dtype, device=self.comm_device
        )

    def full_by_fqn(self) -> dict[str, torch.Tensor]:
        return {_weight_fqn(self.fqn, self.attr, n): t for n, t in self.full.items()}

    # -- out -----------------------------------------------------------------------------------

    def agree(self, raised: Optional[BaseException]) -> Optional[str]:
        """Every rank's verdict on the block (Note [agreeing on unshard]); None if all is well."""
        mine = None
        if raised is not None:
            mine = f"{type(raised).__name__}: {raised}"
        else:
            mine = self._shape_problem()
        if self.local:
            return mine
        verdicts: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(verdicts, mine, group=self.group)
        failed = [r for r, v in enumerate(verdicts) if v is not None]
        if not failed:
            return None
        first = failed[0]
        return (
            f"modular.unshard of module {self.fqn!r} wrote nothing back: on rank {first}, "
            f"{verdicts[first]} (ranks {failed} failed; every rank restores its shards as they "
            "were)"
        )

    def _shape_problem(self) -> Optional[str]:
        layout = self.module.layout
        for name, full in self.full.items():
            now = self.holders[name]._parameters["weight"]
            table = layout.tables[layout.table_index(name)]
            expected = (table.num_embeddings, table.embedding_dim)
            if not isinstance(now, torch.Tensor) or tuple(now.shape) != expected:
                got = tuple(now.shape) if isinstance(now, torch.Tensor) else type(now).__name__
                return (
                    f"table {name!r} ({_weight_fqn(self.fqn, self.attr, name)}) is {got} on exit, "
                    f"but the plan shards it as {expected}; a sharded table's shape cannot change "
                    "inside unshard (change its values in place, or build and shard a model with "
                    "the new size)"
                )
        return None

    @torch.no_grad()
    def write_back(self) -> None:
        layout = self.module.layout
        for name in self.names:
            t = layout.table_index(name)
            full = None
            if self.holds:
                full = self.holders[name]._parameters["weight"].detach()
            if layout.placements[t].sharding_type is ShardingType.DATA_PARALLEL:
                own_copy = self.sharded[name]
                if self.rank0_only and not self.local:
                    buf = full.to(self.comm_device) if self.rank == 0 else own_copy.detach()
                    if buf.device != self.comm_device:
                        buf = buf.to(self.comm_device)
                    broadcast(buf, src=0, group=self.group,
                              what="unshard's broadcast of a data-parallel table")  # fmt: skip
                    own_copy.detach().copy_(buf)
                else:
                    own_copy.detach().copy_(full)
                continue
            for j, spec in enumerate(layout.shards[t]):
                self._write_shard(full, spec, self.views.get((name, j)))

    def _write_shard(
        self, full: Optional[torch.Tensor], spec: ShardSpec, mine: Optional[torch.Tensor]
    ) -> None:
        if not self.rank0_only or self.local:
            if mine is not None:
                mine.detach().copy_(_region(full, spec))
            return
        if spec.rank == 0 == self.rank:
            mine.detach().copy_(_region(full, spec))
        elif self.rank == 0:
            piece = _region(full, spec).contiguous().to(self.comm_device)
            send(piece, dst=spec.rank, group=self.group, what="unshard's write-back of a shard")
        elif spec.rank == self.rank:
            target = mine.detach()
            buf = target
            if target.device != self.comm_device:
                buf = torch.empty_like(target, device=self.comm_device)
            recv(buf, src=0, group=self.group, what="unshard's write-back of a shard")
            if buf is not target:
                target.copy_(buf)

    def restore(self) -> None:
        for name, weight in self.sharded.items():
            self.holders[name]._parameters["weight"] = weight
        self.full.clear()


def _region(full: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    rows = slice(spec.row_offset, spec.row_offset + spec.num_rows)
    return full[rows, spec.col_offset : spec.col_offset + spec.num_cols]
