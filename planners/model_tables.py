"""Tables as the planner's input: a list, a {module FQN: tables} mapping, or a model on `meta`.

Everything is flattened to `TableSet`, an ordered tuple of (module FQN, Table); the plan's
`modules` key is that FQN, the FQN `modular.shard` looks the EmbeddingBagCollection up by.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence, Union

from planners.inputs import DataType, Table, TableConstraint
from planners.types import PlanError

__all__ = ["TableSet", "TablesLike", "as_table_set", "match_constraints", "tables_from_model"]

TableSet = tuple[tuple[str, Table], ...]
TablesLike = Union[Sequence[Table], Mapping[str, Sequence[Table]], Any]  # Any: an nn.Module


def _is_ebc(module: Any) -> bool:
    # Duck-typed so that reading a model needs neither torchrec nor torch.distributed here.
    return callable(getattr(module, "embedding_bag_configs", None))


def tables_from_model(
    model: Any, *, pooling_factors: Mapping[str, float] | None = None
) -> dict[str, tuple[Table, ...]]:
    """The tables of every EmbeddingBagCollection in `model`, keyed by the EBC's FQN.

        tables = tables_from_model(model, pooling_factors={"user_history": 40.0})

    The model may live on `meta`: only the EBC configs are read. Pooling factors are not in the
    configs, so each feature gets `pooling_factors[feature]` or 1.0; a key that is no feature of
    the model raises PlanError (a typo would otherwise price the feature at 1.0).
    """
    pooling_factors = dict(pooling_factors or {})
    found: dict[str, tuple[Table, ...]] = {}
    features: set[str] = set()
    for fqn, module in model.named_modules():
        inside_found = any(not f or fqn.startswith(f + ".") for f in found)  # an EBC's children
        if not _is_ebc(module) or (fqn and inside_found):
            continue
        weighted = bool(module.is_weighted()) if callable(getattr(module, "is_weighted", None)) else False
        found[fqn] = tuple(
            Table(
                name=cfg.name,
                num_embeddings=cfg.num_embeddings,
                embedding_dim=cfg.embedding_dim,
                features=tuple(cfg.feature_names),
                pooling_factor=tuple(float(pooling_factors.get(f, 1.0)) for f in cfg.feature_names),
                dtype=DataType.parse(cfg.data_type),
                weighted=weighted,
            )
            for cfg in module.embedding_bag_configs()
        )
        features.update(f for table in found[fqn] for f in table.features)
    unknown = sorted(set(pooling_factors) - features)
    if found and unknown:
        raise PlanError(
            f"pooling_factors names feature(s) {unknown} that no EmbeddingBagCollection of "
            f"{type(model).__name__} looks up; its features are {_some(sorted(features))}"
        )
    if not found:
        raise PlanError(
            f"{type(model).__name__} has no EmbeddingBagCollection (no submodule with "
            "embedding_bag_configs()); pass a list of planners.Table instead"
        )
    return found


def _some(names: list[str], shown: int = 12) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(repr(n) for n in names[:shown]) + more


def as_table_set(tables: TablesLike, module_fqn: str = "") -> TableSet:
    """Flattens any accepted form of tables to ((module FQN, Table), ...), in input order."""
    if callable(getattr(tables, "named_modules", None)):
        groups: Mapping[str, Sequence[Table]] = tables_from_model(tables)
    elif isinstance(tables, Mapping):
        groups = tables
    elif isinstance(tables, (str, bytes)) or not hasattr(tables, "__iter__"):
        raise PlanError(f"tables must be a list of planners.Table, got {type(tables).__name__}")
    else:
        groups = {module_fqn: tuple(tables)}
    out: list[tuple[str, Table]] = []
    for fqn, group in groups.items():
        names: set[str] = set()
        features: dict[str, str] = {}
        for table in group:
            if not isinstance(table, Table):
                raise PlanError(
                    f"module {fqn!r}: expected planners.Table, got {type(table).__name__}"
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
