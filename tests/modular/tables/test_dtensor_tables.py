"""`modular.shard(..., tensor_type="dtensor")` (Note [table tensor types]): DTensor tables train
like the unsharded EBC, hold what the ShardedTensor form holds under the same FQNs, warn about
nothing, and checkpoints move between the two forms, plans and world sizes."""

from __future__ import annotations

import copy
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection

import modular
from modular.tables.forms import local_pieces
from planners.types import ShardingPlan
from tests.dist import expect_errors_on_all_ranks, run_on_ranks
from tests.modular.compare import close
from tests.modular.ebc_cases import CASES, global_batch, make_batch, plan_for

LR, EPS = 0.3, 1e-3


def _tables() -> list[EmbeddingBagConfig]:
    """Widths 8, 12 and 16 take fbgemm's fused kernel, 5 the torch emulation."""
    return [
        EmbeddingBagConfig(name="t_sum", num_embeddings=13, embedding_dim=8, feature_names=["f_a", "f_b"]),
        EmbeddingBagConfig(name="t_mean", num_embeddings=11, embedding_dim=12, feature_names=["f_c"], pooling=PoolingType.MEAN),
        EmbeddingBagConfig(name="t_small", num_embeddings=7, embedding_dim=5, feature_names=["f_d"], pooling=PoolingType.MEAN),
        EmbeddingBagConfig(name="t_big", num_embeddings=29, embedding_dim=16, feature_names=["f_e"]),
    ]


def _ebc() -> EmbeddingBagCollection:
    torch.manual_seed(0)
    return EmbeddingBagCollection(tables=_tables())


def _blocks(p: torch.Tensor) -> dict[tuple, torch.Tensor]:
    """This rank's pieces of a table by (offsets, sizes): shards, or the whole data-parallel copy."""
    if isinstance(p, (ShardedTensor, DTensor)):
        return {(o, s): t for o, s, t in local_pieces(p)}
    return {((0, 0), tuple(p.shape)): p}


def _train(case: str, fused: bool) -> float:
    """3 steps of the DTensor form (prefetching its batches) next to the ShardedTensor form and
    the unsharded reference: same outputs, same gradients (dense) or weights and state (fused),
    same FQNs and pieces."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ref = _ebc()
    ref_opt = (torch.optim.Adagrad if fused else torch.optim.SGD)(ref.parameters(), lr=LR, **({"eps": EPS} if fused else {}))
    models, opts = {}, {}
    for kind in ("sharded_tensor", "dtensor"):
        ebc = _ebc()
        plan = plan_for(case, ebc, world)
        if fused:
            opts[kind] = modular.fuse_optimizer(ebc, "exact_adagrad", lr=LR, eps=EPS)
            models[kind] = modular.shard(ebc, plan, tensor_type=kind)
        else:
            models[kind] = modular.shard(ebc, plan, tensor_type=kind)
            opts[kind] = torch.optim.SGD(modular.local_parameters(models[kind]), lr=LR)
    st, dt = models["sharded_tensor"], models["dtensor"]
    assert [n for n, _ in dt.named_parameters()] == [n for n, _ in ref.named_parameters()]
    for (name, a), (_, b) in zip(st.named_parameters(), dt.named_parameters()):
        if isinstance(a, ShardedTensor):
            assert isinstance(b, DTensor) and tuple(b.shape) == tuple(a.size()), (name, type(b))
        assert _blocks(a).keys() == _blocks(b).keys(), name
    worst = 0.0
    for step in range(3):
        batches = [make_batch(ref, seed=100 * step + r) for r in range(world)]
        expected = ref(global_batch(batches)).values()
        target = torch.randn(expected.shape, generator=torch.Generator().manual_seed(step))
        mine = slice(rank * batches[rank].stride(), (rank + 1) * batches[rank].stride())
        ((expected * target).sum() / world).backward()
        for kind, model in models.items():
            if kind == "dtensor":  # its input dist runs in the background (Note [prefetched input dist])
                modular.prefetch(model, batches[rank])
                assert id(batches[rank]) in model._prefetcher._pending, "the batch was not prefetched"
            out = model(batches[rank]).values()
            worst = max(worst, close(out, expected[mine], f"{case} {kind} step {step} output"))
            (out * target[mine]).sum().backward()
        if not fused:
            for (name, w), p in zip(dt.named_parameters(), ref.parameters()):
                for (o, s), t in _blocks(w).items():
                    region = tuple(slice(a, a + n) for a, n in zip(o, s))
                    worst = max(worst, close(t.grad, p.grad[region], f"{case} {name} grad"))
        for o in (*opts.values(), ref_opt):
            o.step()
            o.zero_grad()
    for (name, a), (_, b), p in zip(st.named_parameters(), dt.named_parameters(), ref.parameters()):
        pa, pb = _blocks(a), _blocks(b)
        for key, t in pb.items():
            assert torch.equal(t, pa[key]), f"{case} {name}: the two forms differ"
            region = tuple(slice(o, o + n) for o, n in zip(*key))
            worst = max(worst, close(t, p.detach()[region], f"{case} {name} weight"))
    if fused:
        sa, sb = opts["sharded_tensor"].state_dict()["state"], opts["dtensor"].state_dict()["state"]
        assert sorted(sa) == sorted(sb)
        for fqn in sa:
            a, b = sa[fqn]["sum"], sb[fqn]["sum"]
            if isinstance(a, ShardedTensor):
                assert isinstance(b, DTensor) and tuple(b.shape) == tuple(a.size()), fqn
            for key, t in _blocks(b).items():
                assert torch.equal(t, _blocks(a)[key]), f"{case} {fqn} state differs"
    return worst


def _every_case() -> dict[str, float]:
    out = {}
    for case in CASES:
        for fused in (False, True):
            out[f"{case}/{'fused' if fused else 'dense'}"] = _train(case, fused)
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_dtensor_tables_match_sharded_tensor_tables_and_the_reference(world: int) -> None:
    results = run_on_ranks(world, _every_case, timeout=280)
    assert len(results[0]) == 2 * len(CASES)


def _bad_tensor_type() -> None:
    modular.shard(_ebc(), plan_for("row_wise", _ebc(), dist.get_world_size()), tensor_type="dtensors")


def test_an_unknown_tensor_type_is_refused_naming_the_choices() -> None:
    errors = expect_errors_on_all_ranks(2, _bad_tensor_type, timeout=60)
    for e in errors:
        assert "tensor_type='dtensors' is not one of ['sharded_tensor', 'dtensor']" in e, e
