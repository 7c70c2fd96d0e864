"""`torch.compile` over a model holding a sharded EmbeddingCollection and a sharded EBC: the same
compile boundary for both kinds (Note [compiling a sharded model] in modular/compose/compile.py).

The model (torchrec's modules, the sequential example's tables) scores every looked-up row and
every pooled user vector with one small tower. It is trained eagerly and compiled, 2 ranks, on
batches whose sequence lengths (so the EC's row counts) change every step; after one warm-up step
nothing compiles again for 20 steps (`error_on_recompile`), the only graph breaks are the two
deliberate ones (one per sharded collection call), and the compiled run equals the eager one.
`apply_compile(fullgraph=True)` and `apply_compile` on the EC itself are refused naming it, and
compiled autograd is refused by the EC as by the EBC.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._dynamo.utils import counters
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import modular
from modular.tables.forms import is_sharded, local_pieces
from examples.sequential.model import DIM, SEQUENCE_FEATURES, make_batch, sequence_tables, user_tables
from planners.types import ShardingPlan, ShardingType, TablePlacement
from tests.dist import run_on_ranks

LR = 0.1
WARM_UP, COUNTED = 1, 20
DISABLED = "Skip inlining `torch.compiler.disable()`d function"


class Scorer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seq = EmbeddingCollection(tables=sequence_tables())
        self.user = EmbeddingBagCollection(tables=user_tables())
        self.tower = nn.Sequential(nn.Linear(DIM, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, sequences: KeyedJaggedTensor, users: KeyedJaggedTensor) -> torch.Tensor:
        rows = self.seq(sequences)
        ids = torch.cat([rows[k].values() for k in SEQUENCE_FEATURES])
        user = self.user(users).values()
        return self.tower(ids).square().mean() + self.tower(user).square().mean()


def _plan(case: str, world: int) -> ShardingPlan:
    if case == "mixed":
        seq = {
            "item": TablePlacement(ShardingType.ROW_WISE),
            "category": TablePlacement(ShardingType.COLUMN_WISE, ranks=(world - 1, *range(world))),
        }
    else:
        seq = {t.name: TablePlacement(ShardingType(case)) for t in sequence_tables()}
    user_placement = (
        TablePlacement(ShardingType.DATA_PARALLEL) if case == "mixed"
        else TablePlacement(ShardingType.TABLE_WISE, ranks=(world - 1,))
    )  # fmt: skip
    user = {"user": user_placement}
    return ShardingPlan(world_size=world, modules={"seq": seq, "user": user})


def _train(case: str, fused: Optional[str], compiled: bool) -> tuple[list[float], dict, int, dict]:
    world, rank = dist.get_world_size(), dist.get_rank()
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Scorer()
    tables_opt = modular.fuse_optimizer(model, fused, lr=LR) if fused else None
    modular.shard(model, _plan(case, world))
    call = torch.compile(model) if compiled else model
    opts = {"dense": torch.optim.SGD(modular.local_parameters(model), lr=LR)}
    if tables_opt is not None:
        opts["tables"] = tables_opt
    opt = modular.CombinedOptimizer(opts)
    # 16 samples: 40-120 rows a step. Inductor itself guards on a dynamic size under 25 (its
    # small-mm decomposition) and would recompile there, whatever produced the rows.
    batches = [make_batch(step, rank, batch_size=16, seed=7) for step in range(WARM_UP + COUNTED)]
    losses = []
    for step, batch in enumerate(batches):
        if step + 1 < len(batches):
            modular.prefetch(model, batches[step + 1].sequences, modules=["seq"])
        with torch._dynamo.config.patch(error_on_recompile=step >= WARM_UP):
            loss = call(batch.sequences, batch.users)
            opt.zero_grad()
            loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
    weights = {
        f"{n}{offsets}": t.detach().clone()
        for n, p in model.named_parameters()
        for offsets, _, t in (local_pieces(p) if is_sharded(p) else [((), (), p)])
    }  # fmt: skip
    breaks = dict(Counter({k.split("\n")[0]: v for k, v in counters["graph_break"].items()}))
    return losses, weights, counters["stats"]["unique_graphs"], breaks


def _compiled_vs_eager(case: str, fused: Optional[str]) -> None:
    eager_losses, eager_weights, graphs, breaks = _train(case, fused, compiled=False)
    assert graphs == 0 and not breaks, "the eager run compiled"
    losses, weights, graphs, breaks = _train(case, fused, compiled=True)
    assert losses == pytest.approx(eager_losses, abs=1e-5, rel=0), (losses, eager_losses)
    assert eager_losses[0] != pytest.approx(eager_losses[-1], abs=1e-4), "did not train"
    for name, w in eager_weights.items():
        torch.testing.assert_close(weights[name], w, atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")
    # One deliberate break per sharded collection call (the EC's and the EBC's), traced once.
    assert breaks == {DISABLED: 2}, breaks
    assert 0 < graphs <= 4, graphs


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case, fused", [("row_wise", None), ("mixed", "exact_rowwise_adagrad")])
def test_compiled_sequences_train_as_eager_without_recompiles(case: str, fused: Optional[str]) -> None:
    run_on_ranks(2, _compiled_vs_eager, case, fused, timeout=360)


class _Wrapped(nn.Module):
    def __init__(self, inner: Scorer) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, sequences, users):
        return self.inner(sequences, users)


def _refusals() -> dict[str, str]:
    torch.manual_seed(0)
    model = _Wrapped(modular.shard(Scorer(), _plan("row_wise", 1)))
    got = {}
    for what, call in {
        "fullgraph": lambda: modular.apply_compile(model, modules={Scorer}, fullgraph=True),
        "ec": lambda: modular.apply_compile(model.inner.seq, modules={nn.Sequential}),
    }.items():
        with pytest.raises(modular.ShardingError) as e:
            call()
        got[what] = str(e.value)
    batch = make_batch(0, 0)
    with torch._dynamo.config.patch(compiled_autograd=True), pytest.raises(modular.ShardingError) as e:
        model.inner.seq(batch.sequences)
    got["compiled_autograd"] = str(e.value)
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported) as e:
        torch.compile(model.inner.seq, fullgraph=True)(batch.sequences)
    got["dynamo"] = str(e.value)
    return got


def test_compile_refusals_name_the_sharded_ec() -> None:
    got = run_on_ranks(1, _refusals, timeout=240)[0]
    # `Scorer` holds both: the first sharded collection in it is named.
    assert "module 'inner' contains the sharded EmbeddingCollection 'seq'" in got["fullgraph"], got
    assert "drop fullgraph=True" in got["fullgraph"]
    assert "given a ShardedEmbeddingCollection" in got["ec"], got
    assert "module 'seq': compiled autograd" in got["compiled_autograd"], got
    assert "runs its forward (input dist -> lookup -> output dist" in got["dynamo"], got
