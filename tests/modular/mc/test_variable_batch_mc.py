"""Managed-collision tables fed variable-batch (VBE) KJTs (docs/managed_collision.md, "Variable
batch per feature").

Each rank passes torchrec's VBE KeyedJaggedTensor (a request-level feature with one bag per
request, `stride_per_key_per_rank` and `inverse_indices`; ranks with different strides; in a world
of 3 one rank's batch a plain one at odd steps; once a rank with no samples). The reference is
torchrec's unsharded MC-EBC fed the global VBE batch: every rank's bags concatenated feature by
feature in rank order, each feature's strides one per rank and the inverse indices shifted to
point into them, which is what torchrec's unsharded module takes as it is. Step by step: the
remapped ids, what `evict()` reports, the collision state, the outputs, the gradients and the
weights, at worlds 2 and 3 under row-wise, table-wise, column-wise, table-row-wise and
data-parallel plans, eviction intervals 1 and 3, fused and not; with per-id weights; and a
collision module that stays replicated (a threshold filter). A bad id in a VBE batch raises
InputError on every rank naming the feature, nothing changed; an MC-EC refuses a VBE batch on
every rank before its state changes, naming the module.
"""

from __future__ import annotations

import copy
from typing import Optional

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import modular
from modular.errors import InputError
from modular.tables.forms import is_sharded, local_pieces
from planners.types import ShardingPlan, ShardingType, TablePlacement
from tests.dist import run_on_ranks
from tests.modular.compare import full_value
from tests.modular.ebc_cases import placements_for
from tests.modular.test_managed_collisions import HASH, ZCH, Model, _ec_model, _tables

STEPS, LR = 8, 0.5
KEYS = ["f_raw", "f_raw2"]


def vbe_batch(step: int, rank: int, plain: bool = False, weighted: bool = False) -> KeyedJaggedTensor:
    """2-5 samples from 1-3 requests: 'f_raw' holds one bag per request (its samples share it),
    'f_raw2' one per sample; Zipf ids with churn, 0-3 per bag. `plain`: an ordinary KJT;
    `weighted`: with a weight per id."""
    rng = np.random.default_rng([step, rank, 7])
    size = int(rng.integers(2, 6))
    requests = size if plain else int(rng.integers(1, min(size, 3) + 1))
    strides = [requests, size]
    lengths = rng.integers(0, 4, sum(strides))
    ids = (rng.zipf(1.3, int(lengths.sum())) + 7 * step) % 5000 * 1_000_003 % HASH
    values, lengths = torch.tensor(ids, dtype=torch.int64), torch.tensor(lengths, dtype=torch.int64)
    weights = torch.tensor(rng.random(values.numel()), dtype=torch.float32) + 0.5 if weighted else None
    if plain:
        return KeyedJaggedTensor(keys=KEYS, values=values, lengths=lengths, weights=weights)
    inverse = torch.stack([torch.arange(size) * requests // size, torch.arange(size)])
    return KeyedJaggedTensor(keys=KEYS, values=values, lengths=lengths, weights=weights,
                             stride_per_key_per_rank=[[s] for s in strides], inverse_indices=(KEYS, inverse))  # fmt: skip


def rank_batches(step: int, world: int, weighted: bool = False) -> list[KeyedJaggedTensor]:
    """Every rank's batch of one step; in a world of 3 the last rank's is a plain one at odd
    steps, and at step 5 rank 0 has no samples (a VBE batch of 0 bags)."""
    out = [vbe_batch(step, r, plain=world == 3 and r == 2 and step % 2 == 1, weighted=weighted) for r in range(world)]
    if step == 5:
        none = torch.zeros(0, dtype=torch.int64)
        out[0] = KeyedJaggedTensor(keys=KEYS, values=none, lengths=none, stride_per_key_per_rank=[[0], [0]],
                                   weights=torch.zeros(0) if weighted else None,
                                   inverse_indices=(KEYS, none.view(2, 0)))  # fmt: skip
    return out


def _strides(kjt: KeyedJaggedTensor) -> list[int]:
    return [s[0] for s in kjt.stride_per_key_per_rank()] if kjt.variable_stride_per_key() else [kjt.stride()] * len(KEYS)


def _inverse(kjt: KeyedJaggedTensor) -> torch.Tensor:
    if kjt.variable_stride_per_key():
        return kjt.inverse_indices()[1]
    return torch.arange(kjt.stride()).expand(len(KEYS), -1)


def global_vbe(batches: list[KeyedJaggedTensor]) -> KeyedJaggedTensor:
    """The ranks' batches as torchrec's unsharded module sees them together: each feature's bags
    in rank order, its strides one per rank, every rank's inverse indices shifted past the bags
    of the ranks before it."""
    strides = torch.tensor([_strides(b) for b in batches])  # (world, features)
    before = strides.cumsum(0) - strides
    lengths = [b.lengths().split(_strides(b)) for b in batches]
    values = [b.values().split(b.length_per_key()) for b in batches]
    weights = None
    if batches[0].weights_or_none() is not None:
        per_rank = [b.weights().split(b.length_per_key()) for b in batches]
        weights = torch.cat([per_rank[r][k] for k in range(len(KEYS)) for r in range(len(batches))])
    return KeyedJaggedTensor(
        keys=KEYS,
        weights=weights,
        values=torch.cat([values[r][k] for k in range(len(KEYS)) for r in range(len(batches))]),
        lengths=torch.cat([lengths[r][k] for k in range(len(KEYS)) for r in range(len(batches))]),
        stride_per_key_per_rank=strides.T.tolist(),
        inverse_indices=(KEYS, torch.cat([_inverse(b) + before[r].view(-1, 1) for r, b in enumerate(batches)], 1)),
    )  # fmt: skip


def _recording_evict(mcc: nn.Module, log: list) -> None:
    evict = mcc.evict
    mcc.evict = lambda: log.append(evict()["t_raw"]) or {"t_raw": log[-1]}


def _pieces(p: torch.Tensor) -> list[tuple[torch.Tensor, slice, slice]]:
    if is_sharded(p):
        return [(t, slice(o[0], o[0] + s[0]), slice(o[1], o[1] + s[1])) for o, s, t in local_pieces(p)]
    return [(p, slice(None), slice(None))]


def _mc_model(policy: str, interval: int, replicated: bool = False, weighted: bool = False) -> nn.Module:
    """The test's MC-EBC; `replicated`: its collision module keeps a threshold filter, which
    modular does not split (Note [managed collisions over the global batch]); `weighted`: its
    inner EBC pools with per-id weights."""
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.modules.mc_modules import LFU_EvictionPolicy, dynamic_threshold_filter

    model = Model(policy, interval)
    if replicated:
        model.mc._managed_collision_collection._managed_collision_modules["t_raw"]._eviction_policy = LFU_EvictionPolicy(
            threshold_filtering_func=lambda counts: dynamic_threshold_filter(counts, threshold_skew_multiplier=0.5))
    if weighted:
        torch.manual_seed(1)
        model.mc._embedding_module = EmbeddingBagCollection(tables=_tables(), is_weighted=True)
    return model


def _train(kind: str, policy: str, interval: int, fused: Optional[str], replicated: bool = False,
           weighted: bool = False) -> int:  # fmt: skip
    world, rank = dist.get_world_size(), dist.get_rank()
    ref = _mc_model(policy, interval, replicated, weighted)
    model = copy.deepcopy(ref)
    if fused:
        modular.fuse_optimizer(model, fused, lr=LR)
    modular.shard(model, ShardingPlan(world_size=world, modules={
        "mc._embedding_module": placements_for(kind, ref.mc._embedding_module, world)}))  # fmt: skip
    params = [] if fused else list(modular.local_parameters(model.mc))
    opt = torch.optim.SGD(params, lr=LR) if params else None  # a rank may hold no table
    ref_opt = torch.optim.SGD(ref.mc.parameters(), lr=LR)
    mcc, ref_mcc = model.mc._managed_collision_collection, ref.mc._managed_collision_collection
    evicted, ref_evicted = [], []
    _recording_evict(mcc, evicted)
    _recording_evict(ref_mcc, ref_evicted)
    weight = model.mc._embedding_module.embedding_bags["t_raw"].weight
    ref_weight = ref.mc._embedding_module.embedding_bags["t_raw"].weight
    label = f"{kind} {policy} interval {interval} fused={fused} replicated={replicated} weighted={weighted}, rank {rank}/{world}"
    evictions = 0
    for step in range(STEPS):
        batches = rank_batches(step, world, weighted)
        sizes = [_inverse(b).shape[1] for b in batches]
        first = sum(sizes[:rank])
        pooled, remapped = model.mc(batches[rank])
        ref_pooled, ref_remapped = ref.mc(global_vbe(batches))
        at = f"{label} step {step}"
        bags = torch.tensor([_strides(b) for b in batches])
        for k, key in enumerate(KEYS):  # this rank's remapped ids: its bags of the global batch's
            lengths = ref_remapped[key].lengths()
            before, mine = int(bags[:rank, k].sum()), int(bags[rank, k])
            start, count = int(lengths[:before].sum()), int(lengths[before: before + mine].sum())
            assert torch.equal(remapped[key].lengths(), lengths[before: before + mine]), f"{at}: {key} lengths"
            want = ref_remapped[key].values()[start: start + count]
            assert torch.equal(remapped[key].values(), want), f"{at}: {key} remapped ids"
        assert remapped.stride_per_key_per_rank() == batches[rank].stride_per_key_per_rank(), f"{at}: strides"
        got, want = evicted.pop(), ref_evicted.pop()
        assert (got is None) == (want is None) and (got is None or torch.equal(got, want)), f"{at}: evict() {got} != {want}"
        evictions += want is not None
        torch.testing.assert_close(pooled.values(), ref_pooled.values()[first: first + sizes[rank]],
                                   rtol=1e-4, atol=1e-5, msg=lambda m: f"{at}: outputs: {m}")  # fmt: skip
        probe = torch.randn(sum(sizes), 16, generator=torch.Generator().manual_seed(step))
        (pooled.values() * probe[first: first + sizes[rank]]).sum().backward()
        ((ref_pooled.values() * probe).sum() / world).backward()
        if opt is not None:
            for t, rows, cols in _pieces(weight):
                torch.testing.assert_close(t.grad, ref_weight.grad[rows, cols], rtol=1e-4, atol=1e-5,
                                           msg=lambda m: f"{at}: gradient: {m}")  # fmt: skip
            opt.step()
            opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(full_value(weight), ref_weight.detach(), rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{at}: trained table: {m}")  # fmt: skip
        mine, theirs = mcc.state_dict(), ref_mcc.state_dict()
        assert all(torch.equal(mine[k], theirs[k]) for k in theirs), f"{at}: collision state"
    split = getattr(mcc._managed_collision_modules["t_raw"], "_folds", None)
    assert (split is None) == replicated, f"{label}: collision module split: {split is not None}"
    assert replicated or split["folded"] >= 1, f"{label}: no interval's ids rode in the id check: {split}"
    return evictions


CASES = {
    2: [("row_wise", "distance_lfu", 1, None), ("table_wise", "lru", 3, "exact_sgd"),
        ("column_wise", "lfu", 1, None), ("data_parallel", "lru", 3, None),
        ("row_wise", "lfu", 1, None, True), ("table_wise", "distance_lfu", 1, "exact_sgd", False, True)],
    3: [("table_wise", "distance_lfu", 3, None), ("row_wise", "lfu", 1, "exact_sgd"),
        ("table_row_wise", "lru", 1, None), ("row_wise", "lfu", 1, None, True, True)],
}  # fmt: skip


def _cases(world: int) -> list[int]:
    return [_train(*c) for c in CASES[world]]


@pytest.mark.parametrize("world", [2, 3])
def test_vbe_batches_remap_and_train_as_the_unsharded_mc_module_on_the_global_vbe_batch(world: int) -> None:
    evicting = run_on_ranks(world, _cases, world, timeout=180)[0]
    intervals = [STEPS // c[2] for c in CASES[world]]
    assert all(2 * e > n for e, n in zip(evicting, intervals)), f"evictions in most intervals: {evicting} of {intervals}"


# -- refusals ---------------------------------------------------------------------------------------


def _bad_ids() -> str:
    world, rank = dist.get_world_size(), dist.get_rank()
    model = Model("lru", 1)
    modular.shard(model, ShardingPlan(world_size=world, modules={
        "mc._embedding_module": placements_for("row_wise", model.mc._embedding_module, world)}))  # fmt: skip
    model.mc(vbe_batch(0, rank))
    state = copy.deepcopy(model.mc._managed_collision_collection.state_dict())
    bad = vbe_batch(1, rank)
    if rank == 1:  # only rank 1's last bag of 'f_raw2' holds the bad id; every rank raises
        bad = KeyedJaggedTensor(keys=KEYS, values=torch.cat([bad.values(), torch.tensor([HASH + 5])]),
                                lengths=torch.cat([bad.lengths()[:-1], bad.lengths()[-1:] + 1]),
                                stride_per_key_per_rank=bad.stride_per_key_per_rank(),
                                inverse_indices=bad.inverse_indices())  # fmt: skip
    with pytest.raises(InputError) as e:
        model.mc(bad)
    after = model.mc._managed_collision_collection.state_dict()
    assert all(torch.equal(state[k], after[k]) for k in state), "no state changed"
    return str(e.value)


def test_a_bad_id_in_a_vbe_batch_is_refused_on_every_rank_before_any_state_changes() -> None:
    messages = run_on_ranks(2, _bad_ids, timeout=60)
    assert messages[0] == messages[1]
    assert "'f_raw2'" in messages[0] and "rank 1" in messages[0] and "input_hash_size" in messages[0]


def _refused(model: nn.Module, batch: KeyedJaggedTensor) -> str:
    """The InputError of `model.mc(batch)`, after checking that no collision state changed."""
    state = copy.deepcopy(model.mc._managed_collision_collection.state_dict())
    with pytest.raises(InputError) as e:
        model.mc(batch)
    after = model.mc._managed_collision_collection.state_dict()
    assert all(torch.equal(state[k], after[k]) for k in state), f"state changed: {e.value}"
    return str(e.value)


def _vbe_refusals() -> str:
    """An MC-EC given a VBE batch on rank 1 (rank 0's is plain): every rank raises, nothing
    changes, and a plain batch trains on."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ec = _ec_model()
    modular.shard(ec, ShardingPlan(world_size=world, modules={
        "mc._embedding_module": {"t_raw": TablePlacement(ShardingType.ROW_WISE)}}))  # fmt: skip
    ec.mc(vbe_batch(0, rank, plain=True))
    message = _refused(ec, vbe_batch(1, rank, plain=rank == 0))
    ec.mc(vbe_batch(2, rank, plain=True))
    return message


def test_an_mc_ec_refuses_a_vbe_batch_on_every_rank_before_any_state_changes() -> None:
    messages = run_on_ranks(2, _vbe_refusals, timeout=60)
    assert messages[0] == messages[1]
    ec = messages[0]
    assert "'f_raw'" in ec and "rank 1" in ec and "ManagedCollisionEmbeddingCollection 'mc' (tables ['t_raw'])" in ec, ec
