"""`plan`: tables and a cluster in, a `ShardingPlan` out -- and `plan_with_stats` to see why.

Both take the same keyword arguments, spelt once as the fields of `PlanOptions`.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, TypeVar

from planners.cost import CostModel, TableArrays
from planners.mc_cost import collision_price
from planners.explain import NoPlanError, before_candidates, before_search, explain_no_plan
from planners.inputs import ColumnWiseStatistic, DataType, Optimizer, TableConstraint, Topology
from planners.model_tables import TablesLike, as_table_set, match_constraints
from planners.options import Candidates, enumerate_candidates, lower_bound
from planners.replicas import ReplicaSync, group_topology
from planners.search import Placement, SearchOutcome, search, short_of_room
from planners.tier_choice import choose_tiers, tier_overflow, with_given_tiers
from planners.evaluate import stats_for
from planners.stats import PlanStats
from planners.types import (
    PlanAssumptions, PlanError, ShardingPlan, ShardingType, TablePlacement, even_split,
)  # fmt: skip

__all__ = ["PlanOptions", "PlanResult", "plan", "plan_with_stats"]


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """Everything `plan` and `plan_with_stats` take besides the tables and the topology, as one
    record (each is described in `plan`'s docstring). The two functions take these as keyword
    arguments and build the record from them, so they are spelt once, here:

        planners.plan(tables, topology, batch_size=512, comm_dtype="fp16")
        planners.PlanOptions(batch_size=512, comm_dtype="fp16")  # the record the call builds

    Names are parsed where they are given (an unknown optimizer, statistic, dtype or sync is a
    PlanError naming the choices); `priced_for` is what the plan made under them records.
    """

    batch_size: int
    constraints: Mapping[str, TableConstraint] | None = None
    optimizer: Optimizer | str = Optimizer.ROWWISE_ADAGRAD
    module_fqn: str = ""
    column_wise_statistic: ColumnWiseStatistic | str = ColumnWiseStatistic.EXACT
    pooling_factors: Mapping[str, float] | None = None
    comm_dtype: DataType | str = DataType.FP32
    torchrec_compatible: bool = False
    replicas: int = 1
    replica_sync: ReplicaSync | str = ReplicaSync.EXACT
    prefetch: bool = False
    auto_tier: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "optimizer", Optimizer.parse(self.optimizer))
        object.__setattr__(self, "column_wise_statistic",
                           ColumnWiseStatistic.parse(self.column_wise_statistic))  # fmt: skip
        object.__setattr__(self, "comm_dtype", DataType.parse(self.comm_dtype))
        object.__setattr__(self, "replica_sync", ReplicaSync.parse(self.replica_sync))
        for name in ("prefetch", "auto_tier"):
            if not isinstance(getattr(self, name), bool):
                raise PlanError(f"{name} must be true or false, got {getattr(self, name)!r}")

    @property
    def priced_for(self) -> PlanAssumptions:
        """What a plan made under these options is priced for (`ShardingPlan.priced_for`)."""
        return PlanAssumptions(
            batch_size=self.batch_size, optimizer=self.optimizer,
            column_wise_statistic=self.column_wise_statistic, comm_dtype=self.comm_dtype,
            replicas=self.replicas, replica_sync=self.replica_sync,
        )  # fmt: skip


_R = TypeVar("_R")


def _takes_plan_options(fn: Callable[..., _R]) -> Callable[..., _R]:
    """Shows `fn(tables, topology, **options)` with `PlanOptions`'s fields as its keyword-only
    arguments, so that `help()` and `inspect.signature` list them as if spelt out; any other
    keyword is a TypeError from `PlanOptions`, as it was from the function."""
    signature = inspect.signature(fn)
    fixed = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
    options = [
        inspect.Parameter(
            f.name, inspect.Parameter.KEYWORD_ONLY, annotation=f.type,
            default=inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default,
        )  # fmt: skip
        for f in dataclasses.fields(PlanOptions)
    ]
    fn.__signature__ = signature.replace(parameters=[*fixed, *options])  # type: ignore[attr-defined]
    return fn


@dataclass(frozen=True)
class PlanResult:
    """A plan, its statistics (per-rank cost and memory, bound, imbalance) and the search time."""

    plan: ShardingPlan
    stats: PlanStats
    seconds: float


@_takes_plan_options
def plan(tables: TablesLike, topology: Topology, **options: Any) -> ShardingPlan:
    """Places every table so that the slowest rank is as fast as possible and every rank fits.

        tables = [planners.Table("t_user", 10_000_000, 128, features=("user_id",)),
                  planners.Table("t_item", 1_000_000, 64, pooling_factor=20.0)]
        plan = planners.plan(tables, planners.Topology(16, ranks_per_host=8),
                             batch_size=512)

    `tables` is a list of `Table` or of torchrec `EmbeddingBagConfig` (planned as the tables of
    the EBC at `module_fqn`, default the model itself), a {EBC FQN: [Table, ...]} mapping, or a
    model (an EBC itself included) whose EBCs may live on `meta`. Configs and models carry no
    pooling factors: `pooling_factors` maps a feature to its mean ids per sample (default 1.0):

        plan = planners.plan(ebc.embedding_bag_configs(), topology, batch_size=512,
                             pooling_factors={"item_hist": 40.0})

    `batch_size` is per rank. `constraints` maps a table name (or 'fqn.table') to its
    `TableConstraint`. `optimizer` is the fused embedding optimizer, or, for a model that is not
    fused (a torch optimizer over `modular.local_parameters` steps the tables), "unfused_sgd",
    "unfused_adagrad" or "unfused_adam": each shard is then priced with the dense kernel's
    gradient buffer as large as its weights and that torch optimizer's state (Note [what a rank
    holds] in planners/cost.py). With row-wise Adagrad (the
    default), pass the `column_wise_statistic` you give `modular.fuse_optimizer`:

        plan = planners.plan(tables, topology, batch_size=512, column_wise_statistic="per_shard")
        opt = modular.fuse_optimizer(model, "exact_rowwise_adagrad", lr=0.1,
                                     column_wise_statistic="per_shard")

    "exact" (the default) prices a table cut into column pieces with its exact row statistic (a
    second backward pass, a scratch statistic per row where a rank's pieces mix widths, and one
    fp32 per id exchanged between the pieces); "per_shard" prices each piece as a plain fused table, so cutting costs less and
    the plan may cut where "exact" would not. Under the other optimizers it changes nothing (any
    valid value is accepted). `comm_dtype` ("fp32", "fp16" or "bf16") is the dtype pooled
    embeddings travel in, as given to `modular.shard(comm_dtype=...)`; tables are priced in their
    own dtype (`Table.dtype`, FP16/BF16 at 2 bytes an element, optimizer state in FP32). The
    same input always gives the same plan.

    `torchrec_compatible=True` plans only what TorchRec's DistributedModelParallel runs as
    planned: `to_torchrec` then converts the plan with no `TorchRecLayoutWarning` and no moved
    row (row-wise over every rank, table-row-wise over a whole host, both in TorchRec's block
    split; a table whose width is no multiple of 4 only data-parallel):

        plan = planners.plan(tables, topology, batch_size=512, torchrec_compatible=True)
        tr_plan = planners.to_torchrec(plan, tables)

    `replicas=R` plans 2D sparse parallelism (`modular.shard(model, plan, mesh=mesh)` over a
    ("replicate", "shard") mesh): one shard group of `topology.world_size / R` ranks, the plan's
    world size, for the global batch of every rank, with each shard's cross-replica sync priced
    under `replica_sync` ("exact", the default: every replica group's ids and pooled gradients
    gathered each step; "periodic": nothing per step), Note [pricing replica groups]:

        plan = planners.plan(tables, planners.Topology(64, ranks_per_host=8), batch_size=512,
                             replicas=4)   # a plan for 16 ranks, replicated 4 times

    Tiered tables (docs/planner.md, "Tiered tables"): `TableConstraint(cache_load_factor=0.05)`
    puts a table on a tier behind a cache of 5% of each shard's rows, priced for its misses
    (Note [pricing tiered tables] in planners/tier_cost.py); `prefetch=True` prices a loop that
    calls `modular.prefetch`, whose reads run beside the step. When no plan fits with every
    table resident, `plan` tiers the largest tables itself (Note [choosing tiers] in
    planners/tier_choice.py; `plan_with_stats(...).stats.auto_tiers` says which), unless their
    constraints say `allow_tier=False`; `auto_tier=False` tiers no table by itself.

    The plan records what it was priced for (`plan.priced_for`: the batch size, optimizer,
    column-wise statistic, comm dtype, replicas and replica sync), and `modular.shard` checks
    it against what it is given (docs/planner.md, "What a plan records").

    The keyword arguments are the fields of `PlanOptions` (the defaults above).
    Raises `NoPlanError` (a PlanError) naming the tables that do not fit, with the numbers and
    the ways out; PlanError for invalid input.
    """
    return plan_with_stats(tables, topology, **options).plan


@_takes_plan_options
def plan_with_stats(tables: TablesLike, topology: Topology, **options: Any) -> PlanResult:
    """Like `plan` (the same arguments), and also returns the plan's statistics, priced under
    the same optimizer and `column_wise_statistic`, and how long the search took.

        result = planners.plan_with_stats(tables, topology, batch_size=512)
        print(result.stats.format())
    """
    return _plan_with_stats(tables, topology, PlanOptions(**options))


def _plan_with_stats(tables: TablesLike, topology: Topology, options: PlanOptions) -> PlanResult:
    start = time.perf_counter()
    table_set = as_table_set(tables, options.module_fqn, pooling_factors=options.pooling_factors)
    layout = None
    if options.replicas != 1:  # one shard group is planned (Note [pricing replica groups])
        topology, layout = group_topology(topology, options.replicas, options.replica_sync)
    model = CostModel(topology, options.batch_size, options.optimizer,
                      column_wise_statistic=options.column_wise_statistic,
                      comm_dtype=options.comm_dtype, replicas=layout,
                      prefetch=options.prefetch)  # fmt: skip
    cons = match_constraints(table_set, options.constraints, topology.world_size)
    cons = with_given_tiers(table_set, cons, model)
    plain = [t for _, t in table_set]
    # the batch, and managed-collision tables' state (Note [pricing managed collisions])
    base = model.batch_buffer_bytes(TableArrays.of(plain)) + collision_price(plain, model).reserve

    def searched(cons: list[TableConstraint | None], probe: bool) -> tuple[Candidates, float, SearchOutcome]:
        # What no search can overcome fails here, before it (docs/planner.md, "When no plan fits").
        early = before_candidates(table_set, cons, model, base)
        if early is not None:
            raise early
        candidates = enumerate_candidates(plain, model, cons, topology.capacity - base,
                                          torchrec=options.torchrec_compatible)  # fmt: skip
        early = before_search(table_set, candidates, cons, model, base)
        if early is not None:
            raise early
        if probe and short_of_room(plain, model, candidates, cons, float(topology.capacity)):
            return candidates, float("inf"), SearchOutcome(None, float("inf"), ())
        bound = lower_bound(candidates, topology.world_size)
        outcome = search(plain, model, candidates, cons, float(topology.capacity), bound, probe=probe)
        return candidates, bound, outcome

    def run(cons: list[TableConstraint | None]) -> tuple[tuple[Placement, ...], float]:
        candidates, bound, outcome = searched(cons, probe=False)
        if outcome.placements is None:
            raise explain_no_plan(table_set, candidates, cons, model, base, outcome.unplaced)
        return outcome.placements, bound

    def fits(cons: list[TableConstraint | None]) -> bool:
        """Whether `run(cons)` plans, from its search as a probe (Note [probing for a fit])."""
        try:
            return searched(cons, probe=True)[2].placements is not None
        except NoPlanError:  # what no search overcomes
            return False

    auto = None
    try:
        placements, bound = run(cons)
    except NoPlanError as resident:  # Note [choosing tiers]
        if not options.auto_tier:
            raise
        (placements, bound), cons, auto = choose_tiers(run, fits, table_set, cons, model, base, resident)
    modules: dict[str, dict[str, TablePlacement]] = {}
    for (fqn, table), p, con in zip(table_set, placements, cons):
        sizes = None
        if p.kind in (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE, ShardingType.COLUMN_WISE):
            total = table.embedding_dim if p.kind is ShardingType.COLUMN_WISE else table.num_embeddings
            # explicit sizes only where they differ from the default even split, so that a plan
            # reads short and survives a round trip through TorchRec unchanged
            sizes = None if p.sizes == even_split(total, len(p.sizes)) else p.sizes
        tier = {} if con is None or con.cache_load_factor is None else {
            "cache_load_factor": con.cache_load_factor, "cache_policy": con.cache_policy}
        modules.setdefault(fqn, {})[table.name] = TablePlacement(p.kind, p.ranks, sizes, **tier)
    result = ShardingPlan(topology.world_size, modules, ranks_per_host=topology.ranks_per_host,
                          priced_for=options.priced_for)  # fmt: skip
    seconds = time.perf_counter() - start
    stats = stats_for(result, table_set, model, bound, plan_seconds=seconds,
                      torchrec_compatible=options.torchrec_compatible, constraints=cons)
    if auto is not None:
        stats = dataclasses.replace(stats, auto_tiers=auto)
    over = tier_overflow(stats)  # the search packs memory; the tier is checked on what it packed
    if over is not None:
        raise over
    return PlanResult(result, stats, seconds)
