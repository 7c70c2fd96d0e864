"""What the planner is told: tables, the cluster, the optimizer and per-table constraints.

All inputs are frozen dataclasses validated in `__post_init__`, so a bad value fails where it is
made, with the table or field named. Sizes are bytes; bandwidths are bytes per second; the
defaults of `Topology` describe one node of a current GPU cluster (8 x H100 SXM 80 GB, NVLink,
one 400 Gb/s NIC per GPU); docs/planner.md says where each number comes from.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

# The optimizer, statistic and dtype vocabularies live beside the record of them a plan carries
# (planners/assumptions.py); they are re-exported here, where the planner's inputs are.
from planners.calibration import Calibration
from planners.assumptions import ColumnWiseStatistic, DataType, Optimizer, _parse_member
from planners.tier_cost import DEFAULT_ZIPF_ALPHA, TierSpec
from planners.types import PlanError, ShardingType

__all__ = [
    "ColumnWiseStatistic",
    "DataType",
    "EvictionPolicy",
    "ManagedCollision",
    "Optimizer",
    "Table",
    "TableConstraint",
    "Topology",
    "format_bytes",
    "parse_bytes",
]

GiB = 1024**3
MAX_WORLD_SIZE = 1 << 20


_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}  # fmt: skip


def parse_bytes(value: str | int | float, what: str = "size") -> int:
    """Parses "80GiB", "80 GB", "1.5e9" or 1024 into bytes (GiB = 2**30, GB = 10**9)."""
    if isinstance(value, bool):
        raise PlanError(f"{what} must be a byte count like '80GiB', got {value!r}")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    elif isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", value)
        if not match or match.group(2).lower() not in _UNITS:
            raise PlanError(
                f"{what} must be a byte count like '80GiB', '80GB' or '85899345920', got {value!r}"
            )
        number, unit = float(match.group(1)), match.group(2).lower()
    else:  # e.g. a list or mapping in a plan file's settings
        raise PlanError(f"{what} must be a byte count like '80GiB', got {value!r}")
    result = number * _UNITS[unit]
    if not math.isfinite(result) or result <= 0:
        raise PlanError(f"{what} must be positive, got {value!r}")
    return int(result)


def format_bytes(num: float) -> str:
    """1536 -> '1.5 KiB'; used in reports and error messages."""
    for unit, size in (("TiB", 1024**4), ("GiB", GiB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(num) >= size:
            return f"{num / size:.1f} {unit}"
    return f"{num:.0f} B"


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"{what} must be a positive integer, got {value!r}")
    return value


def _positive_float(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise PlanError(f"{what} must be a positive number, got {value!r}")
    if not math.isfinite(value):
        raise PlanError(f"{what} must be finite, got {value!r}")
    return float(value)


class EvictionPolicy(enum.Enum):
    """torchrec's MCH eviction policies, by the metadata each keeps per slot (an int64 each)."""

    LRU = "lru"  # last access
    LFU = "lfu"  # counts
    DISTANCE_LFU = "distance_lfu"  # counts and last access

    @property
    def metadata_columns(self) -> int:
        return 2 if self is EvictionPolicy.DISTANCE_LFU else 1

    @classmethod
    def parse(cls, value: str | EvictionPolicy) -> EvictionPolicy:
        return _parse_member(cls, value, "eviction policy")


@dataclass(frozen=True)
class ManagedCollision:
    """A table behind torchrec's managed-collision module (`MCHManagedCollisionModule`): its
    features are raw ids, remapped into `zch_size` slots (the table's rows) every step.

        Table("t_user", 1_000_000, 64, managed_collision=ManagedCollision(1_000_000))

    The planner prices its collision state (split by slot over every rank) and the remap
    (planners/mc_cost.py); `tables_from_model` reads all three from the model.
    """

    zch_size: int
    eviction_interval: int = 1
    eviction_policy: EvictionPolicy = EvictionPolicy.DISTANCE_LFU

    def __post_init__(self) -> None:
        _positive_int(self.zch_size, "managed_collision: zch_size")
        _positive_int(self.eviction_interval, "managed_collision: eviction_interval")
        object.__setattr__(self, "eviction_policy", EvictionPolicy.parse(self.eviction_policy))

    @classmethod
    def of(cls, value: ManagedCollision | Mapping[str, Any] | int) -> ManagedCollision:
        """From a record's value: a zch_size, or a mapping of these fields."""
        if isinstance(value, ManagedCollision):
            return value
        if isinstance(value, Mapping):
            unknown = sorted(set(value) - {"zch_size", "eviction_interval", "eviction_policy"})
            if unknown:
                raise PlanError(f"managed_collision has no field {unknown[0]!r}; its fields are "
                                "zch_size, eviction_interval, eviction_policy")  # fmt: skip
            return cls(**value)
        return cls(value)

    def to_dict(self) -> dict[str, Any]:
        return {"zch_size": self.zch_size, "eviction_interval": self.eviction_interval,
                "eviction_policy": self.eviction_policy.value}  # fmt: skip


@dataclass(frozen=True)
class Table:
    """One embedding table as the planner sees it.

        Table("t_user", 10_000_000, 128, features=("user_id",), pooling_factor=1.0)

    `features` are the features looked up in this table (default: one feature named after the
    table); `pooling_factor` is the average number of ids per sample, one number for all features
    or one per feature. `weighted` tables carry a float weight per id. A `sequence` table belongs
    to an EmbeddingCollection: every id's row is returned, not pooled, so its output (and the
    output dist's bytes) is one row per id instead of one per feature and sample, and its
    `pooling_factor` is the average sequence length. `batch_fraction` (one number for all
    features or one per feature, in (0, 1]) is a feature's average bags per sample: a
    request-level feature deduplicated over 8 candidates of a request has 0.125 (a
    variable-batch KJT, Note [variable batch per feature] in modular/routing/variable_batch.py);
    lookups and both all-to-alls are priced at that many bags. A `managed_collision` table
    takes raw ids remapped into its `num_embeddings` slots (`ManagedCollision`, whose
    `zch_size` is the row count, as torchrec requires).
    """

    name: str
    num_embeddings: int
    embedding_dim: int
    features: tuple[str, ...] = ()
    pooling_factor: float | tuple[float, ...] = 1.0
    dtype: DataType = DataType.FP32
    weighted: bool = False
    sequence: bool = False
    batch_fraction: float | tuple[float, ...] = 1.0
    managed_collision: ManagedCollision | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise PlanError(f"a table needs a non-empty string name, got {self.name!r}")
        where = f"table {self.name!r}"
        _positive_int(self.num_embeddings, f"{where}: num_embeddings")
        _positive_int(self.embedding_dim, f"{where}: embedding_dim")
        features = (self.features,) if isinstance(self.features, str) else self.features
        features = tuple(features) or (self.name,)
        if not all(isinstance(f, str) and f for f in features):
            raise PlanError(f"{where}: features must be non-empty strings, got {features!r}")
        if len(set(features)) != len(features):
            raise PlanError(f"{where} lists a feature twice: {features}")
        object.__setattr__(self, "features", features)
        pf = _per_feature(self.pooling_factor, features, where, "pooling_factor", "pooling factors")
        object.__setattr__(self, "pooling_factor", pf)
        object.__setattr__(self, "dtype", DataType.parse(self.dtype))
        if not isinstance(self.weighted, bool):
            raise PlanError(f"{where}: weighted must be true or false, got {self.weighted!r}")
        if not isinstance(self.sequence, bool):
            raise PlanError(f"{where}: sequence must be true or false, got {self.sequence!r}")
        if self.sequence and self.weighted:
            raise PlanError(
                f"{where}: a sequence table (an EmbeddingCollection's) has no per-id weights; "
                "drop weighted=True"
            )
        fractions = _per_feature(self.batch_fraction, features, where, "batch_fraction", "batch fractions")
        if any(f > 1.0 for f in fractions):
            raise PlanError(
                f"{where}: batch_fraction is a feature's bags per sample, at most 1 (one bag per "
                f"sample); got {self.batch_fraction}"
            )
        object.__setattr__(self, "batch_fraction", fractions)
        if self.sequence and any(f != 1.0 for f in self.batch_fraction):
            raise PlanError(
                f"{where}: a sequence table (an EmbeddingCollection's) takes one bag per sample "
                "(torchrec's EmbeddingCollection has no variable batch); drop batch_fraction"
            )
        if self.managed_collision is not None:
            mc = ManagedCollision.of(self.managed_collision)
            object.__setattr__(self, "managed_collision", mc)
            if mc.zch_size != self.num_embeddings:
                raise PlanError(
                    f"{where}: managed_collision zch_size {mc.zch_size:_} must equal "
                    f"num_embeddings {self.num_embeddings:_} (torchrec's ManagedCollisionCollection "
                    "requires a table of zch_size rows)"
                )

    @property
    def pooling_factors(self) -> tuple[float, ...]:
        """One average pooling factor per feature (normalised in `__post_init__`)."""
        return self.pooling_factor  # type: ignore[return-value]

    @property
    def batch_fractions(self) -> tuple[float, ...]:
        """Each feature's bags per sample (normalised in `__post_init__`)."""
        return self.batch_fraction  # type: ignore[return-value]

    @property
    def weight_bytes(self) -> int:
        return self.num_embeddings * self.embedding_dim * self.dtype.num_bytes

    def to_dict(self) -> dict[str, Any]:
        pf = self.pooling_factors
        return {
            "name": self.name,
            "num_embeddings": self.num_embeddings,
            "embedding_dim": self.embedding_dim,
            "features": list(self.features),
            "pooling_factor": pf[0] if len(set(pf)) == 1 else list(pf),
            "dtype": self.dtype.value,
            "weighted": self.weighted,
            **({"sequence": True} if self.sequence else {}),
            **_fraction_entry(self.batch_fractions),
            **({"managed_collision": self.managed_collision.to_dict()}
               if self.managed_collision is not None else {}),  # fmt: skip
        }


def _per_feature(
    value: Any, features: tuple[str, ...], where: str, field: str, plural: str
) -> tuple[float, ...]:
    """A table's `field` as one positive number per feature: one number for all, or a list."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = (value,) * len(features)
    elif isinstance(value, Iterable) and not isinstance(value, str):
        value = tuple(value)
    else:
        raise PlanError(f"{where}: {field} must be a number or a list, got {value!r}")
    if len(value) != len(features):
        raise PlanError(
            f"{where} has {len(features)} features {features} but {len(value)} {plural} "
            f"{value}; give one number, or one per feature"
        )
    return tuple(_positive_float(v, f"{where}: {field}") for v in value)


def _fraction_entry(fractions: tuple[float, ...]) -> dict[str, Any]:
    if all(f == 1.0 for f in fractions):
        return {}
    return {"batch_fraction": fractions[0] if len(set(fractions)) == 1 else list(fractions)}


@dataclass(frozen=True)
class Topology:
    """The cluster: how many ranks, how they are grouped into hosts, memory and bandwidths.

        Topology(64, ranks_per_host=8, device_memory=80 * 2**30)

    Bytes and bytes/second. `reserved_fraction` of each device's memory is kept free for the
    dense model, activations and the CUDA context; the planner fills the rest. `host_memory`
    is recorded for reports only: every kernel the planner chooses keeps its rows in device memory.
    `tier_memory` is each rank's room for tiered tables' stores (local disk under `tier_dir` on
    CPU ranks, host memory on CUDA), read and written at `tier_bandwidth` (Note [pricing tiered
    tables] in planners/tier_cost.py; host memory over PCIe is ~25e9 on CUDA).
    """

    world_size: int
    ranks_per_host: int | None = None  # default: min(8, world_size)
    device_memory: int = 80 * GiB
    host_memory: int = 2048 * GiB
    device_memory_bandwidth: float = 3.35e12  # H100 SXM HBM3
    intra_host_bandwidth: float = 450e9  # NVLink 4, per direction per GPU
    cross_host_bandwidth: float = 50e9  # one 400 Gb/s NIC per GPU
    reserved_fraction: float = 0.1
    tier_memory: int = 1024 * GiB
    tier_bandwidth: float = 2e9  # local disk / page cache
    # Measured constants (`python -m planners calibrate`, Note [calibrated prices] in
    # planners/calibration.py); None prices with the bandwidths above.
    calibration: Calibration | None = None

    @classmethod
    def from_file(cls, path: str, world_size: int | None = None, **kwargs: Any) -> "Topology":
        """The topology a `python -m planners calibrate --out FILE` run measured: its world size
        (or `world_size`), priced with its measured constants, and the tier's `tier_memory` and
        `tier_bandwidth` where the file gives them; other fields as for `Topology`.

            topology = planners.Topology.from_file("this_machine.json", device_memory="20GiB")
        """
        calibration = Calibration.load(path)
        world = calibration.world_size if world_size is None else world_size
        for name in ("tier_memory", "tier_bandwidth"):  # written in by hand, where known
            if getattr(calibration, name) is not None:
                kwargs.setdefault(name, getattr(calibration, name))
        return cls(world, calibration=calibration, **kwargs)

    @property
    def constants(self) -> str:
        """Which constants price a step: one line for reports."""
        if self.calibration is None:
            return ("priced with the default constants (an H100 cluster: HBM3, NVLink 4, 400 Gb/s "
                    "NICs); measure this machine with `python -m planners calibrate --out FILE`")
        return self.calibration.describe()

    def __post_init__(self) -> None:
        _positive_int(self.world_size, "world_size")
        if self.world_size > MAX_WORLD_SIZE:  # the planner keeps per-rank arrays
            raise PlanError(
                f"world_size {self.world_size} is more ranks than the planner handles "
                f"(at most {MAX_WORLD_SIZE:_})"
            )
        if self.ranks_per_host is None:
            object.__setattr__(self, "ranks_per_host", min(8, self.world_size))
        _positive_int(self.ranks_per_host, "ranks_per_host")
        if self.world_size % self.ranks_per_host:  # type: ignore[operator]
            raise PlanError(
                f"world_size {self.world_size} is not a multiple of ranks_per_host "
                f"{self.ranks_per_host}; every host must have the same number of ranks"
            )
        object.__setattr__(self, "device_memory", parse_bytes(self.device_memory, "device_memory"))
        object.__setattr__(self, "host_memory", parse_bytes(self.host_memory, "host_memory"))
        object.__setattr__(self, "tier_memory", parse_bytes(self.tier_memory, "tier_memory"))
        for name in ("device_memory_bandwidth", "intra_host_bandwidth", "cross_host_bandwidth",
                     "tier_bandwidth"):
            _positive_float(getattr(self, name), name)
        r = self.reserved_fraction
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r < 1:
            raise PlanError(f"reserved_fraction must be in [0, 1), got {r!r}")
        if self.capacity < 1:  # found by the fuzzer: a 1-byte device left 0 and divided by it
            raise PlanError(
                f"device_memory {self.device_memory} B less the reserved {r:.0%} leaves no memory "
                "for tables; give the device's memory, e.g. '80GiB'"
            )

    @property
    def hosts(self) -> int:
        return self.world_size // self.ranks_per_host  # type: ignore[operator]

    @property
    def capacity(self) -> int:
        """Bytes per rank the planner may fill: device_memory * (1 - reserved_fraction)."""
        return int(self.device_memory * (1 - self.reserved_fraction))


@dataclass(frozen=True)
class TableConstraint:
    """What the user allows for one table.

        TableConstraint(sharding_types=(ShardingType.ROW_WISE,), ranks=(0, 1, 2, 3))

    `sharding_types` lists the allowed types (empty: all). `ranks` pins the table: its shards go
    only to these ranks (data-parallel is then not allowed unless `ranks` is every rank).
    `min_shards`/`max_shards` bound the shard count of table-, row- and column-wise placements.
    `cache_load_factor` (0 < f <= 1) puts the table's shards on a slower tier with a cache of that
    fraction of each shard's rows, replaced by `cache_policy` ("lru" or "lfu"; Note [tiered
    tables] in modular/tiered/__init__.py). Its misses are priced from `hit_rate` (the share of
    lookups the cache serves) when given, else from ids following Zipf(`zipf_alpha`) (Note
    [pricing tiered tables] in planners/tier_cost.py). Without `cache_load_factor`, `plan` tiers
    a table by itself only when no plan fits with every table resident; `allow_tier=False` keeps
    the table resident whatever happens.
    """

    sharding_types: tuple[ShardingType, ...] = ()
    ranks: tuple[int, ...] = ()
    min_shards: int = 1
    max_shards: int | None = None
    cache_load_factor: float | None = None
    cache_policy: str = "lru"
    hit_rate: float | None = None
    zipf_alpha: float = DEFAULT_ZIPF_ALPHA
    allow_tier: bool = True

    def __post_init__(self) -> None:
        types_ = self.sharding_types
        if isinstance(types_, (str, ShardingType)):
            types_ = (types_,)
        object.__setattr__(self, "sharding_types", tuple(ShardingType.parse(t) for t in types_))
        ranks = tuple(self.ranks)
        if any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in ranks):
            raise PlanError(f"pinned ranks must be non-negative integers, got {ranks!r}")
        if len(set(ranks)) != len(ranks):
            raise PlanError(f"pinned ranks list a rank twice: {ranks}")
        object.__setattr__(self, "ranks", tuple(sorted(ranks)))
        _positive_int(self.min_shards, "min_shards")
        if self.max_shards is not None:
            _positive_int(self.max_shards, "max_shards")
            if self.max_shards < self.min_shards:
                raise PlanError(
                    f"max_shards {self.max_shards} is below min_shards {self.min_shards}"
                )
        factor = self.cache_load_factor
        if factor is not None:
            _positive_float(factor, "cache_load_factor")
            if factor > 1:
                raise PlanError(f"cache_load_factor must be at most 1, got {factor!r}")
        if self.cache_policy not in ("lru", "lfu"):
            raise PlanError(f'cache_policy must be "lru" or "lfu", got {self.cache_policy!r}')
        h = self.hit_rate
        if h is not None and (isinstance(h, bool) or not isinstance(h, (int, float)) or not 0 <= h <= 1):
            raise PlanError(f"hit_rate is the share of lookups the cache serves, in [0, 1]; got "
                            f"{self.hit_rate!r}")  # fmt: skip
        _positive_float(self.zipf_alpha, "zipf_alpha")
        if not isinstance(self.allow_tier, bool):
            raise PlanError(f"allow_tier must be true or false, got {self.allow_tier!r}")
        if not self.allow_tier and factor is not None:
            raise PlanError(f"cache_load_factor={factor} tiers the table but allow_tier=False "
                            "keeps it resident; drop one of them")  # fmt: skip

    @property
    def tier(self) -> "TierSpec | None":
        """The tier it asks for (`cache_load_factor`), as the cost model prices it; None: resident."""
        if self.cache_load_factor is None:
            return None
        return TierSpec(self.cache_load_factor, self.cache_policy, self.hit_rate, self.zipf_alpha)

    def allows(self, kind: ShardingType) -> bool:
        return not self.sharding_types or kind in self.sharding_types
