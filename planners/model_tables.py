"""Tables as the planner's input: a list, a {module FQN: tables} mapping, or a model on `meta`.

A list may hold `planners.Table`s or torchrec `EmbeddingBagConfig`s (read duck-typed, so no
torchrec import is needed here); a model is any module with EmbeddingBagCollections, an EBC
itself included. Configs carry no pooling factors: they come from an optional
{feature: pooling factor} mapping, 1.0 otherwise.

Everything is flattened to `TableSet`, an ordered tuple of (module FQN, Table); the plan's
`modules` key is that FQN, the FQN `modular.shard` looks the EmbeddingBagCollection up by.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping, Sequence, Union

from planners.inputs import DataType, EvictionPolicy, ManagedCollision, Table, TableConstraint
from planners.types import PlanError

__all__ = [
    "TableSet", "TablesLike", "as_table_set", "match_constraints", "tables_from_configs",
    "tables_from_model",
]  # fmt: skip

TableSet = tuple[tuple[str, Table], ...]
# Any: an nn.Module, or a torchrec EmbeddingBagConfig in place of a Table
TablesLike = Union[Sequence[Table], Mapping[str, Sequence[Table]], Any]


def _is_ebc(module: Any) -> bool:
    # Duck-typed so that reading a model needs neither torchrec nor torch.distributed here.
    return callable(getattr(module, "embedding_bag_configs", None)) or _is_ec(module)


def _is_ec(module: Any) -> bool:
    """An EmbeddingCollection (sequences): it has `embedding_configs()` and no bags."""
    return callable(getattr(module, "embedding_configs", None)) and not callable(
        getattr(module, "embedding_bag_configs", None)
    )


def _is_collision_collection(module: Any) -> bool:
    """torchrec's ManagedCollisionCollection: it lists its tables' configs (`embedding_configs()`)
    but holds no table; the tables are its managed-collision module's inner collection
    (modular's Note [managed collisions over the global batch])."""
    return hasattr(module, "_managed_collision_modules")


# torchrec's MCH eviction policies by class name (duck-typed, like the rest of this file)
_POLICIES = {"LRU_EvictionPolicy": EvictionPolicy.LRU, "LFU_EvictionPolicy": EvictionPolicy.LFU,
             "DistanceLFU_EvictionPolicy": EvictionPolicy.DISTANCE_LFU}  # fmt: skip


def _collision_modules(model: Any) -> dict[str, Any]:
    """{inner collection's FQN: its ManagedCollisionCollection's modules by table name} for
    every managed-collision EBC/EC of `model` (`<fqn>._embedding_module`)."""
    out = {}
    for fqn, module in model.named_modules():
        mcc = getattr(module, "_managed_collision_collection", None)
        if mcc is not None and _is_collision_collection(mcc) and hasattr(module, "_embedding_module"):
            out[f"{fqn}._embedding_module" if fqn else "_embedding_module"] = mcc._managed_collision_modules
    return out


def _managed_collision(module: Any) -> ManagedCollision:
    """What the planner prices of one table's collision module: its `zch_size`, eviction
    interval and policy; a module that is not torchrec's MCH (or a policy of another class)
    is priced as DistanceLFU every call, the most state and work."""
    policy = _POLICIES.get(type(getattr(module, "_eviction_policy", None)).__name__, EvictionPolicy.DISTANCE_LFU)
    return ManagedCollision(zch_size=int(module.output_size()),
                            eviction_interval=int(getattr(module, "_eviction_interval", 1) or 1),
                            eviction_policy=policy)  # fmt: skip


def _is_config(item: Any) -> bool:
    # A torchrec EmbeddingBagConfig (or anything shaped like one), duck-typed like `_is_ebc`.
    return not isinstance(item, Table) and all(
        hasattr(item, a) for a in ("name", "num_embeddings", "embedding_dim", "feature_names")
    )


def tables_from_configs(
    configs: Sequence[Any],
    *,
    pooling_factors: Mapping[str, float] | None = None,
    weighted: bool = False,
) -> tuple[Table, ...]:
    """torchrec `EmbeddingBagConfig`s as planner `Table`s, in order.

        tables = tables_from_configs(ebc.embedding_bag_configs(), pooling_factors={"item_hist": 40.0})

    Each feature gets `pooling_factors[feature]` or 1.0; a key that is no feature of the
    configs raises PlanError (a typo would otherwise price the feature at 1.0). `weighted` is
    the EBC's `is_weighted()` (configs do not carry it).
    """
    pooling_factors = dict(pooling_factors or {})
    tables = tuple(_table_of(cfg, pooling_factors, weighted) for cfg in configs)
    _check_pooling_keys(pooling_factors, tables, "that no config looks up; their features are")
    return tables


def _table_of(
    cfg: Any, pooling_factors: Mapping[str, float], weighted: bool, sequence: bool = False
) -> Table:
    if not _is_config(cfg):
        raise PlanError(
            f"expected a torchrec EmbeddingBagConfig or planners.Table, got {type(cfg).__name__}"
        )
    return Table(
        name=cfg.name,
        num_embeddings=cfg.num_embeddings,
        embedding_dim=cfg.embedding_dim,
        features=tuple(cfg.feature_names),
        pooling_factor=tuple(float(pooling_factors.get(f, 1.0)) for f in cfg.feature_names),
        dtype=DataType.parse(getattr(cfg, "data_type", DataType.FP32)),
        weighted=weighted,
        sequence=sequence,
    )


def _check_pooling_keys(pooling_factors: Mapping[str, float], tables: Sequence[Table], that: str) -> None:
    features = sorted({f for t in tables for f in t.features})
    unknown = sorted(set(pooling_factors) - set(features))
    if tables and unknown:
        raise PlanError(f"pooling_factors names feature(s) {unknown} {that} {_some(features)}")


def tables_from_model(
    model: Any, *, pooling_factors: Mapping[str, float] | None = None
) -> dict[str, tuple[Table, ...]]:
    """The tables of every EmbeddingBagCollection and EmbeddingCollection in `model`, keyed by
    the collection's FQN (an EmbeddingCollection's tables are `sequence` tables, whose pooling
    factor is the average sequence length of each feature).

        tables = tables_from_model(model, pooling_factors={"user_history": 40.0})

    The model may live on `meta`, and may be an EBC itself (its FQN is ""): only the EBC
    configs are read. A managed-collision module's tables are found under its inner
    collection's FQN ("mc._embedding_module", `zch_size` rows each), each carrying its
    `ManagedCollision` (zch_size, eviction interval and policy), which the planner prices; its
    ManagedCollisionCollection holds none and is skipped. Pooling factors are not in the
    configs, so each feature gets `pooling_factors[feature]` or 1.0; a key that is no feature
    of the model raises PlanError (a typo would otherwise price the feature at 1.0).
    """
    pooling_factors = dict(pooling_factors or {})
    found: dict[str, tuple[Table, ...]] = {}
    collisions = _collision_modules(model)
    for fqn, module in model.named_modules():
        inside_found = any(not f or fqn.startswith(f + ".") for f in found)  # an EBC's children
        if not _is_ebc(module) or (fqn and inside_found) or _is_collision_collection(module):
            continue
        weighted = bool(module.is_weighted()) if callable(getattr(module, "is_weighted", None)) else False
        sequence = _is_ec(module)
        configs = module.embedding_configs() if sequence else module.embedding_bag_configs()
        tables = tuple(_table_of(c, pooling_factors, weighted, sequence) for c in configs)
        if fqn in collisions:  # zch_size is the row count (torchrec checks it)
            tables = tuple(replace(t, managed_collision=_managed_collision(collisions[fqn][t.name]))
                           for t in tables)  # fmt: skip
        found[fqn] = tables
    if not found:
        raise PlanError(
            f"{type(model).__name__} has no EmbeddingBagCollection or EmbeddingCollection (no "
            "submodule with embedding_bag_configs() or embedding_configs()); pass a list of "
            "planners.Table instead"
        )
    everything = [t for group in found.values() for t in group]
    _check_pooling_keys(
        pooling_factors, everything,
        f"that no EmbeddingBagCollection of {type(model).__name__} looks up; its features are",
    )  # fmt: skip
    return found


def _some(names: list[str], shown: int = 12) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(repr(n) for n in names[:shown]) + more


def as_table_set(
    tables: TablesLike, module_fqn: str = "", *, pooling_factors: Mapping[str, float] | None = None
) -> TableSet:
    """Flattens any accepted form of tables to ((module FQN, Table), ...), in input order.

    `pooling_factors` ({feature: pooling factor}) prices the features of torchrec configs and
    models, which carry none; a `planners.Table` carries its own, so naming one of its features
    here is an error, as is a name no table looks up.
    """
    pooling_factors = dict(pooling_factors or {})
    if callable(getattr(tables, "named_modules", None)):
        groups: Mapping[str, Sequence[Any]] = tables_from_model(tables, pooling_factors=pooling_factors)
        pooling_factors = {}  # checked against the model's features just now
    elif isinstance(tables, Mapping):
        groups = tables
    elif isinstance(tables, (str, bytes)) or not hasattr(tables, "__iter__"):
        raise PlanError(
            "tables must be a list of planners.Table or torchrec EmbeddingBagConfig, a "
            f"{{module FQN: list}} mapping or a model, got {type(tables).__name__}"
        )
    else:
        groups = {module_fqn: tuple(tables)}
    out: list[tuple[str, Table]] = []
    from_configs: list[Table] = []
    for fqn, group in groups.items():
        names: set[str] = set()
        features: dict[str, str] = {}
        for table in group:
            if _is_config(table):
                table = _table_of(table, pooling_factors, weighted=False)
                from_configs.append(table)
            elif not isinstance(table, Table):
                raise PlanError(
                    f"module {fqn!r}: expected planners.Table or torchrec EmbeddingBagConfig, "
                    f"got {type(table).__name__}"
                )
            elif set(table.features) & set(pooling_factors):
                raise PlanError(
                    f"pooling_factors names feature(s) {sorted(set(table.features) & set(pooling_factors))} "
                    f"of planners.Table {table.name!r}, which has its own pooling_factor "
                    f"{table.pooling_factor}; set it there (pooling_factors is for torchrec configs)"
                )
            if table.name in names:
                raise PlanError(f"module {fqn!r} has two tables named {table.name!r}")
            names.add(table.name)
            for f in table.features:
                if f in features:
                    raise PlanError(
                        f"feature {f!r} of module {fqn!r} is looked up in both table "
                        f"{features[f]!r} and {table.name!r}; a feature belongs to one table"
                    )
                features[f] = table.name
            out.append((fqn, table))
    if not out:
        raise PlanError("there are no tables to plan")
    if pooling_factors:
        _check_pooling_keys(pooling_factors, from_configs or [t for _, t in out],
                            "that no table looks up; the features are")  # fmt: skip
    return tuple(out)


def display_name(fqn: str, table: str) -> str:
    """'sparse.ebc.t_user' for reports, or just 't_user' when the module is the model itself."""
    return f"{fqn}.{table}" if fqn else table


def match_constraints(
    table_set: TableSet, constraints: Mapping[str, TableConstraint] | None, world_size: int
) -> tuple[TableConstraint | None, ...]:
    """The constraint of each table: keyed by 'fqn.table' or by the bare table name."""
    constraints = dict(constraints or {})
    out: list[TableConstraint | None] = []
    used: set[str] = set()
    for fqn, table in table_set:
        full = display_name(fqn, table.name)
        key = full if full in constraints else table.name if table.name in constraints else None
        con = constraints.get(key) if key is not None else None
        if con is not None:
            used.add(key)  # type: ignore[arg-type]
            if not isinstance(con, TableConstraint):
                raise PlanError(
                    f"constraint for table {full!r} must be a planners.TableConstraint, "
                    f"got {type(con).__name__}"
                )
            bad = [r for r in con.ranks if r >= world_size]
            if bad:
                raise PlanError(
                    f"table {full!r} is pinned to rank {bad[0]} but the world size is "
                    f"{world_size}; pin it to ranks in [0, {world_size - 1}]"
                )
        out.append(con)
    unknown = sorted(set(constraints) - used)
    if unknown:
        known = ", ".join(display_name(f, t.name) for f, t in table_set[:8])
        raise PlanError(
            f"constraints name unknown table(s) {unknown}; known tables: {known}"
            + (", ..." if len(table_set) > 8 else "")
        )
    return tuple(out)
