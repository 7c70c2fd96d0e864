"""The model-level calls over sharded modules: `shard` (in place, by a plan), `sharded_modules`
and `prefetch`."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


from modular import lifecycle
from modular.agreed_options import (
    SHARD_FIX, fused_settings, raise_if_settings_differ, shard_settings,
)
from modular.comm import all_gather_bytes, collective_device, raise_shared_failure
from modular.describe import log_built
from modular.errors import ShardingError
from modular.tiered.tier_plan import check_tiers
from modular.managed_collisions import check_not_managed, managed_owner, remap_globally
from modular.fused.state import fused_state, load_unsharded_fused_state
from modular.kernels.table_dtypes import check_table_dtypes
from modular.dtype_options import DtypeOption, per_module
from modular.kinds import KINDS, POOLED, SEQUENCE
from modular.mesh import resolve_mesh
from modular.plan_assumptions import check_priced_for
from modular.sharded_types import SHARDED_COLLECTIONS, kind_of, sharded_class
from modular.tables.forms import TensorType, is_sharded, local_pieces
from modular.tables.layout import RankLayout
from modular.tables.replicas import ReplicaSync
from planners.types import PlanError, ShardingPlan, ShardingType, ShardSpec, check_one_host

__all__ = ["shard", "sharded_modules"]


def shard(
    model: nn.Module,
    plan: ShardingPlan,
    *,
    process_group: Optional[ProcessGroup] = None,
    mesh: Optional[DeviceMesh] = None,
    replica_sync: str = "exact",
    device: Optional[torch.device] = None,
    output_dtype: DtypeOption = None,
    comm_dtype: DtypeOption = None,
    tensor_type: str = "sharded_tensor",
    tier_dir: Optional[str] = None,
) -> nn.Module:
    """Shards the EmbeddingBagCollections and EmbeddingCollections named in `plan`, in place, and
    returns `model`.

    Call it on every rank with the same plan (SPMD), after `torch.distributed.init_process_group`:

        model = modular.shard(model, plan)
        opt = torch.optim.SGD(modular.local_parameters(model), lr=0.1)

    Each collection named in the plan (by its FQN in `model`; "" for the model itself) is
    replaced by a `ShardedEmbeddingBagCollection` or `ShardedEmbeddingCollection` holding only
    this rank's shards (Note [collection kinds]); every other module is left alone and
    parameter names do not change. Collections may live on the `meta` device: each rank then
    allocates just its shards and fills them with the table's `init_fn` (called on the whole table
    where it takes at most 1 GiB, so its values are the unsharded module's: Note [shard init]); a
    materialised collection's weights are copied, so the sharded model computes exactly what
    the original did.

    Every problem with the plan is raised on every rank, also when only one rank sees it (its
    plan or model differs): see Note [agreeing on the plan]. What a plan from `planners.plan` was
    priced for is checked against the call (Note [a plan's assumptions]): another replica count
    or column-wise statistic raises, another optimizer, comm dtype or replica sync warns
    `PlanMismatchWarning`. `device` defaults to the current CUDA device under NCCL and to the
    CPU otherwise.

    Tables keep their config's data type (FP32, FP16; BF16 where fbgemm has kernels for it:
    Note [low-precision tables] in modular/kernels/table_dtypes.py). `output_dtype` is the dtype of
    the sharded modules' outputs, pooled or sequence rows (default torch.float32), `comm_dtype`
    the dtype those outputs and their gradients travel in (default: FP32; torch.float16 or torch.bfloat16
    halve those bytes, Note [low-precision comms] in modular/comm.py); either is one dtype
    for every planned module or a dict by module FQN.
    `tensor_type="dtensor"` makes every sharded table weight (and the fused optimizer's state
    laid out like it) a DTensor instead of a ShardedTensor, with the same FQNs and values (Note
    [table tensor types]).

    `tier_dir`: where CPU ranks keep the backing files of tiered tables (a plan's
    `cache_load_factor`, Note [tiered tables] in modular/tiered/__init__.py).

    `mesh`: a 1D DeviceMesh is its process group; a 2D one with dims ("replicate", "shard")
    shards the tables within each "shard" group by `plan` (`plan.world_size ==
    mesh["shard"].size()`) and replicates that layout across the "replicate" groups; input and
    output dist stay inside the shard group. `replica_sync="exact"` makes every step's update the
    global batch's on every replica (Note [exact replicas] in modular/kernels/exact_replicas.py).
    """
    tensor_type = TensorType.parse(tensor_type)
    replica_sync = ReplicaSync.parse(replica_sync)
    if not dist.is_initialized():
        raise ShardingError(
            "modular.shard needs a process group: call torch.distributed.init_process_group first"
        )
    if not isinstance(plan, ShardingPlan):
        raise ShardingError(f"plan must be a planners.ShardingPlan, got {type(plan).__name__}")
    if process_group is not None and dist.get_rank(process_group) < 0:
        raise ShardingError(
            f"rank {dist.get_rank()} is not in the process group given to modular.shard; call "
            "it only on the group's members (every rank must call dist.new_group, only members "
            "shard)"
        )
    groups, mesh_problem = resolve_mesh(mesh, process_group, replica_sync)
    process_group = groups.shard_group
    world = dist.get_world_size(process_group)
    device = torch.device(device) if device is not None else collective_device(process_group)
    if device.type == "cuda" and device.index is None:  # shards name their device exactly
        device = torch.device("cuda", torch.cuda.current_device())
    targets, resolved, problem = [], {}, None
    try:
        if mesh_problem is not None:
            raise mesh_problem
        if plan.world_size != world:
            raise ShardingError(groups.shard_size_message(plan.world_size, world))
        targets = _find_targets(model, plan)
        resolved = {fqn: resolve_placements(fqn, ebc, plan, world, device) for fqn, ebc in targets}
        check_tiers(  # Note [tiered tables]
            plan, targets, resolved, device, tier_dir, fused_of=_fused_of,
            read_tables=lambda fqn, m: kind_of(m).read_tables(m, fqn),
            replicated=groups.replicas is not None, rank=dist.get_rank(process_group),
        )  # fmt: skip
        fqns = [fqn for fqn, _ in targets]
        outputs = per_module(output_dtype, fqns, "output_dtype", torch.float32)
        wires = per_module(comm_dtype, fqns, "comm_dtype", None)
        # what the plan was priced for against what it runs under (Note [a plan's assumptions])
        replica_groups = groups.replicas.size if groups.replicas is not None else 1
        check_priced_for(plan, targets, wires, replicas=replica_groups,
                         replica_sync=replica_sync.value, call="modular.shard", stacklevel=2)
    except ShardingError as e:
        problem = e
    options = {f: [str(outputs[f]), str(wires[f])] for f, _ in targets} if problem is None else {}
    settings = shard_settings(  # Note [agreeing on options]
        {f: {"output_dtype": o, "comm_dtype": w, **fused_settings(_fused_of(m))}
         for (f, m), (o, w) in zip(targets, options.values())},
        tensor_type=tensor_type.value,
        replica_sync=replica_sync.value if groups.replicas is not None else None,
    )  # fmt: skip
    agree_on_plan(
        plan, targets, groups.agreement_group, problem, options, mesh=groups.described,
        settings=settings,
    )  # fmt: skip

    built = []
    for fqn, ebc in targets:  # same order on every rank: building a table is collective
        placements, shards = resolved[fqn]
        local = ebc if isinstance(ebc, _SHARDED) else None
        fused = _fused_of(ebc)
        kind = kind_of(ebc)
        at = RankLayout.build(
            kind.read_tables(ebc, fqn), placements, shards, module=fqn, group=process_group,
            device=device, local=False, replicas=groups.replicas, tier_dir=tier_dir,
        )  # fmt: skip
        sharded = sharded_class(kind)(
            ebc, at, fused=fused, output_dtype=outputs[fqn], comm_dtype=wires[fqn],
            tensor_type=tensor_type,
        )  # fmt: skip
        if local is not None and local.fused_tables is not None:
            state = fused_state(local.fused_tables, local.table_weights())
            load_unsharded_fused_state(sharded.fused_tables, state)
        built.append((fqn, ebc, sharded))
    # Swapped in only once all are built: a failure above leaves the model as it was.
    for fqn, ebc, sharded in built:
        owner = managed_owner(model, fqn)
        lifecycle.clear_pending_fuse(ebc)  # built fused (Note [fusing at shard])
        retire_tables(ebc, fqn)
        lifecycle.replace_module(model, fqn, sharded)
        if owner is not None:  # Note [managed collisions over the global batch]
            # over every rank: in 2D the tables' group is one replica group, whose batches are
            # not the global batch (Note [managed collisions in 2D] in modular/managed_collisions.py)
            remap_globally(owner[1], process_group if groups.replicas is None else None, owner[0])
        log_built(fqn, sharded)  # at INFO on logger "modular" (modular/describe.py)
    return model


def _fused_of(ebc: nn.Module):
    # A fused EBC stays fused (Note [fused tables]): unsharded and fused, or fused on meta.
    return ebc.fused if isinstance(ebc, _SHARDED) else lifecycle.pending_fuse(ebc)


def retire_tables(ebc: nn.Module, fqn: str, *, by: str = "modular.shard") -> None:
    """Records the parameters `shard` (or `reshard`: `by`) replaces (Note [lifecycle state]), so
    that an optimizer built on them before raises at its first step instead of training tensors
    no forward reads any more (Note [sharded tables and torch optimizers] in
    modular/compose/params.py)."""
    for name, p in ebc.named_parameters():
        tensors = [piece.tensor for piece in local_pieces(p)] if is_sharded(p) else [p]
        for t in tensors:
            lifecycle.retire(t, f"{name!r} of module {fqn!r}", by=by)


# The collections `shard` takes, and their sharded counterparts (Note [collection kinds]).
_SHARDED = SHARDED_COLLECTIONS
_TARGETS = (*(k.unsharded for k in KINDS), *_SHARDED)


def _find_targets(model: nn.Module, plan: ShardingPlan) -> list[tuple[str, nn.Module]]:
    found = {
        name: m
        for name, m in model.named_modules(remove_duplicate=False)
        if isinstance(m, _TARGETS)
    }
    names_of: dict[int, list[str]] = {}
    for name, m in found.items():
        names_of.setdefault(id(m), []).append(name)
    targets = []
    for fqn in sorted(plan.modules):
        check_not_managed(model, fqn)  # Note [managed collisions over the global batch]
        module = found.get(fqn)
        if module is None:
            try:
                other = type(model.get_submodule(fqn)).__name__
                why = f"is a {other}, not an EmbeddingBagCollection or EmbeddingCollection"
            except AttributeError:
                why = "does not exist in the model"
            ebcs = sorted(k for k, v in found.items() if kind_of(v) is POOLED)
            ecs = sorted(k for k, v in found.items() if kind_of(v) is SEQUENCE)
            raise ShardingError(
                f"the plan names module {fqn!r}, which {why}; the model's "
                f"EmbeddingBagCollections are {ebcs}"
                + (f" and its EmbeddingCollections {ecs}" if ecs else "")
                + " (use '' for the model itself)"
            )
        if len(names_of[id(module)]) > 1:
            raise ShardingError(
                f"module {fqn!r} is one {kind_of(module).name} registered under several names "
                f"{names_of[id(module)]}; shard replaces the module at one name and the others "
                "would keep the unsharded tables. Register it once, shard it, then share the "
                "sharded module (e.g. model.b = model.a after modular.shard)"
            )
        if not isinstance(module, _SHARDED) and any(
            isinstance(p, DTensor) for p in module.parameters()
        ):
            raise ShardingError(
                f"module {fqn!r}'s tables are DTensors: fully_shard (or apply_fully_shard) ran on "
                "them before modular.shard. Call modular.shard first, then "
                "modular.apply_fully_shard, which leaves the sharded tables to modular"
            )
        if isinstance(module, _SHARDED) and not module.is_local:
            raise ShardingError(f"module {fqn!r} is already sharded; shard a model only once")
        targets.append((fqn, module))
    return targets


def resolve_placements(
    fqn: str, ebc: nn.Module, plan: ShardingPlan, world: int, device: torch.device
) -> tuple[dict, dict[str, tuple[ShardSpec, ...]]]:
    """Module `fqn`'s placements in `plan` and each table's shards, checked against its tables
    (ShardingError naming the module, table and fix)."""
    tables = kind_of(ebc).read_tables(ebc, fqn)
    check_table_dtypes(tables, fqn, device)  # before anything is allocated
    placements = dict(plan.modules[fqn])
    names = [t.name for t in tables]
    missing = [n for n in names if n not in placements]
    if missing:
        raise ShardingError(
            f"the plan for module {fqn!r} has no placement for tables {missing}; every table of "
            f"a planned module needs one (e.g. TablePlacement(ShardingType.DATA_PARALLEL))"
        )
    unknown = [n for n in placements if n not in names]
    if unknown:
        raise ShardingError(
            f"the plan for module {fqn!r} places tables {unknown}, which the module does not "
            f"have; its tables are {names}"
        )
    host = plan.ranks_per_host or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    shards = {}
    for t in tables:
        p = placements[t.name]
        try:
            shards[t.name] = p.shards(
                num_embeddings=t.num_embeddings,
                embedding_dim=t.embedding_dim,
                world_size=world,
                table=t.name,
            )
            if p.sharding_type is ShardingType.TABLE_ROW_WISE:
                check_one_host(p.ranks, host, f"table {t.name!r}")
        except PlanError as e:
            raise ShardingError(f"module {fqn!r}: {e}") from None
    return placements, shards


def agree_on_plan(
    plan: ShardingPlan,
    targets: list[tuple[str, nn.Module]],
    group,
    problem: Optional[ShardingError],
    options: Optional[dict] = None,
    *,
    call: str = "modular.shard",
    mesh: Optional[dict] = None,
    settings: Optional[dict[str, str]] = None,
    fix: str = SHARD_FIX,
) -> None:
    """# Note [agreeing on the plan]
    Every rank joins one small all-gather, always, even when its own plan check failed: each
    sends a digest of its plan and planned tables, or a flag that it rejected the plan. A rank
    that raised before this collective would leave its peers waiting in it; instead, if any rank
    flagged a problem, a second gather shares the messages and every rank raises (its own message,
    or the rejecting rank's), and if the digests differ every rank raises naming the groups of
    ranks that agree. Both collectives are reached by every live rank, so neither can hang.
    Under a 2D mesh the group is every rank and the digest holds the mesh too (`mesh`).
    """
    if problem is None:
        described = {
            "plan": plan.to_dict(),
            "tables": {fqn: kind_of(m).described(m) for fqn, m in targets},
        }
        if options and any(o != [str(torch.float32), "None"] for o in options.values()):
            described["precision"] = options  # output and comm dtypes, when not the defaults
        if mesh is not None:
            described["mesh"] = mesh
        if settings:  # Note [agreeing on options]
            described["settings"] = settings
        payload = b"\x00" + hashlib.sha256(json.dumps(described, sort_keys=True).encode()).digest()
    else:
        payload = b"\x01" + bytes(32)
    payloads = all_gather_bytes(payload, width=len(payload), group=group)
    rejecting = [r for r, p in enumerate(payloads) if p[0] == 1]
    shared = raise_shared_failure(problem, rejecting, group)
    if shared is not None:
        first, message = shared
        raise ShardingError(
            f"rank {first} rejected the plan: {message} (ranks {rejecting} rejected it; "
            "this rank stops too so that no rank hangs)"
        )
    if len(set(payloads)) > 1:
        if settings is not None:  # every rank sees the same digests, so every rank gathers
            raise_if_settings_differ(settings, group, call, fix)
        groups: dict[bytes, list[int]] = {}
        for r, d in enumerate(payloads):
            groups.setdefault(d, []).append(r)
        listing = "; ".join(f"ranks {rs} hold {d[1:].hex()[:12]}" for d, rs in groups.items())
        raise ShardingError(
            "ranks disagree on the plan or on the tables of the planned modules"
            + (" or on the mesh" if mesh is not None else "")
            + f" ({listing}); every rank must call {call} with the same plan"
            + (", the same mesh" if mesh is not None else "")
            + " and the same model configuration"
        )


def sharded_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(FQN, module) of every sharded EBC and EmbeddingCollection in `model`, in
    `named_modules()` order.

    The walk does not enter a sharded collection (they do not nest), so its cost is the model's
    other modules, not its tables: `prefetch` and the fused optimizer's step call it every step
    (issue 29, tests/modular/test_step_python.py)."""
    seen: set[int] = set()
    stack: list[tuple[str, nn.Module]] = [("", model)]
    while stack:
        name, m = stack.pop()
        if id(m) in seen:  # a module registered twice is listed once, as named_modules does
            continue
        seen.add(id(m))
        if isinstance(m, SHARDED_COLLECTIONS):
            yield name, m
            continue
        children = [
            (f"{name}.{child_name}" if name else child_name, child)
            for child_name, child in m._modules.items()
            if child is not None
        ]
        stack.extend(reversed(children))
