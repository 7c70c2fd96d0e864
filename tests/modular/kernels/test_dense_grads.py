"""Dense kernels keep one gradient buffer across steps (Note [dense gradient buffer]) and must
still behave like ordinary parameters: gradients accumulate over backward calls, zero_grad() with
or without set_to_none clears them, and data-parallel tables average each backward over ranks,
whether they replay the global batch or all-reduce the buffer (Note [dense data-parallel copies]).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor

import modular
from tests.dist import run_on_ranks
from tests.modular.compare import close, local_blocks
from tests.modular.ebc_cases import BATCH, global_batch, make_batch, make_ebc, plan_for, rank_batches


def _backward(ebc, ref, step: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = rank_batches(ref, world, step)
    out = ebc(batches[rank]).values()
    expected = ref(global_batch(batches)).values()
    target = torch.randn(expected.shape, generator=torch.Generator().manual_seed(step))
    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    (out * target[mine]).sum().backward()
    ((expected * target).sum() / world).backward()


def _compare_grads(ebc, ref, what: str) -> int:
    ref_params = dict(ref.named_parameters())
    compared = 0
    for name, param in ebc.named_parameters():
        for tensor, rows, cols in local_blocks(param):
            close(tensor.grad, ref_params[name].grad[rows, cols], f"{what}: grad of {name}")
            compared += 1
        if not isinstance(param, ShardedTensor):  # a data-parallel copy: the same bits on every rank
            copies = [torch.empty_like(param.grad) for _ in range(dist.get_world_size())]
            dist.all_gather(copies, param.grad.contiguous())
            assert all(torch.equal(c, copies[0]) for c in copies), f"{what}: copies of {name} differ"
    return compared


def _accumulate_and_clear(case: str, replay_ratio: float | None = None, weighted: bool = False) -> int:
    ref = make_ebc(weighted)
    ebc = copy.deepcopy(ref)
    modular.shard(ebc, plan_for(case, ebc, dist.get_world_size()))
    if replay_ratio is not None:  # 0: always all-reduce, inf: always replay
        assert ebc._local_kernels, case
        for k in ebc._local_kernels:
            k.replay_ratio = replay_ratio
    local = modular.local_parameters(ebc)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(local, lr=0.1) if local else None
    compared = 0
    _backward(ebc, ref, 0)
    _backward(ebc, ref, 1)  # no zero_grad in between: the two gradients add up
    compared += _compare_grads(ebc, ref, f"{case}: two backward calls")
    for set_to_none in (False, True, False):
        if opt is not None:
            opt.zero_grad(set_to_none=set_to_none)
        ref_opt.zero_grad(set_to_none=set_to_none)
        for p in local:
            if set_to_none:
                assert p.grad is None, f"{case}: zero_grad() left a gradient"
            else:
                assert p.grad is not None and not p.grad.any(), f"{case}: zero_grad(set_to_none=False) left a nonzero gradient"
        _backward(ebc, ref, 2 + int(set_to_none))
        compared += _compare_grads(ebc, ref, f"{case}: after zero_grad(set_to_none={set_to_none})")
    return compared


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["mixed", "data_parallel", "row_wise"])
def test_gradients_accumulate_and_clear_like_plain_parameters(case: str) -> None:
    compared = run_on_ranks(2, _accumulate_and_clear, case, timeout=100)
    assert all(n > 0 for n in compared), compared


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("replay_ratio", [0.0, float("inf")], ids=["all_reduce", "replay"])
def test_data_parallel_copies_average_by_either_route(replay_ratio: float, world: int) -> None:
    for weighted in (False, True):  # SUM and MEAN bags; per-sample weights
        compared = run_on_ranks(world, _accumulate_and_clear, "data_parallel", replay_ratio, weighted, timeout=100)
        assert all(n > 0 for n in compared), compared
    compared = run_on_ranks(world, _accumulate_and_clear, "mixed", replay_ratio, True, timeout=100)
    assert all(n > 0 for n in compared), compared


def test_replay_pays_when_the_global_batch_touches_less_than_the_table() -> None:
    from modular.kernels.dense import replay_pays

    # 8 tables x 100k rows x 64 dims, 2 ranks x 1,024 samples x 8 features x 20 ids: replay
    assert replay_pays(2 * 1024 * 8 * 20, 64, 8 * 100_000 * 64)
    # 64 ranks of the same batch touch more ids than the tables have rows: all-reduce
    assert not replay_pays(64 * 1024 * 8 * 20, 64, 8 * 100_000 * 64)


def test_setting_one_shard_gradient_keeps_its_kernel_neighbours_consistent() -> None:
    # One process, no process group; the views of one kernel (the SUM tables share one).
    ebc = modular.ShardedEmbeddingBagCollection.unsharded(make_ebc(False), module="")
    everything = modular.local_parameters(ebc)
    views = [v for v in everything if v._flat is everything[0]._flat]
    others = [v for v in everything if v._flat is not everything[0]._flat]
    assert len(views) > 1 and others and all(v.grad is None for v in everything)
    views[0].grad = torch.ones_like(views[0])
    assert torch.equal(views[0].grad, torch.ones_like(views[0]))
    assert all(v.grad is not None and not v.grad.any() for v in views[1:])
    views[1].grad = None  # clears the kernel's whole buffer, as zero_grad() does for each view
    assert all(v.grad is None for v in views)
    views[0].grad = torch.full_like(views[0], 2.0)  # the kept buffer comes back zeroed
    assert torch.equal(views[0].grad, torch.full_like(views[0], 2.0))
    assert all(not v.grad.any() for v in views[1:])
    assert all(v.grad is None for v in others)  # another kernel's buffer is untouched


def test_foreach_adam_updates_shard_views_like_the_per_tensor_loop(monkeypatch) -> None:
    # Note [ShardView and foreach]: one process, no process group. Two copies of one model, the
    # same two steps, Adam with foreach on one and the per-tensor loop on the other.
    import torch.optim.optimizer as optimizer_module

    def trained(foreach: bool) -> list[torch.Tensor]:
        ebc = modular.ShardedEmbeddingBagCollection.unsharded(make_ebc(False), module="")
        params = modular.local_parameters(ebc)
        opt = torch.optim.Adam(params, lr=0.1, foreach=foreach)
        for step in range(2):
            opt.zero_grad()
            pooled = ebc(make_batch(ebc, seed=step)).values()
            (pooled * torch.linspace(-1, 1, pooled.shape[1])).square().sum().backward()
            opt.step()
        return [p.detach().clone() for p in params]

    before = [p.detach().clone() for p in modular.local_parameters(
        modular.ShardedEmbeddingBagCollection.unsharded(make_ebc(False), module="")
    )]
    looped, fast = trained(False), trained(True)
    assert len(looped) == len(fast) == len(before) > 1
    assert all(not torch.equal(a, b) for a, b in zip(looped, before))  # every table trained
    for a, b in zip(fast, looped):
        assert torch.allclose(a, b, rtol=0, atol=1e-6), float((a - b).abs().max())
    # Where a device has foreach kernels (CUDA), shard views no longer turn them off.
    monkeypatch.setattr(optimizer_module, "_get_foreach_kernels_supported_devices", lambda: ["cpu"])
    views = modular.local_parameters(
        modular.ShardedEmbeddingBagCollection.unsharded(make_ebc(False), module="")
    )
    mixed = views + [torch.nn.Parameter(torch.ones(2))]
    assert optimizer_module._default_to_fused_or_foreach(mixed, False) == (False, True)
