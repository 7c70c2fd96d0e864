"""The plan: where every table of every EmbeddingBagCollection lives.

A plan is plain data. `planners` computes one, `modular.shard` applies one, and the two meet only
here. Everything in this file is pure Python: it imports neither torch nor torch.distributed.

    plan = ShardingPlan(world_size=2, modules={
        "sparse.ebc": {
            "t_user": TablePlacement(ShardingType.ROW_WISE, ranks=(0, 1)),
            "t_item": TablePlacement(ShardingType.TABLE_WISE, ranks=(1,)),
            "t_cat": TablePlacement(ShardingType.COLUMN_WISE, ranks=(0, 1)),
            "t_ctx": TablePlacement(ShardingType.DATA_PARALLEL),
        }})

Shard boundaries are derived from the table's shape when a placement does not give them
(`TablePlacement.shards`), so a plan can be written before the tables exist. A plan made by
`planners.plan` also records what it was priced for (`priced_for`, planners/assumptions.py),
which `modular.shard` checks; one written by hand records nothing, and nothing is checked.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import types
from dataclasses import dataclass, field
from typing import Any, Mapping

from planners.assumptions import PlanAssumptions
from planners.errors import PlanError

__all__ = [
    "PlanAssumptions",
    "PlanError",
    "ShardSpec",
    "ShardingPlan",
    "ShardingType",
    "TablePlacement",
    "block_split",
    "even_split",
    "rank_ranges",
]

_FORMAT_VERSION = 1


class ShardingType(enum.Enum):
    """How one table is laid out over ranks."""

    DATA_PARALLEL = "data_parallel"  # a full copy on every rank; gradients all-reduced
    TABLE_WISE = "table_wise"  # the whole table on one rank
    ROW_WISE = "row_wise"  # rows split over ranks; partial sums reduced
    COLUMN_WISE = "column_wise"  # columns split over ranks; outputs concatenated
    TABLE_ROW_WISE = "table_row_wise"  # rows split over the ranks of one host

    @classmethod
    def parse(cls, value: str | ShardingType) -> ShardingType:
        """Accepts a member, its value ("row_wise") or its name ("ROW_WISE")."""
        if isinstance(value, cls):
            return value
        text = str(value).strip()
        for member in cls:
            if text.lower() in (member.value, member.name.lower()):
                return member
        choices = ", ".join(m.value for m in cls)
        raise PlanError(f"unknown sharding type {value!r}; expected one of: {choices}")


@dataclass(frozen=True)
class ShardSpec:
    """One shard of a table: a block of rows x columns that lives on one rank."""

    rank: int
    row_offset: int
    num_rows: int
    col_offset: int
    num_cols: int

    @property
    def offsets(self) -> tuple[int, int]:
        return (self.row_offset, self.col_offset)

    @property
    def sizes(self) -> tuple[int, int]:
        return (self.num_rows, self.num_cols)


def even_split(total: int, parts: int) -> tuple[int, ...]:
    """Splits `total` into `parts` sizes as evenly as possible, larger ones first: 10/3 -> 4, 3, 3."""
    if parts <= 0:
        raise PlanError(f"cannot split {total} into {parts} parts")
    base, extra = divmod(total, parts)
    return tuple(base + 1 if i < extra else base for i in range(parts))


def block_split(num_rows: int, num_ranks: int) -> tuple[int, ...]:
    """Rows per rank as TorchRec routes row-wise ids (Note [row-wise layouts in TorchRec] in
    planners/torchrec_interop.py): blocks of ceil(N / n) rows, the last ones short or empty.
    1000 rows over 3 ranks -> (334, 334, 332); 9 over 8 -> (2, 2, 2, 2, 1, 0, 0, 0)."""
    block = -(-num_rows // num_ranks)
    return tuple(max(0, min(block, num_rows - i * block)) for i in range(num_ranks))


def rank_ranges(ranks: Any, world_size: int | None = None) -> str:
    """(0, 1, 2, 3, 7) -> '0-3,7'; every rank of a world of `world_size` -> 'all 16'."""
    ranks = list(ranks)
    if world_size is not None and world_size > 1 and ranks == list(range(world_size)):
        return f"all {world_size}"
    out: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if j == i else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ",".join(out)


def _as_int_tuple(values: Any, what: str) -> tuple[int, ...]:
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise PlanError(f"{what} must be a sequence of integers, got {values!r}")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int):
            raise PlanError(f"{what} must be a sequence of integers, got {values!r}")
        out.append(v)
    return tuple(out)


@dataclass(frozen=True)
class TablePlacement:
    """Where one table goes.

    `ranks` lists the rank of each shard, in shard order. DATA_PARALLEL takes no ranks (it lives
    everywhere); TABLE_WISE takes exactly one; ROW_WISE and COLUMN_WISE default to all ranks when
    `ranks` is empty; TABLE_ROW_WISE needs ranks of one host. `sizes` optionally fixes the shard
    boundaries: rows per shard for ROW_WISE / TABLE_ROW_WISE, columns per shard for COLUMN_WISE.
    `cache_load_factor` (with `cache_policy`) puts the shards on a slower tier behind a cache of
    that fraction of each shard's rows (Note [tiered tables] in modular/tiered/__init__.py).
    """

    sharding_type: ShardingType
    ranks: tuple[int, ...] = ()
    sizes: tuple[int, ...] | None = None
    cache_load_factor: float | None = None
    cache_policy: str = "lru"

    def __post_init__(self) -> None:
        object.__setattr__(self, "sharding_type", ShardingType.parse(self.sharding_type))
        object.__setattr__(self, "ranks", _as_int_tuple(self.ranks, "ranks"))
        if self.sizes is not None:
            object.__setattr__(self, "sizes", _as_int_tuple(self.sizes, "sizes"))
        kind = self.sharding_type
        if any(r < 0 for r in self.ranks):
            raise PlanError(f"{kind.value} placement has a negative rank in {self.ranks}")
        if kind is ShardingType.DATA_PARALLEL and self.ranks:
            raise PlanError(
                f"data_parallel tables have a copy on every rank; drop ranks={self.ranks}"
            )
        if kind is ShardingType.TABLE_WISE and len(self.ranks) != 1:
            raise PlanError(
                f"table_wise placement needs exactly one rank, got ranks={self.ranks}"
            )
        if kind is ShardingType.TABLE_ROW_WISE and not self.ranks:
            raise PlanError("table_row_wise placement needs the ranks of one host, got none")
        if kind in (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE) and len(
            set(self.ranks)
        ) != len(self.ranks):
            raise PlanError(f"{kind.value} placement lists a rank twice: ranks={self.ranks}")
        if self.sizes is not None:
            if kind in (ShardingType.DATA_PARALLEL, ShardingType.TABLE_WISE):
                raise PlanError(f"{kind.value} placement takes no shard sizes, got {self.sizes}")
            if len(self.sizes) != len(self.ranks):
                raise PlanError(
                    f"{kind.value} placement has {len(self.sizes)} shard sizes {self.sizes} "
                    f"for {len(self.ranks)} ranks {self.ranks}; give one size per rank"
                )
            if any(s <= 0 for s in self.sizes):
                raise PlanError(f"{kind.value} shard sizes must be positive, got {self.sizes}")
        factor = self.cache_load_factor
        if factor is not None and (
            isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1
        ):
            raise PlanError(f"cache_load_factor must be in (0, 1], got {factor!r}")
        if self.cache_policy not in ("lru", "lfu"):
            raise PlanError(f'cache_policy must be "lru" or "lfu", got {self.cache_policy!r}')

    def __repr__(self) -> str:
        sizes = f", sizes={self.sizes}" if self.sizes is not None else ""
        ranks = f", ranks={self.ranks}" if self.ranks else ""
        tier = ("" if self.cache_load_factor is None else
                f", cache_load_factor={self.cache_load_factor}, cache_policy={self.cache_policy!r}")
        return f"TablePlacement({self.sharding_type.value}{ranks}{sizes}{tier})"

    def describe(self, world_size: int | None = None) -> str:
        """'row_wise on ranks 0-7 (rows 3x12_501+5x12_500)', 'data_parallel on every rank';
        a tiered placement ends with its cache: ', tiered (cache 0.05, lru)'."""
        tier = "" if self.cache_load_factor is None else (
            f", tiered (cache {self.cache_load_factor:g}, {self.cache_policy})")
        return self._where(world_size) + tier

    def _where(self, world_size: int | None) -> str:
        kind = self.sharding_type.value
        if self.sharding_type is ShardingType.DATA_PARALLEL:
            return f"{kind} on every rank"
        sizes = "" if self.sizes is None else f" (sizes {'+'.join(map(str, self.sizes))})"
        if not self.ranks:
            return f"{kind} on every rank{sizes}"
        ranks = rank_ranges(self.ranks, world_size)
        if ranks.startswith("all "):
            return f"{kind} on {ranks} ranks{sizes}"
        return f"{kind} on rank{'s' if len(self.ranks) > 1 else ''} {ranks}{sizes}"

    def with_tier_of(self, other: TablePlacement) -> TablePlacement:
        """This placement with `other`'s tier (its cache load factor and policy): what a rewrite
        that moves or recuts a table (replan, nearby plans, TorchRec's layouts) keeps."""
        return dataclasses.replace(self, cache_load_factor=other.cache_load_factor,
                                   cache_policy=other.cache_policy)  # fmt: skip

    def shard_ranks(self, world_size: int) -> tuple[int, ...]:
        """The rank of each shard (all ranks for data-parallel and for empty RW/CW `ranks`)."""
        if self.ranks:
            return self.ranks
        return tuple(range(world_size))

    def shards(
        self, *, num_embeddings: int, embedding_dim: int, world_size: int, table: str = "table"
    ) -> tuple[ShardSpec, ...]:
        """The concrete shards of a `num_embeddings` x `embedding_dim` table under this placement.

        Data-parallel placements return one full copy per rank.
        """
        kind = self.sharding_type
        ranks = self.shard_ranks(world_size)
        bad = [r for r in ranks if r >= world_size]
        if bad:
            raise PlanError(
                f"table {table!r} is placed on rank {bad[0]} but the world size is {world_size}; "
                f"use ranks in [0, {world_size - 1}]"
            )
        if kind in (ShardingType.DATA_PARALLEL, ShardingType.TABLE_WISE):
            return tuple(ShardSpec(r, 0, num_embeddings, 0, embedding_dim) for r in ranks)
        along_rows = kind is not ShardingType.COLUMN_WISE
        total = num_embeddings if along_rows else embedding_dim
        axis = "rows" if along_rows else "columns"
        if self.sizes is None:
            if total < len(ranks):
                raise PlanError(
                    f"table {table!r} has {total} {axis} but is {kind.value} over "
                    f"{len(ranks)} ranks {ranks}; use at most {total} ranks"
                )
            sizes = even_split(total, len(ranks))
        else:
            sizes = self.sizes
            if sum(sizes) != total:
                raise PlanError(
                    f"{kind.value} shards of {table!r} ({total:_} {axis}) over ranks {ranks} "
                    f"must sum to {total:_}, got {' + '.join(map(str, sizes))} = {sum(sizes):_}"
                )
        out, offset = [], 0
        for rank, size in zip(ranks, sizes):
            if along_rows:
                out.append(ShardSpec(rank, offset, size, 0, embedding_dim))
            else:
                out.append(ShardSpec(rank, 0, num_embeddings, offset, size))
            offset += size
        return tuple(out)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"sharding_type": self.sharding_type.value, "ranks": list(self.ranks)}
        if self.sizes is not None:
            out["sizes"] = list(self.sizes)
        if self.cache_load_factor is not None:
            out["cache_load_factor"] = self.cache_load_factor
            out["cache_policy"] = self.cache_policy
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TablePlacement:
        if not isinstance(data, Mapping) or "sharding_type" not in data:
            raise PlanError(f"a table placement needs a 'sharding_type', got {data!r}")
        unknown = set(data) - {"sharding_type", "ranks", "sizes", "cache_load_factor", "cache_policy"}
        if unknown:
            raise PlanError(f"unknown fields {sorted(unknown)} in table placement {dict(data)!r}")
        # The constructor checks and converts ranks and sizes (a JSON null or number in either
        # must be a PlanError, not the TypeError that tuple() would raise here).
        return cls(
            ShardingType.parse(data["sharding_type"]),
            ranks=data.get("ranks", ()),
            sizes=data.get("sizes"),
            cache_load_factor=data.get("cache_load_factor"),
            cache_policy=data.get("cache_policy", "lru"),
        )


def _freeze_modules(
    modules: Mapping[str, Mapping[str, TablePlacement]],
) -> Mapping[str, Mapping[str, TablePlacement]]:
    if not isinstance(modules, Mapping):
        raise PlanError(f"plan modules must map module FQN -> {{table: placement}}, got {modules!r}")
    frozen = {}
    for fqn, tables in modules.items():
        if not isinstance(fqn, str):
            raise PlanError(f"module FQNs must be strings, got {fqn!r}")
        if not isinstance(tables, Mapping):
            raise PlanError(f"module {fqn!r} must map table name -> TablePlacement, got {tables!r}")
        for name, placement in tables.items():
            if not isinstance(placement, TablePlacement):
                raise PlanError(
                    f"table {name!r} of module {fqn!r} must be a TablePlacement, "
                    f"got {type(placement).__name__}"
                )
        frozen[fqn] = types.MappingProxyType(dict(tables))
    return types.MappingProxyType(frozen)


@dataclass(frozen=True)
class ShardingPlan:
    """Placements for the tables of each EmbeddingBagCollection, keyed by the EBC's FQN.

    `modules` maps an EBC's fully-qualified name in the model ("" for the model itself) to a
    mapping of table name -> `TablePlacement`. `ranks_per_host` is the host size used by
    TABLE_ROW_WISE placements; when None, `modular.shard` uses the local world size.

    `priced_for` is what the plan was priced for (`PlanAssumptions`: batch size, optimizer,
    column-wise statistic, comm dtype, replica groups and their sync), which `planners.plan`
    fills and `modular.shard` compares with what it is given (docs/planner.md, "What a plan
    records"). None, the default of a plan written by hand, records nothing and checks nothing.
    """

    world_size: int
    modules: Mapping[str, Mapping[str, TablePlacement]] = field(default_factory=dict)
    ranks_per_host: int | None = None
    priced_for: PlanAssumptions | None = None

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or (
            self.world_size < 1
        ):
            raise PlanError(f"world_size must be a positive integer, got {self.world_size!r}")
        if self.ranks_per_host is not None and (
            isinstance(self.ranks_per_host, bool)
            or not isinstance(self.ranks_per_host, int)
            or self.ranks_per_host < 1
        ):
            raise PlanError(f"ranks_per_host must be a positive integer, got {self.ranks_per_host!r}")
        if self.priced_for is not None and not isinstance(self.priced_for, PlanAssumptions):
            raise PlanError(
                f"priced_for must be a planners.PlanAssumptions or None, got "
                f"{type(self.priced_for).__name__}; build one with PlanAssumptions(batch_size=...)"
            )
        object.__setattr__(self, "modules", _freeze_modules(self.modules))
        for fqn, tables in self.modules.items():
            for name, placement in tables.items():
                self._check_ranks(fqn, name, placement)

    def _check_ranks(self, fqn: str, table: str, placement: TablePlacement) -> None:
        where = f"table {table!r} of module {fqn!r}"
        for r in placement.ranks:
            if r >= self.world_size:
                raise PlanError(
                    f"{where} is placed on rank {r} but the plan's world size is "
                    f"{self.world_size}; use ranks in [0, {self.world_size - 1}]"
                )
        if placement.sharding_type is ShardingType.TABLE_ROW_WISE and self.ranks_per_host:
            check_one_host(placement.ranks, self.ranks_per_host, where)

    def __repr__(self) -> str:
        n = sum(len(t) for t in self.modules.values())
        kinds: dict[str, int] = {}
        for tables in self.modules.values():
            for p in tables.values():
                kinds[p.sharding_type.value] = kinds.get(p.sharding_type.value, 0) + 1
        counts = ", ".join(f"{k} {v}" for k, v in sorted(kinds.items()))
        mods = len(self.modules)
        return (f"ShardingPlan(world_size={self.world_size}, ranks_per_host={self.ranks_per_host}, "
                f"{n} table{'s' if n != 1 else ''} in {mods} module{'s' if mods != 1 else ''}"
                f"{': ' + counts if counts else ''})")  # fmt: skip

    def __str__(self) -> str:
        """One line per table: where it goes (print(plan)); first what it was priced for."""
        lines = [repr(self)]
        if self.priced_for is not None:
            lines.append(f"  priced for {self.priced_for.describe()}")
        for fqn, tables in self.modules.items():
            lines.append(f"  module {fqn!r}:")
            width = max((len(n) for n in tables), default=0)
            for name, p in tables.items():
                lines.append(f"    {name:<{width}}  {p.describe(self.world_size)}")
        return "\n".join(lines)

    def placement(self, module_fqn: str, table: str) -> TablePlacement:
        try:
            return self.modules[module_fqn][table]
        except KeyError:
            raise PlanError(f"the plan has no placement for table {table!r} of {module_fqn!r}")

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON data; 'priced_for' only where the plan records it, so a plan written
        by hand reads (and hashes) as it did before plans recorded it."""
        out: dict[str, Any] = {
            "format": _FORMAT_VERSION,
            "world_size": self.world_size,
            "ranks_per_host": self.ranks_per_host,
        }
        if self.priced_for is not None:
            out["priced_for"] = self.priced_for.to_dict()
        out["modules"] = {
            fqn: {name: p.to_dict() for name, p in tables.items()}
            for fqn, tables in self.modules.items()
        }
        return out

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ShardingPlan:
        if not isinstance(data, Mapping) or "world_size" not in data:
            raise PlanError("a plan needs 'world_size' and 'modules'")
        version = data.get("format", _FORMAT_VERSION)
        if version != _FORMAT_VERSION:
            raise PlanError(f"plan format {version!r} is not supported (expected {_FORMAT_VERSION})")
        # 'planner': the settings block `planners.files.save_plan` adds. Anything else is a typo
        # (a misspelt 'ranks_per_host' would otherwise drop the host check silently).
        known = {"format", "world_size", "ranks_per_host", "priced_for", "modules", "planner"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise PlanError(
                f"unknown fields {unknown} in the plan; a plan has 'format', 'world_size', "
                "'ranks_per_host', 'priced_for', 'modules' (and 'planner' settings)"
            )
        modules = data.get("modules", {})
        if not isinstance(modules, Mapping):
            raise PlanError(f"plan 'modules' must be an object, got {type(modules).__name__}")
        parsed = {}
        for fqn, tables in modules.items():
            if not isinstance(tables, Mapping):
                raise PlanError(f"module {fqn!r} must map table name -> placement")
            parsed[fqn] = {name: TablePlacement.from_dict(p) for name, p in tables.items()}
        # A plan written before plans recorded what they were priced for has no 'priced_for':
        # it records nothing, as a plan written by hand.
        priced = data.get("priced_for")
        return cls(
            world_size=data["world_size"],
            modules=parsed,
            ranks_per_host=data.get("ranks_per_host"),
            priced_for=None if priced is None else PlanAssumptions.from_dict(priced),
        )

    @classmethod
    def from_json(cls, text: str) -> ShardingPlan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(f"plan is not valid JSON: {e}") from None
        return cls.from_dict(data)

    def digest(self) -> str:
        """A stable hash of the plan, equal on every rank that holds the same plan."""
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ShardingPlan):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(self.digest())


def check_one_host(ranks: tuple[int, ...], ranks_per_host: int, where: str) -> None:
    """Raises unless every rank in `ranks` is on the same host."""
    hosts = sorted({r // ranks_per_host for r in ranks})
    if len(hosts) > 1:
        raise PlanError(
            f"{where} is table_row_wise over ranks {ranks}, which span hosts {hosts} "
            f"({ranks_per_host} ranks per host); pick ranks of one host or use row_wise"
        )
