"""Per-sample weights that require grad (Note [learned per-sample weights] in
modular/routing/learned_weights.py): a sharded EBC back-propagates into them as torchrec's
unsharded EBC does.

Each rank's batch carries its own weights (a leaf that requires grad); the reference is the
unsharded EBC run on each rank's batch with its own copy of the weights, its loss the mean over
ranks of each rank's loss. So each rank's weights' gradient is `world` times the reference's
(the gradient of its own loss, which DDP then averages) and the tables' gradients equal the
reference's. Checked over 3 steps for every sharding type and the mixed plan, dense kernels
(SGD), fbgemm's fused kernel (exact SGD, widths 8 and 16), the torch emulation (odd widths),
fbgemm's deferred row-wise Adagrad (column pieces) and the Adam family, ShardedTensor and
DTensor tables, uniform batches, ranks with their own batch sizes (one of 0) and VBE batches,
with and without prefetch, and on a 2D mesh (exact replicas). Then torchrec's FeatureProcessedEmbeddingBagCollection with
PositionWeightedModule (and PositionWeightedModuleCollection) trains sharded against the
one-process reference on the global batch, its position weights all-reduced as DDP does; and
weights that require grad on some ranks only are refused on every rank.
"""

from __future__ import annotations

import copy
from typing import Callable, Optional

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.modules.feature_processor_ import PositionWeightedModule, PositionWeightedModuleCollection
from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import modular
from modular.routing.learned_weights import with_weights
from modular.tables.forms import is_sharded, local_pieces
from planners.types import ShardingPlan, ShardingType, TablePlacement
from tests.dist import expect_errors_on_all_ranks, run_on_ranks
from tests.modular.compare import full_value
from tests.modular.ebc_cases import CASES, global_batch, make_batch, make_ebc, placements_for, plan_for
from tests.modular.ebc_cases import rank_batches as uniform_batches
from tests.modular.fused_reference import FUSED_EPS, FUSED_LR, FusedReference, fused_ebc
from tests.modular.pooled.test_variable_batch import rank_batches as vbe_batches

STEPS, LR, TOL = 3, 0.5, 1e-5


def _learning(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """The batch with its weights as a fresh leaf that requires grad."""
    return with_weights(kjt, kjt.weights().detach().clone().requires_grad_())


def _sized_batches(ebc, world: int, step: int) -> list[KeyedJaggedTensor]:
    """A batch size per rank: rank r has 1 + r + step samples, rank 0 none at step 1."""
    out = [make_batch(ebc, seed=100 * step + r, batch_size=1 + r + step) for r in range(world)]
    if step == 1:
        b = out[0]
        out[0] = KeyedJaggedTensor(keys=b.keys(), values=b.values()[:0], lengths=b.lengths()[:0], weights=b.weights()[:0], stride=0)
    return out


BATCHES: dict[str, Callable[..., list[KeyedJaggedTensor]]] = {
    "uniform": uniform_batches, "sized": _sized_batches, "vbe": vbe_batches,
}  # fmt: skip


def _plan(case: str, ebc: EmbeddingBagCollection, world: int) -> ShardingPlan:
    """`plan_for`; the wide tables (the unweighted cases' names) take the unweighted mixed plan."""
    if case == "one_rank":  # every table on the last rank: the others hold no route
        names = [c.name for c in ebc.embedding_bag_configs()]
        return ShardingPlan(world_size=world, modules={"": {n: TablePlacement(ShardingType.TABLE_WISE, ranks=(world - 1,)) for n in names}})
    if case == "mixed" and tables_named(ebc, "t_sum"):
        return ShardingPlan(world_size=world, modules={"": placements_for(case, make_ebc(False), world)})
    return plan_for(case, ebc, world)


def tables_named(ebc: EmbeddingBagCollection, name: str) -> bool:
    return any(c.name == name for c in ebc.embedding_bag_configs())


def _pieces(p: torch.Tensor) -> list[tuple[torch.Tensor, slice, slice]]:
    if is_sharded(p):
        return [(t, slice(o[0], o[0] + s[0]), slice(o[1], o[1] + s[1])) for o, s, t in local_pieces(p)]
    return [(p, slice(None), slice(None))]


def _close(got, want, what: str) -> None:
    torch.testing.assert_close(got, want, atol=TOL, rtol=TOL, msg=lambda m: f"{what}: {m}")


def _train(
    case: str, tables: str, fused: Optional[str], tensor_type: str = "sharded_tensor",
    batches: str = "uniform", prefetch: bool = False, two_d: bool = False,
) -> int:  # fmt: skip
    """3 steps of one sharded EBC against the reference (module docstring); how many tensors
    were compared. `two_d`: on a ("replicate", "shard") mesh of 2 x world / 2, exact replicas."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ref = fused_ebc(weighted=True) if tables == "wide" else make_ebc(True)
    ebc = copy.deepcopy(ref)
    opt = modular.fuse_optimizer(ebc, fused, lr=FUSED_LR, eps=FUSED_EPS) if fused else None
    if two_d:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        modular.shard(ebc, _plan(case, ebc, world // 2), mesh=mesh, tensor_type=tensor_type)
    else:
        modular.shard(ebc, _plan(case, ebc, world), tensor_type=tensor_type)
    # (a rank with no shard has no parameter; torch's optimizers refuse an empty list)
    opt = opt or torch.optim.SGD(modular.local_parameters(ebc) or [torch.zeros(1, requires_grad=True)], lr=LR)
    trains_ref = fused is None or fused in ("exact_sgd", "exact_rowwise_adagrad")
    ref_opt = FusedReference(ref, fused) if fused else torch.optim.SGD(ref.parameters(), lr=LR)
    ref_params = dict(ref.named_parameters())
    label = f"{case} {tables} fused={fused} {tensor_type} {batches} prefetch={prefetch} 2D={two_d}, rank {rank}/{world}"
    compared = 0
    for step in range(STEPS):
        kjts = BATCHES[batches](ref, world, step)
        mine, refs = _learning(kjts[rank]), [_learning(b) for b in kjts]
        if prefetch:
            modular.prefetch(ebc, mine)
        got = ebc(mine).values()
        dim = sum(c.embedding_dim * len(c.feature_names) for c in ref.embedding_bag_configs())
        wants = [ref(b).values() if b.stride() else torch.zeros(0, dim) for b in refs]  # torchrec takes no empty batch
        _close(got, wants[rank], f"{label} step {step}: output")
        targets = [torch.randn(w.shape, generator=torch.Generator().manual_seed(step * 10 + r)) for r, w in enumerate(wants)]
        (got * targets[rank]).sum().backward()
        (sum((w * t).sum() for w, t in zip(wants, targets)) / world).backward()
        if mine.stride():
            _close(mine.weights().grad, refs[rank].weights().grad * world, f"{label} step {step}: weights' grad")
        compared += 1
        if fused is None:
            for name, p in ebc.named_parameters():
                for t, rows, cols in _pieces(p):
                    _close(t.grad, ref_params[name].grad[rows, cols], f"{label} step {step}: grad of {name}")
                    compared += 1
            opt.step()
            opt.zero_grad()
        if not trains_ref:  # the Adam family: one step shows its weights' gradient read the rows before the update
            break
        ref_opt.step()
        if fused is None:
            ref_opt.zero_grad()
    if trains_ref:
        for name, p in ebc.named_parameters():
            for t, rows, cols in _pieces(p):
                _close(t.detach(), ref_params[name].detach()[rows, cols], f"{label}: {name} after {STEPS} steps")
                compared += 1
    return compared


def _every_plan(kernels: tuple[tuple[str, Optional[str]], ...]) -> int:
    total = 0
    for i, case in enumerate(CASES):
        for tables, fused in kernels:
            total += _train(case, tables, fused, "dtensor" if (i + len(tables)) % 2 else "sharded_tensor")
    return total


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_weights_learn_under_every_plan_dense_and_fused(world: int) -> None:
    kernels = (("odd", None), ("wide", "exact_sgd"), ("odd", "exact_sgd"))  # dense, fbgemm's, emulated
    compared = run_on_ranks(world, _every_plan, kernels, timeout=280)
    assert min(compared) > 100, compared


def _other_paths() -> list[int]:
    """Batch sizes per rank and VBE batches (dense and fused), prefetch, the deferred row-wise
    Adagrad of column pieces, the Adam family's emulation, and ranks that hold no route (they
    still return the weights' gradients: their backward is a collective)."""
    return [
        _train("mixed", "odd", None, batches="sized"),
        _train("table_row_wise", "wide", "exact_sgd", batches="sized", tensor_type="dtensor"),
        _train("mixed", "odd", None, batches="vbe"),
        _train("column_wise", "wide", "exact_sgd", batches="vbe"),
        _train("mixed", "odd", None, prefetch=True),
        _train("row_wise", "wide", "exact_sgd", prefetch=True, batches="vbe"),
        _train("column_wise", "wide", "exact_rowwise_adagrad"),
        _train("mixed", "wide", "adam"),
        _train("one_rank", "odd", None),
        _train("one_rank", "wide", "exact_sgd", batches="vbe"),
    ]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_weights_learn_with_batch_sizes_per_rank_vbe_prefetch_and_deferred_updates(world: int) -> None:
    compared = run_on_ranks(world, _other_paths, timeout=280)
    for per_rank in compared:
        assert min(per_rank) >= 1 and sum(per_rank) > 40, compared


def _in_2d() -> list[int]:
    return [
        _train("mixed", "odd", None, two_d=True),
        _train("column_wise", "wide", "exact_sgd", two_d=True, tensor_type="dtensor"),
        _train("table_row_wise", "wide", "exact_rowwise_adagrad", two_d=True, batches="sized"),
    ]


@pytest.mark.timeout(300)
def test_weights_learn_in_2d_with_exact_replicas() -> None:
    compared = run_on_ranks(4, _in_2d, timeout=280)
    for per_rank in compared:
        assert min(per_rank) >= 4, compared


# -- torchrec's FeatureProcessedEmbeddingBagCollection -----------------------------------------------


class _Model(nn.Module):
    """A feature-processed EBC (position weights) under a linear layer."""

    def __init__(self, collection: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        ebc = make_ebc(True)
        features = sorted({f for c in ebc.embedding_bag_configs() for f in c.feature_names})
        lengths = {f: 4 for f in features}
        if collection:
            processors = PositionWeightedModuleCollection(lengths)
            for p in processors.position_weights.values():
                nn.init.uniform_(p, 0.5, 1.5)
        else:
            processors = {f: PositionWeightedModule(n) for f, n in lengths.items()}
            for m in processors.values():
                nn.init.uniform_(m.position_weight, 0.5, 1.5)
        self.fp = FeatureProcessedEmbeddingBagCollection(ebc, processors)
        self.top = nn.Linear(sum(c.embedding_dim * len(c.feature_names) for c in ebc.embedding_bag_configs()), 1)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.top(self.fp(kjt).values()).sum(1)  # not a view (FSDP2 warns of views)


def _fp_training(collection: bool, fused: Optional[str], dense_part: str) -> int:
    """3 steps of `_Model` sharded (its EBC by the mixed plan), its dense parameters (position
    weights, linear) averaged over ranks by `dense_part` ("ddp": `apply_ddp`; "fsdp2":
    `apply_fully_shard`; "all_reduce": by hand), against the model on the global batch with the
    mean over ranks of each rank's mean loss."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ref = _Model(collection)
    model = copy.deepcopy(ref)
    fqn = "fp._embedding_bag_collection"
    opt = modular.fuse_optimizer(model, fused, lr=FUSED_LR, eps=FUSED_EPS) if fused else None
    modular.shard(model, ShardingPlan(world_size=world, modules={fqn: placements_for("mixed", ref.fp._embedding_bag_collection, world)}))
    if dense_part == "ddp":
        modular.apply_ddp(model)
    elif dense_part == "fsdp2":
        modular.apply_fully_shard(model, modules={nn.Linear})
    tables = {n for n, _ in model.named_parameters() if n.startswith(fqn)}
    dense = [p for n, p in model.named_parameters() if n not in tables]
    sgd = torch.optim.SGD(modular.local_parameters(model) if fused is None else dense, lr=LR)
    ref_dense = [p for n, p in ref.named_parameters() if n not in tables]
    ref_sgd = torch.optim.SGD(ref_dense if fused else ref.parameters(), lr=LR)
    ref_fused = FusedReference(ref.fp._embedding_bag_collection, fused) if fused else None
    compared = 0
    for step in range(STEPS):
        kjts = uniform_batches(make_ebc(True), world, step)
        targets = [torch.randn(k.stride(), generator=torch.Generator().manual_seed(step * 10 + r)) for r, k in enumerate(kjts)]
        loss = ((model(kjts[rank]) - targets[rank]) ** 2).mean()
        loss.backward()
        for p in dense if dense_part == "all_reduce" else ():  # DDP's average
            dist.all_reduce(p.grad)
            p.grad /= world
        outs = ref(global_batch(kjts))
        ref_loss = sum(((o - t) ** 2).mean() for o, t in zip(outs.split([k.stride() for k in kjts]), targets)) / world
        ref_loss.backward()
        for (name, p), q in zip([(n, p) for n, p in model.named_parameters() if n not in tables], ref_dense):
            _close(full_value(p.grad), q.grad, f"{dense_part} step {step}: grad of {name}, rank {rank}")
            compared += 1
        if ref_fused is not None:
            ref_fused.step()
        for o in (sgd, ref_sgd):
            o.step()
            o.zero_grad()
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        for t, rows, cols in _pieces(p):
            want = ref_params[name].detach()
            got = full_value(t) if name not in tables else t.detach()
            _close(got, want[rows, cols] if is_sharded(p) else want, f"{dense_part}: {name} after {STEPS} steps, rank {rank}")
            compared += 1
    return compared


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_feature_processed_ebc_trains_its_position_weights_sharded(world: int) -> None:
    compared = run_on_ranks(world, _cases_fp, timeout=280)
    assert min(compared) > 30, compared


def _cases_fp() -> int:
    return (
        _fp_training(False, None, "all_reduce")
        + _fp_training(True, "exact_sgd", "ddp")
        + _fp_training(False, "exact_sgd", "fsdp2")
    )


# -- weights that require grad on some ranks only ----------------------------------------------------


def _some_ranks_learn() -> str:
    world, rank = dist.get_world_size(), dist.get_rank()
    ref = make_ebc(True)
    ebc = modular.shard(copy.deepcopy(ref), plan_for("mixed", ref, world))
    kjts = uniform_batches(ref, world, 0)
    mine = _learning(kjts[rank]) if rank == 1 else kjts[rank]
    try:
        ebc(mine)
    except modular.InputError as e:
        message = str(e)
    else:
        raise AssertionError(f"rank {rank}: weights that require grad on rank 1 only were accepted")
    got = ebc(kjts[rank]).values()  # the next batch is right
    _close(got, ref(kjts[rank]).values(), f"rank {rank}: the next batch")
    raise modular.InputError(message)


@pytest.mark.timeout(120)
def test_weights_that_learn_on_some_ranks_only_are_refused_on_every_rank() -> None:
    messages = expect_errors_on_all_ranks(3, _some_ranks_learn, timeout=100)
    for m in messages:
        assert m == messages[0], messages
    assert messages[0].startswith(
        "per-sample weights for module '' require grad on ranks [1] but not on ranks [0, 2]: in a "
        "step, every rank's weights must require grad"
    ), messages[0]


# -- torchrec's TestSparseNN, its fp_ebc's position weights learned --------------------------------


def _test_sparse_nn(variable_batch_size: bool, fused: Optional[str], turn: int = 0) -> float:
    """torchrec's TestSparseNN (an EBC, a feature-processed EBC whose PositionWeightedModuleCollection
    learns, a weighted EBC; each table under another sharding type) with its `ModelInput.generate`
    batches under `apply_ddp`, 3 steps against the one-process model on every rank's batch with
    the mean of the ranks' losses; the largest difference of any parameter after them. `turn`
    rotates the sharding types over the tables, so that turns 0-4 put every table under each."""
    from torchrec.distributed.test_utils.test_model import ModelInput, TestSparseNN

    world, rank = dist.get_world_size(), dist.get_rank()
    # Table names are feature names: TestSparseNN picks fp tables by name, its processors by feature.
    tables = [EmbeddingBagConfig(name=f"f{i}", num_embeddings=20 + i, embedding_dim=8 * (i % 2 + 1), feature_names=[f"f{i}"]) for i in range(5)]
    weighted = [EmbeddingBagConfig(name=f"w{i}", num_embeddings=15 + i, embedding_dim=8, feature_names=[f"w{i}"]) for i in range(2)]
    torch.manual_seed(0)
    ref = TestSparseNN(tables=tables, weighted_tables=weighted, num_float_features=4, max_feature_lengths={"f1": 12, "f3": 12})
    for p in ref.sparse.fp_ebc._feature_processors.position_weights.values():
        nn.init.uniform_(p, 0.5, 1.5)
    model = copy.deepcopy(ref)
    kinds = ("table_wise", "row_wise", "column_wise", "data_parallel", "table_row_wise")
    def placement(i: int, name: str) -> TablePlacement:
        cfg = EmbeddingBagConfig(name=name, num_embeddings=10, embedding_dim=8, feature_names=[name])
        return placements_for(kinds[(i + turn) % 5], EmbeddingBagCollection(tables=[cfg], device=torch.device("meta")), world)[name]

    plan = ShardingPlan(world_size=world, modules={
        "sparse.ebc": {f"f{i}": placement(i, f"f{i}") for i in (0, 2, 4)},
        "sparse.fp_ebc._embedding_bag_collection": {"f1": placement(1, "f1"), "f3": placement(2, "f3")},
        "sparse.weighted_ebc": {f"w{i}": placement(i + 3, f"w{i}") for i in range(2)},
    })  # fmt: skip
    if fused:
        modular.fuse_optimizer(model, fused, lr=0.1)
    modular.shard(model, plan)
    modular.apply_ddp(model, find_unused_parameters=True)  # TestDenseArch's dummy_param is unused
    opt = torch.optim.SGD(modular.local_parameters(model), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(STEPS):
        batches = [
            ModelInput.generate(batch_size=4, world_size=1, num_float_features=4, tables=tables, weighted_tables=weighted,
                                variable_batch_size=variable_batch_size, random_seed=100 * step + r)[0]
            for r in range(world)
        ]  # fmt: skip
        model(batches[rank])[0].backward()
        (sum(ref(b)[0] for b in batches) / world).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    refs = dict(ref.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        got = full_value(p)
        _close(got, refs[name].detach(), f"TestSparseNN {variable_batch_size=} {fused=} {turn=}: {name}, rank {rank}/{world}")
        worst = max(worst, float((got - refs[name].detach()).abs().max()))
    return worst


def _test_sparse_nns() -> list[float]:
    # Five turns: every table under every sharding type; unfused and fused, ModelInput's batches
    # with and without variable_batch_size, in each combination.
    combos = [(False, None), (True, "exact_sgd"), (False, "exact_sgd"), (True, None), (True, "exact_sgd")]
    return [_test_sparse_nn(v, f, turn) for turn, (v, f) in enumerate(combos)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_torchrecs_test_sparse_nn_learns_its_position_weights_sharded(world: int) -> None:
    worst = run_on_ranks(world, _test_sparse_nns, timeout=280)
    assert max(max(w) for w in worst) <= TOL, worst


# -- weights that do not require grad keep their path ------------------------------------------------


def _graph_nodes(t: torch.Tensor) -> set[str]:
    seen, todo, names = set(), [t.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn).__name__)
        todo.extend(f for f, _ in fn.next_functions)
    return names


def _learned_nodes() -> tuple[set[str], set[str]]:
    world, rank = dist.get_world_size(), dist.get_rank()
    ref = make_ebc(True)
    ebc = modular.shard(copy.deepcopy(ref), plan_for("mixed", ref, world))
    kjt = uniform_batches(ref, world, 1)[rank]
    learned = {"WeightGradsBackward", "WeightsReturnBackward"}
    return _graph_nodes(ebc(kjt).values()) & learned, _graph_nodes(ebc(_learning(kjt)).values()) & learned


@pytest.mark.timeout(120)
def test_weights_that_do_not_require_grad_take_none_of_the_learned_path() -> None:
    for plain, learning in run_on_ranks(2, _learned_nodes, timeout=100):
        assert plain == set() and learning == {"WeightGradsBackward", "WeightsReturnBackward"}, (plain, learning)
