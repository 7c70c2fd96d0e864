"""`modular.reshard(model, plan)`: the model-level call (Note [resharding in memory] in
modular/resharding/__init__.py)."""

from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from modular import lifecycle
from modular.agreed_options import fused_settings, shard_settings
from modular.errors import ShardingError
from modular.kinds import unsharded_kind
from modular.profiling import RESHARD, labelled
from modular.plan_assumptions import check_priced_for
from modular.resharding.adopt import Adoption, retire_replaced
from modular.resharding.rounds import agree, exchange, pack, plan_traffic, rounds
from modular.resharding.memory import uncommitted
from modular.resharding.moves import (
    Item, Kept, ModuleMove, Shards, keep, kept_blocks, kept_whole_warning,
)  # fmt: skip
from modular.resharding.host_staging import Staged, stages
from modular.sharded_types import SHARDED_COLLECTIONS, sharded_class
from modular.sharding import agree_on_plan, resolve_placements
from modular.tables.layout import RankLayout
from modular.tables.replicas import Replicas
from modular.tables.weights import check_widths_off_cpu
from modular.tiered.tier_plan import check_tiers
from planners.types import ShardingPlan

__all__ = ["reshard"]


@labelled(RESHARD)  # Note [profiler labels] in modular/profiling.py
def reshard(model: nn.Module, plan: ShardingPlan, *, tier_dir: Optional[str] = None) -> nn.Module:
    """Moves the sharded EBCs and EmbeddingCollections that `plan` names to its placements, in
    memory and in place, and returns `model`. Call it on every rank with the same plan, between
    training steps, at the world size the model was sharded on (in 2D, `shard(..., mesh=mesh)`,
    the shard group's: every replica group moves alike and keeps its replica axis):

        model = modular.reshard(model, new_plan)
        opt = torch.optim.SGD(modular.local_parameters(model), lr=0.1)  # rebuilt: see below

    Only what changes rank travels: each table's blocks (rows x columns) that a new shard needs
    from an old shard on another rank, in one all-to-all per dtype, with a fused optimizer's
    state (per element or per row, and the Adam family's step count) beside them; blocks a rank
    keeps are copied on the rank (Note [resharding in memory]). Any change of sharding type,
    ranks or sizes is taken: table-wise, row-wise, column-wise (another number of column
    pieces too), table-row-wise and data-parallel, into one another. Modules the plan leaves as
    they are, and modules it does not name, are not touched. Parameter names, the tables' form
    (ShardedTensor or DTensor), `output_dtype`, `comm_dtype` and fusing are kept; FSDP2 or DDP
    on the dense part are not touched.

    A rebuilt module has new tensors: a torch optimizer built over `modular.local_parameters`
    before must be rebuilt (its first `step()` raises TypeError saying so; its state, e.g.
    Adagrad's, does not move); a `FusedOptimizer` keeps working. A batch prefetched for a
    rebuilt module (`modular.prefetch`) is dropped: the next forward runs its input dist under
    the new layout.

    Tables the plan puts on a tier (`cache_load_factor`, Note [tiered tables]) move in and out
    of their stores like any shard; their files go under `tier_dir`, by default the one the
    model was sharded with.

    Off CPU the old shards of the kernels a rank rebuilds can be copied to host memory and freed
    on the device before the new ones are built, and given their bytes back if the reshard
    fails or something else holds them (Note [reshard memory]; off until run on a GPU).
    On CPU the old modules' shards are given back to the OS as their blocks are copied, which
    keeps the peak memory within issue 39's bound (Note [reshard memory]), but only where
    nothing outside the model still holds them. A tensor taken from an old module before the
    call (its `state_dict()`, a view, its parameters, a torch optimizer over them, a checkpoint
    `async_save` has not copied yet) and the last step's loss (its autograd graph) keep those
    shards whole instead: they read what they read before, and a warning names the tables and
    how far the peak went over the bound. Drop such references before the call (`del loss`;
    clone what must outlive it) to stay within the bound.

    A plan that does not fit (another world size, a module that is not sharded, other tables)
    raises ShardingError on every rank before anything moves (Note [agreeing on the plan]); what
    a plan from `planners.replan` or `plan` was priced for is checked as `shard` checks it (Note
    [a plan's assumptions]). A
    failure while moving raises on every rank (ShardingError naming the rank and its error, or
    CollectiveError where a peer died) and leaves every rank's model as it was: the new
    modules replace the old ones only once every rank has built all of them.
    """
    if not isinstance(plan, ShardingPlan):
        raise ShardingError(f"plan must be a planners.ShardingPlan, got {type(plan).__name__}")
    if not dist.is_initialized():
        raise ShardingError("modular.reshard needs the process group the model was sharded on")
    moves, names, group, agreement = _agreed_moves(model, plan, tier_dir)
    if moves:
        _move(model, moves, names, group, agreement)
    return model


def _agreed_moves(
    model: nn.Module, plan: ShardingPlan, tier_dir: Optional[str]
) -> tuple[list[ModuleMove], dict[int, list[str]], Optional[ProcessGroup], Optional[ProcessGroup]]:
    """The moves of the modules `plan` changes, once every rank agreed on it (collective), with
    the names each moving module is registered under (by move index), their (shard) group and
    the group that agrees: every rank in 2D (Note [resharding in memory])."""
    names = _sharded_names(model)
    group, agreement = _group_guess(names)
    targets: list[tuple[str, nn.Module]] = []
    moves: list[ModuleMove] = []
    problem: Optional[ShardingError] = None
    described = None
    try:
        targets = _targets(model, plan, names)
        group = _one_group(targets)
        replicas = _one_axis(targets)
        agreement = None if replicas is not None else group  # 2D: every rank of the world
        world = dist.get_world_size(group)
        if replicas is not None:
            mesh = replicas.mesh
            shape = None if mesh is None else list(mesh.mesh.shape)
            described = {"shape": shape, "sync": replicas.sync.value}  # agreed beside the plan
        if plan.world_size != world:
            raise ShardingError(_world_message(plan.world_size, world, replicas))
        check_priced_for(  # Note [a plan's assumptions]
            plan, targets, {fqn: m.comm_dtype for fqn, m in targets},
            replicas=1 if replicas is None else replicas.size,
            replica_sync="exact" if replicas is None else replicas.sync.value,
            call="modular.reshard", stacklevel=4,  # past the label's wrapper
        )  # fmt: skip
        resolved = {fqn: resolve_placements(fqn, m, plan, world, m.device) for fqn, m in targets}
        tier_dir = tier_dir or next((m.tier_dir for _, m in targets if m.tier_dir), None)
        check_tiers(  # Note [tiered tables]
            plan, targets, resolved, targets[0][1].device if targets else torch.device("cpu"),
            tier_dir, fused_of=lambda m: m.fused, read_tables=lambda fqn, m: m.kind.read_tables(m, fqn),
            replicated=replicas is not None, rank=dist.get_rank(group),
        )  # fmt: skip
        for fqn, module in targets:
            placements, shards = resolved[fqn]
            at = RankLayout.build(
                module.kind.read_tables(module, fqn), placements, shards, module=fqn,
                group=group, device=module.device, local=False, replicas=replicas,
                tier_dir=tier_dir,
            )  # fmt: skip
            if module.device.type != "cpu":  # what the build would refuse, refused before moving
                check_widths_off_cpu(at.layout, fqn, module.device)
            move = ModuleMove(len(moves), fqn, module, at)
            if move.problem is not None:
                raise ShardingError(f"module {fqn!r}: {move.problem}")
            if move.changed:
                moves.append(move)
    except ShardingError as e:
        problem = e
    agree_on_plan(
        plan, targets, agreement, problem, call="modular.reshard", mesh=described,
        settings=_settings(targets), fix=_FIX,
    )  # fmt: skip
    return moves, {move.index: names[id(move.old)][1] for move in moves}, group, agreement


# Note [agreeing on options], for reshard: its only arguments are the model and the plan, but the
# modules it rebuilds keep options that change what the build's and later steps' collectives do
# (the fused optimizer's live param group can gain weight decay on one rank, say), so those are
# folded into the plan's digest as shard folds its own: no collective more on a good call.
_FIX = (
    "hold the same options in every rank's sharded modules (modular.shard's, and the fused "
    "optimizer's param group: set weight decay alike on every rank) before calling {call}"
)


def _settings(targets: list[tuple[str, nn.Module]]) -> dict[str, str]:
    """The options each module `reshard` rebuilds keeps, by module (Note [agreeing on options])."""
    return shard_settings(
        {
            fqn: {
                "output_dtype": str(m.output_dtype), "comm_dtype": str(m.comm_dtype),
                "tensor_type": m.tensor_type.value, **fused_settings(m.fused),
            }
            for fqn, m in targets
        },
        tensor_type=None, replica_sync=None,  # the sync is agreed beside the plan (`mesh`)
    )  # fmt: skip


def _move(
    model: nn.Module, moves: list[ModuleMove], names: dict[int, list[str]],
    group: Optional[ProcessGroup], agreement: Optional[ProcessGroup],
) -> None:
    """Builds the new modules (collective), swaps them in, then copies the blocks this rank
    keeps. By then the mover holds the old shards through `kept` alone (the old modules and
    their readers are dropped: Note [reshard memory] counts what else holds them), and what
    something else holds is kept whole, with one warning."""
    fills = [Adoption(move) for move in moves]
    staged = None
    try:
        if stages(moves[0].at.device):  # old shards of rebuilt kernels go to host first (host_staging.py)
            staged = Staged(moves, [fill.candidate_shards() for fill in fills])
        built, kept, writers = _build(moves, fills, group, agreement, None if staged is None else staged.readers)
    except BaseException:
        for fill in fills:  # the old modules' kernels as they were
            fill.undo()
        if staged is not None:
            staged.restore()
        raise
    del fills  # they hold the old kernels the new modules did not adopt
    insides = [weakref.ref(move.old._sharded) for move in moves]  # what holds the old kernels
    for move, new in zip(moves, built):  # every rank built every module: swap them in
        retire_replaced(move.old, new, move.fqn)
        for name in names[move.index]:
            lifecycle.replace_module(model, name, new)
        move.old = None
    rank = dist.get_rank(agreement)  # the rank every rank's errors name (the world's in 2D)
    collect = any(inside() is not None for inside in insides)
    try:  # a collection only where an old module outlived the swap (a cycle, or a user's)
        restored = set() if staged is None else staged.restore(only_held=True, collect=collect)
        whole = keep(kept, writers, collect=collect)
        if staged is not None:  # host copies are the mover's: what counts is the device storage
            whole = [k for k in whole if not staged.is_host(k.tensor)]
            whole += [k for k in kept if k.tensor.untyped_storage().data_ptr() in restored]
    except Exception as e:  # only local copies are left; the other ranks go on (Note [reshard memory])
        raise ShardingError(
            f"modular.reshard failed on rank {rank} after every rank had received its blocks, "
            f"while copying the blocks it keeps ({type(e).__name__}: {e}); every rank holds the "
            "new plan, but this rank's new shards are partly filled and its old ones partly given "
            "back: load the last checkpoint on every rank (modular.checkpoint.load into this model)"
        ) from e
    if whole:
        warnings.warn(kept_whole_warning(whole, moves, rank), stacklevel=4)  # the caller's (past the label)


def _build(
    moves: list[ModuleMove], fills: list[Adoption], group: Optional[ProcessGroup],
    agreement: Optional[ProcessGroup], readers: Optional[list[Shards]] = None,
) -> tuple[list[nn.Module], list[Kept], list[Shards]]:
    """The new modules, filled with the blocks that arrive (collective), and what `keep` copies
    into them once they replace the old ones: the old local tensors with the blocks this rank
    keeps from them, and the new modules' shards. Blocks travel within the shard `group` (each
    replica group moves its own copies alike); the agreements run over `agreement`, every rank
    in 2D. Its last agreement is the reshard's commit."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    built = []
    for move, fill in zip(moves, fills):  # shards that take pages only as blocks are written into them
        old = move.old
        # Staged through host, buffers are made as off CPU: its storages can be freed in place.
        with uncommitted(move.at.device) if readers is None else contextlib.nullcontext():
            built.append(
                sharded_class(old.kind)(
                    old, move.at, fused=old.fused, output_dtype=old.output_dtype,
                    comm_dtype=old.comm_dtype, tensor_type=old.tensor_type,
                    fill=fill,  # in place of shard init
                )  # fmt: skip
            )
    readers = readers or [move.reader() for move in moves]
    writers = [
        move.writer(
            new.local_shard_views(), None if new.fused_tables is None else new.fused_tables.states(),
            fill.adopted_shards(),
        )
        for move, new, fill in zip(moves, built, fills)
    ]  # fmt: skip
    items: list[Item] = [item for move in moves for item in move.items]
    failure, doing = None, ""
    device = moves[0].at.device
    for batch in rounds(items, world):
        (traffic,) = plan_traffic(batch, rank, world)
        send = None
        if failure is None:
            try:
                send = pack(traffic, batch, lambda it: readers[it.module].read(it), device)
            except Exception as e:  # out of memory, say: every rank must hear it first
                failure, doing = e, "while packing the blocks it sends"
        agree(failure, doing, agreement)
        received = exchange(traffic, batch, send, group)
        del send  # each round's buffers go before the next round's (Note [reshard memory])
        try:
            for i in list(received):
                module = batch[i].module
                doing = f"while filling the new shards of module {moves[module].fqn!r}"
                writers[module].write(batch[i], received.pop(i))
        except Exception as e:
            failure = e
        del received
    kept = []
    if failure is None:
        try:
            kept = kept_blocks(moves, readers, writers, rank)
        except Exception as e:
            failure, doing = e, "while listing the blocks it keeps"
    # Every rank has every block it receives: from here on the new modules replace the old ones.
    agree(failure, doing, agreement)
    return built, kept, writers



def _sharded_names(model: nn.Module) -> dict[int, tuple[nn.Module, list[str]]]:
    """Every sharded collection of `model` and all the names it is registered under."""
    out: dict[int, tuple[nn.Module, list[str]]] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        if isinstance(m, SHARDED_COLLECTIONS):
            out.setdefault(id(m), (m, []))[1].append(name)
    return out


def _group_guess(names: dict) -> tuple[Optional[ProcessGroup], Optional[ProcessGroup]]:
    """The groups this rank uses when it cannot tell the plan's modules: the model's first
    sharded collection's (the default group if there is none), and the group that agrees on
    the plan, which is every rank where that collection is sharded in 2D."""
    for module, _ in names.values():
        if not module.is_local:
            return module.process_group, (None if module.replicas is not None else module.process_group)
    return None, None


def _targets(model: nn.Module, plan: ShardingPlan, names: dict) -> list[tuple[str, nn.Module]]:
    by_name = {n: m for m, ns in names.values() for n in ns}
    targets, seen = [], {}
    for fqn in sorted(plan.modules):
        module = by_name.get(fqn)
        if module is None:
            try:
                found = model.get_submodule(fqn)
                kind = unsharded_kind(found)
                why = (
                    f"is an {kind.name} that is not sharded: shard it with modular.shard first"
                    if kind is not None
                    else f"is a {type(found).__name__}, not a sharded collection"
                )
            except AttributeError:
                why = "does not exist in the model"
            raise ShardingError(
                f"the plan names module {fqn!r}, which {why}; reshard moves the model's sharded "
                f"collections {sorted(by_name)}"
            )
        if module.is_local:
            raise ShardingError(
                f"module {fqn!r} is a one-process module (fuse_optimizer's), not sharded over "
                "ranks: shard it with modular.shard first"
            )
        if id(module) in seen:
            raise ShardingError(
                f"the plan names modules {seen[id(module)]!r} and {fqn!r}, which are one sharded "
                "module registered under two names; name it once"
            )
        seen[id(module)] = fqn
        targets.append((fqn, module))
    if not targets:
        raise ShardingError("the plan names no module; reshard moves the modules a plan names")
    return targets


def _one_axis(targets: list[tuple[str, nn.Module]]) -> Optional[Replicas]:
    """The replica axis every target shares (None in 1D): each replica group applies the same
    moves to its copies of the shards, and the new modules keep the axis."""
    axes = {
        (None if m.replicas is None else (id(m.replicas.group), m.replicas.sync)): fqn
        for fqn, m in targets
    }
    if len(axes) > 1:
        raise ShardingError(
            f"modules {sorted(axes.values())} are sharded on different meshes (1D and 2D, or "
            "another replica_sync); reshard the modules of each mesh in a call of its own"
        )
    return targets[0][1].replicas


def _world_message(planned: int, world: int, replicas: Optional[Replicas]) -> str:
    """Why a plan for `planned` ranks does not fit modules sharded over groups of `world`."""
    if replicas is None:
        over = f"the modules are sharded over {world}"
    else:
        shape = None if replicas.mesh is None else tuple(replicas.mesh.mesh.shape)
        over = (
            f"the modules are sharded in 2D over shard groups of {world} (mesh {shape} over "
            f"('replicate', 'shard'): {replicas.size} replica groups of {world} ranks, each "
            "resharded alike)"
        )
    return (
        f"the plan is for {planned} ranks but {over}; reshard keeps the world size: make a plan "
        f"for world_size={world} (a new world size goes through modular.checkpoint save and load)"
    )


def _one_group(targets: list[tuple[str, nn.Module]]) -> Optional[ProcessGroup]:
    groups = {id(m.process_group): (fqn, m.process_group) for fqn, m in targets}
    if len(groups) > 1:
        listing = [fqn for fqn, _ in groups.values()]
        raise ShardingError(
            f"modules {listing} are sharded over different process groups; reshard the modules "
            "of each group in a call of its own, with a plan for that group's world size"
        )
    return next(iter(groups.values()))[1]
