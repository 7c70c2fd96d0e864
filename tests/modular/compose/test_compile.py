"""`torch.compile` over sharded models trains exactly like eager, with a fixed set of graphs.

Each rank body runs many cases back to back (compiling is slow on a small machine; the graphs of
every case are the same dense towers, so inductor's cache serves all but the first): for each,
the same seeded DLRM is sharded and trained twice, eagerly and compiled, on batches whose
lengths and ids (and in some cases sizes) vary from step to step, and the two must give the same
losses and every rank's weights to 1e-5 (so fused tables updated once per step, inside backward,
and parameters stayed current). The compiled run asserts dynamo's counters: after the warm-up
(the first step; the second too where an unmarked batch size changes) no graph is ever compiled
again (`error_on_recompile`), and every graph break is a deliberate one (Note [compiling a
sharded model] in modular/compose/compile.py), one per sharded EBC in the traced code, or FSDP2's / DDP's.
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple, Optional

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import modular
from planners.types import ShardingPlan, ShardingType, TablePlacement
from tests.dist import run_on_ranks
from tests.modular.dlrm_cases import (
    DLRM, MLP, Batch, global_loss, loss_of, mixed_plan, DLRM_DENSE_IN as DENSE_IN, DLRM_FEATURES as FEATURES,
    DLRM_LR as LR, dlrm_tables as table_configs,
)

TIMEOUT = 240.0
STEPS = 4
COUNTED_STEPS = 20
ATOL = 1e-5  # inductor may reorder float sums: ~1e-6 apart after 20 steps at lr 0.5
PLANS = ("table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel", "mixed")
FUSED = (None, "exact_sgd", "exact_adagrad", "exact_rowwise_adagrad")
WRAPS = (None, "fsdp", "ddp")
DISABLED = "Skip inlining `torch.compiler.disable()`d function"
WRAPPER_BREAKS = {  # graph breaks of FSDP2's hooks (skip_fsdp_hooks) and of DDP's forward
    None: (),
    "fsdp": ("Attempted to call function marked as skipped",),
    # composable DDP's (apply_ddp) pre- and post-forward hooks: its lazy init, _pre_forward's
    # bookkeeping and its autograd hooks
    "ddp": (
        "Attempted to call function marked as skipped", "Unsupported method call",
        "torch.* op returned non-Tensor", "Failed to convert args/kwargs to proxy",
        "setattr() on unsupported type",
    ),
}


class Case(NamedTuple):
    plan: str
    fused: Optional[str]
    prefetch: bool
    wrap: Optional[str]  # FSDP2 or DDP on the dense part
    whole: bool  # torch.compile(model), not only apply_compile on each tower (both under FSDP2)
    steps: int = STEPS
    # Marks the dense input's batch dimension dynamic, so nothing compiles after the first step;
    # otherwise dynamo compiles once more on the second step's new batch size, then never again.
    mark_dynamic: bool = False
    # Batch sizes 3, 4, then 3-5; otherwise 4 samples every step (lengths and ids still vary).
    vary_batch: bool = False


def cases_for(world: int) -> list[Case]:
    """Every plan once; fused optimizers, prefetch, wrappers and compile modes rotate over them."""
    cases = [
        Case(plan, FUSED[i % 4], bool(i % 2), WRAPS[(i + world) % 3], bool((i // 2 + world) % 2))
        for i, plan in enumerate(PLANS)
    ]
    # One case per world whose batch size varies, unmarked: a second compile at the first new
    # size (dynamo's automatic dynamic shapes), then none.
    return [c._replace(vary_batch=True) if i == world else c for i, c in enumerate(cases)]


def plan_for(name: str, world: int) -> ShardingPlan:
    if name == "mixed":
        return mixed_plan(world)
    names = [c.name for c in table_configs()]
    kind = ShardingType[name.upper()]
    if kind is ShardingType.TABLE_WISE:  # spread over ranks, starting at the last one
        placements = {n: TablePlacement(kind, ranks=((world - 1 + i) % world,)) for i, n in enumerate(names)}
    elif kind is ShardingType.TABLE_ROW_WISE:
        placements = {n: TablePlacement(kind, ranks=tuple(range(world))) for n in names}
    else:
        placements = {n: TablePlacement(kind) for n in names}
    return ShardingPlan(world_size=world, modules={"sparse": placements})


def make_batch(step: int, rank: int, vary_batch: bool, mark_dynamic: bool) -> Batch:
    """0-3 ids per bag: lengths and id counts vary with the step, and with `vary_batch` the
    batch size too (3 samples, then 4, then 3-5 by step; the same on every rank, which input
    dist requires)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    size = 4 if not vary_batch else (3, 4)[step] if step < 2 else 3 + step % 3
    rows = {f"f_{c.name[2:]}": c.num_embeddings for c in table_configs()}
    lengths = [torch.randint(0, 4, (size,), generator=g) for _ in FEATURES]
    values = [torch.randint(0, rows[f], (int(n.sum()),), generator=g) for f, n in zip(FEATURES, lengths)]
    dense = torch.randn(size, DENSE_IN, generator=g)
    if mark_dynamic:  # Note [compiling a sharded model]: varying batch sizes
        torch._dynamo.mark_dynamic(dense, 0)
    return Batch(
        dense=dense,
        sparse=KeyedJaggedTensor(keys=list(FEATURES), values=torch.cat(values), lengths=torch.cat(lengths)),
        labels=torch.randint(0, 2, (size,), generator=g).float(),
    )


class Run(NamedTuple):
    losses: list[float]
    weights: dict[str, torch.Tensor]  # this rank's piece of every parameter, after training
    graphs: int  # graphs dynamo compiled
    breaks: dict[str, int]  # graph breaks by the first line of their reason


def _train(case: Case, compiled: bool) -> Run:
    world, rank = dist.get_world_size(), dist.get_rank()
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = DLRM()
    tables_opt = modular.fuse_optimizer(model, case.fused, lr=LR) if case.fused else None
    model = modular.shard(model, plan_for(case.plan, world))
    if case.wrap == "fsdp":
        model = modular.apply_fully_shard(model, modules={MLP})
    call = modular.apply_ddp(model) if case.wrap == "ddp" else model
    if compiled and (not case.whole or case.wrap == "fsdp"):
        # FSDP2 keeps dynamo out of a fully sharded module's call, so under FSDP2 the towers
        # compile only this way (Note [compiling a sharded model]).
        model = modular.apply_compile(model, modules={MLP})
    if compiled and case.whole:
        call = torch.compile(call)
    opts = {"dense": torch.optim.SGD(modular.local_parameters(model), lr=LR)}
    if tables_opt is not None:
        opts["tables"] = tables_opt
    opt = modular.CombinedOptimizer(opts)
    batches = [make_batch(step, rank, case.vary_batch, case.mark_dynamic) for step in range(case.steps)]
    # Two warm-up steps where the batch size changes once (dynamo's automatic dynamic shapes), or
    # under apply_ddp compiled whole: composable DDP initialises itself in its first forward's
    # hook, so the second forward recompiles that hook once (Note [compiling a sharded model]).
    varies = case.vary_batch and not case.mark_dynamic
    warm_up = 2 if varies or (case.wrap == "ddp" and compiled and case.whole) else 1
    losses = []
    for step, batch in enumerate(batches):
        if case.prefetch and step + 1 < case.steps:
            modular.prefetch(model, batches[step + 1].sparse)
        # After the warm-up nothing may compile again, whatever the batch.
        with torch._dynamo.config.patch(error_on_recompile=step >= warm_up):
            loss = loss_of(call, batch)
            opt.zero_grad()
            loss.backward()
        opt.step()
        losses.append(global_loss(loss))
    return Run(
        losses=losses,
        weights={n: _local(p) for n, p in model.named_parameters()},
        graphs=counters["stats"]["unique_graphs"],
        breaks=dict(Counter({k.split("\n")[0]: v for k, v in counters["graph_break"].items()})),
    )


def _local(p: torch.Tensor) -> torch.Tensor:
    if isinstance(p, ShardedTensor):
        return torch.cat([torch.zeros(0), *(s.tensor.detach().reshape(-1) for s in p.local_shards())])
    if isinstance(p, DTensor):
        return p.to_local().detach().clone()
    return p.detach().clone()


def _compiled_vs_eager(cases: list[Case]) -> list[tuple[Case, list[float], list[float], int, dict[str, int]]]:
    out = []
    for case in cases:
        eager, compiled = _train(case, False), _train(case, True)
        assert eager.graphs == 0 and not eager.breaks, f"{case}: the eager run compiled"
        for name, w in eager.weights.items():
            torch.testing.assert_close(compiled.weights[name], w, atol=ATOL, rtol=0,
                                       msg=lambda m: f"{case}: {name} after {case.steps} steps: {m}")
        out.append((case, eager.losses, compiled.losses, compiled.graphs, compiled.breaks))
    return out


def _check(results: list, world: int) -> None:
    for rank_results in results[1:]:
        assert [r[2] for r in rank_results] == [r[2] for r in results[0]], "ranks saw other losses"
    for case, eager, compiled, graphs, breaks in results[0]:
        assert compiled == pytest.approx(eager, abs=ATOL, rel=0), f"{case}: compiled {compiled} vs eager {eager}"
        assert eager[0] != pytest.approx(eager[-1], abs=1e-4), f"{case}: did not train"
        if case.whole:
            # The whole model: the one deliberate break at the sharded EBC, traced once per
            # compile of its frame (the first step, and the second's new batch size unless the
            # batch dimension is marked dynamic); FSDP's hooks and DDP's forward break too, as in
            # any model they wrap. Nothing inside modular may break the graph.
            compiles = 2 if case.vary_batch and not case.mark_dynamic else 1
            assert breaks.get(DISABLED) == compiles, f"{case}: {breaks}"
            assert set(breaks) <= {DISABLED, *WRAPPER_BREAKS[case.wrap]}, f"{case}: {breaks}"
        else:
            # Each tower compiles without a break (the EBC runs outside the compiled code).
            assert not breaks, f"{case}: {breaks}"
        assert 0 < graphs <= 12, f"{case}: {graphs} graphs"


@pytest.mark.parametrize("world", [1, 2, 3])
def test_compiled_training_matches_eager_for_every_plan(world: int) -> None:
    cases = cases_for(world)
    if world == 2:  # 20 steps of the mixed plan, fused, prefetched, whole model, no warm-up
        cases.append(Case("mixed", "exact_rowwise_adagrad", True, None, True, COUNTED_STEPS, True, True))
    _check(run_on_ranks(world, _compiled_vs_eager, cases, timeout=TIMEOUT), world)


def test_cases_cover_every_plan_fused_optimizer_prefetch_wrapper_and_mode() -> None:
    cases = [c for world in (1, 2, 3) for c in cases_for(world)]
    assert {c.plan for c in cases} == set(PLANS)
    assert {c.fused for c in cases} == set(FUSED)
    assert {(c.prefetch, c.whole) for c in cases} == {(p, w) for p in (True, False) for w in (True, False)}
    assert {(c.wrap, c.whole) for c in cases} == {(w, m) for w in WRAPS for m in (True, False)}
    assert {(c.wrap, c.whole) for c in cases if c.vary_batch} == {(None, False), ("fsdp", True), ("ddp", True)}


class _Wrapped(torch.nn.Module):
    """The DLRM one level down: a module that contains a sharded EBC and can be picked."""

    def __init__(self, inner: DLRM) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.inner(dense, kjt)


def _refusals() -> dict[str, str]:
    torch.manual_seed(0)
    model = _Wrapped(modular.shard(DLRM(), plan_for("row_wise", 1)))
    got = {}
    for what, call in {
        "fullgraph": lambda: modular.apply_compile(model, modules={DLRM}, fullgraph=True),
        "ebc": lambda: modular.apply_compile(model.inner.sparse, modules={MLP}),
    }.items():
        with pytest.raises(modular.ShardingError) as e:
            call()
        got[what] = str(e.value)
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported) as e:
        torch.compile(model, fullgraph=True)(*make_batch(0, 0, False, False)[:2])
    got["dynamo"] = str(e.value)
    return got


def test_configurations_that_cannot_compile_are_refused_naming_the_module() -> None:
    got = run_on_ranks(1, _refusals, timeout=TIMEOUT)[0]
    assert "module 'inner' contains the sharded EmbeddingBagCollection 'sparse'" in got["fullgraph"]
    assert "drop fullgraph=True" in got["fullgraph"]
    assert "given a ShardedEmbeddingBagCollection" in got["ebc"]
    # torch.compile(fullgraph=True) over the whole model fails in dynamo with our reason.
    assert "runs its forward (input dist -> lookup -> output dist" in got["dynamo"]
    assert "Note [compiling a sharded model]" in got["dynamo"]
