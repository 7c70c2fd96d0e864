"""Random EBCs under random plans train exactly like the unsharded EBC (seeded fuzzing, end to end).

tests/faults/test_layout_properties.py checks the routes of random plans without running them;
here random tables (shared features, SUM and MEAN, widths fbgemm takes and widths it does not,
rows fewer than ranks), random placements (a rank holding several column pieces, uneven row
shards, ranks out of order, data-parallel copies) and a random optimizer (a torch optimizer
over `local_parameters`, or a fused one, fused before sharding) train for a few steps
on gloo ranks, and every output, weight and optimizer state is compared with the unsharded EBC
trained on the global batch in the same rank. Each case is rebuilt from its seed, so a failure
names the seed and the case; `MODULAR_FUZZ_CASES` runs more of them (the suite runs a few).
"""

from __future__ import annotations

import copy
import os
import random
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection

import modular
from planners.types import ShardingPlan, ShardingType, TablePlacement
from tests.dist import run_on_ranks
from tests.modular.compare import local_blocks, state_error
from tests.modular.ebc_cases import global_batch, make_batch
from tests.modular.fused_reference import FUSED_EPS as EPS, FUSED_LR as LR, FusedReference

CASES = int(os.environ.get("MODULAR_FUZZ_CASES", "25"))
STEPS = 3
FEATURES = ("fa", "fb", "fc", "fd")
OPTIMIZERS = ("dense_sgd", "dense_adagrad", "exact_sgd", "exact_adagrad", "exact_rowwise_adagrad")


@dataclass(frozen=True)
class Case:
    seed: int
    world: int
    tables: tuple[tuple[str, int, int, tuple[str, ...], str], ...]  # name, rows, dim, features, pooling
    placements: tuple[TablePlacement, ...]
    weighted: bool
    optimizer: str


def _compositions(rng: random.Random, total: int, n: int) -> tuple[int, ...]:
    cuts = sorted(rng.sample(range(1, total), n - 1))
    return tuple(b - a for a, b in zip((0, *cuts), (*cuts, total)))


def _placement(rng: random.Random, world: int, rows: int, dim: int) -> TablePlacement:
    kind = rng.choice(list(ShardingType))
    if kind is ShardingType.DATA_PARALLEL:
        return TablePlacement(kind)
    if kind is ShardingType.TABLE_WISE:
        return TablePlacement(kind, ranks=(rng.randrange(world),))
    if kind is ShardingType.COLUMN_WISE:  # a rank may hold several pieces
        n = rng.randint(1, min(dim, 2 * world))
        ranks = tuple(rng.randrange(world) for _ in range(n))
        total = dim
    else:
        n = rng.randint(1, min(rows, world))
        ranks = tuple(rng.sample(range(world), n))
        total = rows
    sizes = _compositions(rng, total, n) if rng.random() < 0.5 else None
    return TablePlacement(kind, ranks=ranks, sizes=sizes)


def make_case(seed: int, world: int) -> Case:
    rng = random.Random(seed * 31 + world)
    weighted = rng.random() < 0.25
    tables, placements = [], []
    for i in range(rng.randint(1, 4)):
        rows = rng.randint(1, 30)
        dim = rng.choice((1, 2, 3, 4, 5, 7, 8, 8, 12, 16, 16, 24))
        features = tuple(rng.sample(FEATURES, rng.randint(1, 2)))
        pooling = "sum" if weighted or rng.random() < 0.5 else "mean"
        tables.append((f"t{i}", rows, dim, features, pooling))
        placements.append(_placement(rng, world, rows, dim))
    return Case(
        seed=seed,
        world=world,
        tables=tuple(tables),
        placements=tuple(placements),
        weighted=weighted,
        optimizer=rng.choice(OPTIMIZERS),
    )


def _ebc(case: Case) -> EmbeddingBagCollection:
    torch.manual_seed(case.seed)
    configs = [
        EmbeddingBagConfig(name=name, num_embeddings=rows, embedding_dim=dim, feature_names=list(features),
                           pooling=PoolingType.SUM if pooling == "sum" else PoolingType.MEAN)
        for name, rows, dim, features, pooling in case.tables
    ]  # fmt: skip
    return EmbeddingBagCollection(tables=configs, is_weighted=case.weighted)


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> float:
    """assert_close at 1e-5, absolute or relative: a one-row table read by several features
    sums many squared gradients into its Adagrad state, where float32 rounding exceeds 1e-5."""
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5, msg=lambda m: f"{what}: {m}")
    return float((actual - expected).detach().abs().max()) if expected.numel() else 0.0


def _train(case: Case) -> float:
    world, rank = dist.get_world_size(), dist.get_rank()
    ebc = _ebc(case)
    fused = not case.optimizer.startswith("dense_")
    ref = FusedReference(copy.deepcopy(ebc), case.optimizer.replace("dense_", "exact_"))
    plan = ShardingPlan(world_size=world, modules={"": dict(zip((t[0] for t in case.tables), case.placements))})
    if fused:  # before shard (Note [order of sharding calls])
        opt = modular.fuse_optimizer(ebc, case.optimizer, lr=LR, eps=EPS)
    model = modular.shard(ebc, plan)
    if not fused:  # a rank holding no table has no parameter, which torch's optimizers refuse
        params = modular.local_parameters(model) or [torch.nn.Parameter(torch.zeros(0))]
        if case.optimizer == "dense_sgd":
            opt = torch.optim.SGD(params, lr=LR)
        else:
            opt = torch.optim.Adagrad(params, lr=LR, eps=EPS)
    worst = 0.0
    for step in range(STEPS):
        size = 1 + (case.seed + step) % 4  # every rank the same (modular needs it), steps differ
        batches = [make_batch(ebc, seed=1000 * step + r + 7 * case.seed, batch_size=size) for r in range(world)]
        out = model(batches[rank]).values()
        expected = ref.ebc(global_batch(batches)).values()
        target = torch.randn(expected.shape, generator=torch.Generator().manual_seed(step))
        mine = slice(rank * size, (rank + 1) * size)
        worst = max(worst, close(out, expected[mine], f"step {step} output"))
        (out * target[mine]).sum().backward()
        ((expected * target).sum() / world).backward()
        opt.step()
        opt.zero_grad()
        ref.step()
    full = dict(ref.ebc.named_parameters())
    state = opt.state_dict()["state"] if fused else {}
    for name, p in model.named_parameters():
        for tensor, rows, cols in local_blocks(p):
            worst = max(worst, close(tensor, full[name].detach()[rows, cols], f"{name} weight"))
        want = ref.state(name) if fused else None
        if want is None:
            continue
        worst = max(worst, state_error(next(iter(state[name].values())), want, f"{name} state", close))
    return worst


def _train_cases(cases: list[Case]) -> list[float]:
    out = []
    for case in cases:
        try:
            out.append(_train(case))
        except Exception as e:
            raise AssertionError(f"{case}\n{type(e).__name__}: {e}") from e
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_random_plans_train_like_the_unsharded_ebc(world: int) -> None:
    cases = [make_case(seed, world) for seed in range(CASES)]
    for worst in run_on_ranks(world, _train_cases, cases, timeout=60 + 20 * CASES):
        assert all(w < float("inf") for w in worst) and len(worst) == CASES, worst
