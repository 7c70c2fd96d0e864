"""A batch size per rank (Note [a batch size per rank] in modular/routing/variable_batch.py).

Each rank passes its own batch size each step (one rank's batch is sometimes empty, some steps
every rank's is the same, and the EBC's batch is sometimes a VBE one), and a sharded EBC or EC
computes what torchrec's unsharded module does on each rank's batch: outputs, every gradient and
the weights after the steps, unfused SGD and fused, for every sharding type, with and without
prefetch. The reference loss is the mean over ranks of each rank's mean loss (DDP's averaging;
Note [grad scaling across ranks]); an empty batch's loss is 0. Before this, every step with
differing sizes raised "needs the same batch size on every rank".
"""

from __future__ import annotations

import copy
from typing import Optional

import pytest
import torch
import torch.distributed as dist
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import modular
from planners.types import ShardingPlan
from tests.dist import run_on_ranks
from tests.modular.compare import close, local_blocks
from tests.modular.ebc_cases import CASES, features_of, id_bounds, make_ebc, plan_for
from tests.modular.fused_reference import FUSED_EPS, FUSED_LR, FusedReference
from tests.modular.sequence_cases import SEQ_BOUNDS, seq_a_tables, seq_placements_for

LR = 0.5
# Each step's batch size on each rank: uneven, empty on some rank, and one step even.
SIZES = {
    2: [[4, 3], [0, 2], [3, 3], [1, 0], [2, 5]],
    3: [[4, 3, 1], [0, 2, 2], [3, 3, 3], [1, 0, 4], [2, 5, 0]],
}
VBE_STEP = 3  # rank 0's EBC batch is a VBE one at this step (request-level features deduplicated)
DEDUPED = ("f_c", "g_c")


def make_batch(
    keys: list[str], bounds: dict[str, int], *, seed: int, size: int, weighted: bool, vbe: bool = False
) -> KeyedJaggedTensor:
    """`size` samples of 0-3 ids a bag; with `vbe`, the features in DEDUPED hold one bag per
    request of two samples (torchrec's VBE KJT, with inverse indices)."""
    g = torch.Generator().manual_seed(seed)
    requests = (size + 1) // 2
    lengths, values, strides, inverse = [], [], [], []
    for f in keys:
        deduped = vbe and f in DEDUPED
        bags = requests if deduped else size
        n = torch.randint(0, 4, (bags,), generator=g)
        lengths.append(n)
        values.append(torch.randint(0, bounds[f], (int(n.sum()),), generator=g))
        strides.append(bags)
        inverse.append(torch.arange(size) // 2 if deduped else torch.arange(size))
    weights = torch.rand(int(torch.cat(lengths).sum()), generator=g) + 0.5 if weighted else None
    if not vbe:
        return KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths), weights=weights)
    return KeyedJaggedTensor(
        keys=keys, values=torch.cat(values), lengths=torch.cat(lengths), weights=weights,
        stride_per_key_per_rank=[[s] for s in strides], inverse_indices=(keys, torch.stack(inverse)),
    )  # fmt: skip


def _check_weights(model, ref, label: str) -> int:
    ref_params, compared = dict(ref.named_parameters()), 0
    for name, p in model.named_parameters():
        for t, rows, cols in local_blocks(p):
            close(t.detach(), ref_params[name].detach()[rows, cols], f"{label}: {name} after the steps")
            compared += 1
    return compared


def _check_grads(model, ref, label: str) -> int:
    ref_params, compared = dict(ref.named_parameters()), 0
    for name, p in model.named_parameters():
        for t, rows, cols in local_blocks(p):
            close(t.grad, ref_params[name].grad[rows, cols], f"{label}: grad of {name}")
            compared += 1
    return compared


def _train(kind: str, case: str, weighted: bool, fused: Optional[str], prefetch: bool) -> int:
    """Trains a sharded EBC (`kind` "ebc") or EC ("ec") beside its unsharded copy; returns how
    many tensors it compared."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if kind == "ebc":
        ref = make_ebc(weighted)
        keys, bounds = features_of(ref), id_bounds(ref)
        plan = plan_for(case, ref, world)
    else:
        torch.manual_seed(0)
        ref = EmbeddingCollection(tables=seq_a_tables())
        keys, bounds = ["item", "hist", "cat"], SEQ_BOUNDS
        plan = ShardingPlan(world_size=world, modules={"": seq_placements_for(case, seq_a_tables(), world)})
    model = copy.deepcopy(ref)
    opt = modular.fuse_optimizer(model, fused, lr=FUSED_LR, eps=FUSED_EPS) if fused else None
    modular.shard(model, plan)
    opt = opt or torch.optim.SGD(modular.local_parameters(model), lr=LR)
    ref_opt = FusedReference(ref, fused) if fused else torch.optim.SGD(ref.parameters(), lr=LR)
    label = f"{kind} {case} weighted={weighted} fused={fused} prefetch={prefetch}, rank {rank}/{world}"
    sizes = SIZES[world]
    steps = [
        [
            make_batch(
                keys, bounds, seed=100 * step + r, size=sizes[step][r], weighted=weighted,
                vbe=kind == "ebc" and step == VBE_STEP and r == 0,
            )  # fmt: skip
            for r in range(world)
        ]
        for step in range(len(sizes))
    ]
    compared = 0
    for step, batches in enumerate(steps):
        what = f"{label} step {step} (sizes {sizes[step]})"
        if prefetch and step + 1 < len(steps):
            modular.prefetch(model, steps[step + 1][rank])
        got = _outputs(model(batches[rank]))
        ref_loss = 0.0
        for r, b in enumerate(batches):  # torchrec's module takes no empty batch: 0 outputs
            want = _outputs(ref(b)) if b.stride() else {k: torch.zeros(0, *v.shape[1:]) for k, v in got.items()}
            g = torch.Generator().manual_seed(10 * step + r)
            targets = {k: torch.randn(v.shape, generator=g) for k, v in want.items()}
            mean = 1.0 / max(b.stride(), 1)  # each rank's mean loss
            ref_loss = ref_loss + sum((v * targets[k]).sum() for k, v in want.items()) * mean / world
            if r == rank:
                assert list(got) == list(want), f"{what}: keys {list(got)}, expected {list(want)}"
                for k, v in want.items():
                    close(got[k], v, f"{what} [{k!r}]")
                loss = sum((v * targets[k]).sum() for k, v in got.items()) * mean
        compared += 1
        loss.backward()
        ref_loss.backward()
        if fused is None:
            compared += _check_grads(model, ref, what)
            opt.step()
            opt.zero_grad()
            ref_opt.step()
            ref_opt.zero_grad()
        else:
            ref_opt.step()
    if prefetch:
        assert not model._prefetcher._pending, f"{label}: every prefetched batch was used"
    return compared + _check_weights(model, ref, label)


def _outputs(out) -> dict[str, torch.Tensor]:
    """An EBC's pooled values, or an EC's rows and lengths (as floats), by key."""
    if isinstance(out, dict):
        return {
            **{k: jt.values() for k, jt in out.items()},
            **{f"{k} lengths": jt.lengths().float().view(-1, 1) for k, jt in out.items()},
        }
    return {"values": out.values()}


def _every_case(kind: str) -> int:
    total = 0
    for i, case in enumerate(CASES):
        weighted = kind == "ebc" and bool(i % 2)
        total += _train(kind, case, weighted, None, prefetch=i % 2 == 0)
        fused = ("exact_sgd", "exact_adagrad", "exact_rowwise_adagrad")[i % 3]
        total += _train(kind, case, kind == "ebc" and not weighted, fused, prefetch=i % 2 == 1)
    return total


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", ["ebc", "ec"])
def test_each_rank_its_own_batch_size_trains_like_the_unsharded_module(kind: str, world: int) -> None:
    compared = run_on_ranks(world, _every_case, kind, timeout=360)
    assert min(compared) > 60, compared


class _Ranker(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sparse = make_ebc(False)
        self.tower = torch.nn.Linear(34, 1)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.tower(self.sparse(kjt).values()).square().sum()


def _compiled(compiled: bool, warm_up: int) -> list[float]:
    """Batch sizes 0-5 changing every step on every rank, each batch prefetched; after `warm_up`
    steps (sizes 0 and 1 are dynamo's specialisations, then any other) nothing recompiles."""
    from torch._dynamo.utils import counters

    rank, world = dist.get_rank(), dist.get_world_size()
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = _Ranker()
    tables = modular.fuse_optimizer(model, "exact_rowwise_adagrad", lr=0.1)
    modular.shard(model, plan_for("mixed", model.sparse, world, module="sparse"))
    dense = torch.optim.SGD(modular.local_parameters(model), lr=0.1)
    call = torch.compile(model) if compiled else model
    keys, bounds = features_of(model.sparse), id_bounds(model.sparse)
    sizes = [[2, 3][rank], [0, 1][rank], [1, 0][rank], *[(3 * step + 2 * rank) % 6 for step in range(12)]]
    batches = [make_batch(keys, bounds, seed=31 * s + rank, size=n, weighted=False) for s, n in enumerate(sizes)]
    losses = []
    for step, batch in enumerate(batches):
        if step + 1 < len(batches):
            modular.prefetch(model, batches[step + 1])
        with torch._dynamo.config.patch(error_on_recompile=step >= warm_up):
            loss = call(batch) / max(batch.stride(), 1)
            loss.backward()
        tables.step()
        dense.step()
        dense.zero_grad()
        losses.append(float(loss))
    return losses


@pytest.mark.timeout(300)
def test_batch_sizes_per_rank_compile_without_recompiles() -> None:
    eager = run_on_ranks(2, _compiled, False, 3, timeout=240)
    compiled = run_on_ranks(2, _compiled, True, 3, timeout=240)
    for rank in range(2):
        assert compiled[rank] == pytest.approx(eager[rank], abs=1e-5, rel=0), rank
