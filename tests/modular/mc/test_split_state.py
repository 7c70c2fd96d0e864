"""The split collision state (Note [sharded managed collisions] in modular/mc/sharded_mch.py)
against torchrec's unsharded module fed the global batch, step by step: the remapped ids, the
slots `evict()` reports, and the whole collision state (its state_dict, gathered), with two MC
tables of different policies and intervals in one collection, a first batch smaller than the
later ones (so torchrec's history buffer, sized from it, cuts later intervals), eval steps, and
a module sharded mid-interval; evictions in at least half the intervals, their unique ids folded
into the id check or (a rank over the bound, a history cut) gathered apart. Each rank holds at
most its share of the slots."""

from __future__ import annotations

import copy
import math

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
from torchrec.modules.mc_modules import (
    DistanceLFU_EvictionPolicy, LFU_EvictionPolicy, LRU_EvictionPolicy, ManagedCollisionCollection,
    MCHManagedCollisionModule,
)  # fmt: skip
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import modular
from modular.mc.sharded_mch import ShardedMCHModule
from planners.types import ShardingPlan
from tests.dist import run_on_ranks
from tests.modular.ebc_cases import global_batch, placements_for

HASH = 2**50
POLICIES = {"lru": LRU_EvictionPolicy, "lfu": LFU_EvictionPolicy, "distance_lfu": DistanceLFU_EvictionPolicy}
FEATURES = {"t_a": ["fa1", "fa2"], "t_b": ["fb"]}


def _model(specs: dict[str, tuple[str, int, int]]) -> nn.Module:
    """An MC-EBC of two raw-id tables; specs: table -> (policy, eviction_interval, zch_size)."""
    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(name=t, num_embeddings=specs[t][2], embedding_dim=4, feature_names=FEATURES[t])
              for t in FEATURES]  # fmt: skip
    mcc = ManagedCollisionCollection(managed_collision_modules={
        t: MCHManagedCollisionModule(zch_size=z, device=torch.device("cpu"), eviction_policy=POLICIES[p](),
                                     eviction_interval=i, input_hash_size=HASH)
        for t, (p, i, z) in specs.items()}, embedding_configs=tables)  # fmt: skip
    model = nn.Module()
    model.mc = ManagedCollisionEmbeddingBagCollection(EmbeddingBagCollection(tables=tables), mcc,
                                                      return_remapped_features=True)  # fmt: skip
    return model


def _batch(step: int, rank: int) -> KeyedJaggedTensor:
    """Zipf ids over a drifting space (churn); step 0's batches are small, so that torchrec's
    history buffer, sized from the first global batch, cuts later intervals."""
    rng = np.random.default_rng([step, rank, 7])
    size = 3 if step == 0 else int(rng.integers(3, 9))
    lengths = rng.integers(0, 6, 3 * size)
    ids = (rng.zipf(1.3, int(lengths.sum())) + 5 * step) % 4000 * 1_000_003 % HASH
    return KeyedJaggedTensor(keys=["fa1", "fa2", "fb"], values=torch.tensor(ids, dtype=torch.int64),
                             lengths=torch.tensor(lengths, dtype=torch.int64))  # fmt: skip


def _slice(kjt: KeyedJaggedTensor, strides: list[int], rank: int) -> dict[str, torch.Tensor]:
    before, mine = sum(strides[:rank]), strides[rank]
    out = {}
    for key in kjt.keys():
        lengths = kjt[key].lengths()
        start = int(lengths[:before].sum())
        out[key] = kjt[key].values()[start: start + int(lengths[before: before + mine].sum())]
    return out


def _tied_batch(step: int, rank: int) -> KeyedJaggedTensor:
    """Uniform ids over a window that moves 8 ids a step, a few of each: small counts and shared
    access iterations, so that scores tie across ranks in every interval."""
    rng = np.random.default_rng([step, rank, 11])
    lengths = rng.integers(0, 4, 3 * 4)
    ids = (rng.integers(0, 40, int(lengths.sum())) + 8 * step) * 1_000_003 % HASH
    return KeyedJaggedTensor(keys=["fa1", "fa2", "fb"], values=torch.tensor(ids, dtype=torch.int64),
                             lengths=torch.tensor(lengths, dtype=torch.int64))  # fmt: skip


def _surging_batch(step: int, rank: int) -> KeyedJaggedTensor:
    """Batches that shrink to one sample every third step, then grow back: the history buffer
    (sized from a full first batch) never cuts, and a grown batch's unique ids overflow the bound
    that the small one set."""
    rng = np.random.default_rng([step, rank, 13])
    lengths = rng.integers(0, 6, 3 * (1 if step % 3 == 1 else 6 if step else 8))
    ids = (rng.zipf(1.3, int(lengths.sum())) + 7 * step) % 4000 * 1_000_003 % HASH
    return KeyedJaggedTensor(keys=["fa1", "fa2", "fb"], values=torch.tensor(ids, dtype=torch.int64),
                             lengths=torch.tensor(lengths, dtype=torch.int64))  # fmt: skip


def _run(specs: dict, steps: int, unsharded_steps: int = 0, batch=_batch) -> dict[str, int]:
    """`unsharded_steps` of the reference first (the model is sharded from its copy then, mid-
    interval), then `steps` more side by side; every 5th step in eval mode. Counts the
    intervals that evicted, per table, and ("spread") those whose evicted slots lay on several
    ranks."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ref = _model(specs)
    for step in range(unsharded_steps):
        ref.mc(global_batch([batch(step, r) for r in range(world)]))
    model = copy.deepcopy(ref)
    modular.shard(model, ShardingPlan(world_size=world, modules={
        "mc._embedding_module": placements_for("row_wise", model.mc._embedding_module, world)}))  # fmt: skip
    mcc, ref_mcc = model.mc._managed_collision_collection, ref.mc._managed_collision_collection
    evicting, held = {"cut": 0, "spread": 0, **{t: 0 for t in specs}}, {t: set() for t in specs}
    for module in ref_mcc._managed_collision_modules.values():
        module._coalesce_history = _spy(module, evicting)
    for step in range(unsharded_steps, unsharded_steps + steps):
        label = f"{specs} world {world} rank {rank} step {step}"
        for m in (model, ref):
            m.train(step % 5 != 4)
        batches = [batch(step, r) for r in range(world)]
        strides = [b.stride() for b in batches]
        _, remapped = model.mc(batches[rank])
        _, ref_remapped = ref.mc(global_batch(batches))
        want = _slice(ref_remapped, strides, rank)
        for key in want:
            assert torch.equal(remapped[key].values(), want[key]), f"{label}: remapped {key}"
        for table in specs:
            shard = mcc._managed_collision_modules[table]
            assert type(shard) is ShardedMCHModule, f"{label}: {table} is not split"
            zch = specs[table][2]
            assert shard._shard.raw.numel() <= math.ceil((zch - 1) / world), f"{label}: {table} holds more than its share"
            got, theirs = shard._evicted_emb_indices, ref_mcc._managed_collision_modules[table]._evicted_emb_indices
            if step > 1:  # both made their first decision (torchrec's starts as an empty float tensor)
                assert torch.equal(got, theirs), f"{label}: {table} evicted slots {got} != {theirs}"
        mine, want_state = mcc.state_dict(), ref_mcc.state_dict()
        for table in specs:
            now = set(want_state[f"_managed_collision_modules.{table}._mch_sorted_raw_ids"].tolist())
            evicting[table] += bool(held[table] - now) if step > unsharded_steps else 0
            key = f"_managed_collision_modules.{table}."
            came = torch.tensor(sorted(now - held[table]), dtype=torch.int64)
            taken = want_state[key + "_mch_remapped_ids_mapping"][torch.isin(want_state[key + "_mch_sorted_raw_ids"], came)]
            usable = specs[table][2] - 1
            ranks = {r for r in range(world) for s in taken.tolist() if usable * r // world <= s < usable * (r + 1) // world}
            evicting["spread"] += len(ranks) > 1 and step > unsharded_steps
            held[table] = now
        assert mine.keys() == want_state.keys(), f"{label}: keys"
        differ = [k for k in want_state if not torch.equal(mine[k], want_state[k])]
        assert not differ, f"{label}: collision state differs in {differ}"
    for module in mcc._managed_collision_modules.values():
        for why, n in module._folds.items():
            evicting["fold " + why] = evicting.get("fold " + why, 0) + n
    return evicting


def _spy(module: nn.Module, seen: dict[str, int]):
    """torchrec's `_coalesce_history`, counting the intervals whose history buffer was full."""
    coalesce = module._coalesce_history

    def spied() -> None:
        seen["cut"] += module._current_history_buffer_offset == module._input_history_buffer_size
        coalesce()

    return spied


CASES = [
    ({"t_a": ("lru", 3, 30), "t_b": ("distance_lfu", 1, 20)}, 16, 0),
    ({"t_a": ("lfu", 2, 50), "t_b": ("lru", 1, 20)}, 16, 0),
    ({"t_a": ("distance_lfu", 3, 30), "t_b": ("lfu", 2, 20)}, 10, 2),  # sharded mid-interval
]


SURGE = {"t_a": ("lfu", 1, 40), "t_b": ("distance_lfu", 2, 20)}


def _cases() -> list[dict[str, int]]:
    return [_run(*c) for c in CASES] + [_run(SURGE, 10, 0, batch=_surging_batch)]


def _ties() -> dict[str, int]:
    # full tables (30 reference steps first), then every interval evicts
    return _run({"t_a": ("distance_lfu", 1, 160), "t_b": ("lru", 1, 61)}, 8, 30, batch=_tied_batch)


def test_the_split_state_is_torchrecs_on_the_global_batch_step_by_step_at_worlds_1_2_3() -> None:
    for world in (2, 3, 1):
        evicting = run_on_ranks(world, _cases, timeout=240)[0]
        folds = {why: sum(c.pop("fold " + why) for c in evicting) for why in ("folded", "overflow", "cut", "no bound")}
        evicting.pop()  # the surging batches' case: never cut, so torchrec's buffer is not counted
        # an evicting call's unique ids ride in the id check when every rank's fit the bound and
        # the history kept the whole batch; else (a rank's batch grew, the buffer cut) a second gather
        assert all(folds.values()), f"world {world}: evicting calls by fold {folds}"
        for (specs, steps, _), counts in zip(CASES, evicting):
            counts.pop("spread")
            assert counts.pop("cut") > 0, f"world {world} {specs}: torchrec's history buffer never filled"
            for table, n in counts.items():
                intervals = (steps - steps // 5) // specs[table][1]  # eval steps do not evict
                assert 2 * n >= intervals, f"world {world} {specs}: {table} evicted in {n} of ~{intervals} intervals"


def test_ties_across_ranks_evict_as_torchrec_with_each_rank_sending_more_candidates_than_evicted() -> None:
    """Each rank sends its u lowest entries (u: the interval's ids), more than the n evicted:
    with DistanceLFU's equal counts and distances and LRU's equal access iterations tied across
    ranks, and evicted
    slots on several ranks in most intervals, the choice and its pairing stay torchrec's."""
    counts = run_on_ranks(3, _ties, timeout=120)[0]
    assert counts["spread"] >= 8, f"evicted slots lay on several ranks in only {counts}"
    assert counts["t_a"] >= 5 and counts["t_b"] >= 5, counts


def _fallback() -> str:
    """A collision module modular cannot split exactly (a threshold filter, experimental in
    torchrec) stays torchrec's, replicated, and still remaps the global batch."""
    from torchrec.modules.mc_modules import dynamic_threshold_filter

    world, rank = dist.get_world_size(), dist.get_rank()
    ref = _model({"t_a": ("lfu", 1, 30), "t_b": ("lru", 1, 20)})
    ref.mc._managed_collision_collection._managed_collision_modules["t_a"]._eviction_policy = LFU_EvictionPolicy(
        threshold_filtering_func=lambda counts: dynamic_threshold_filter(counts, threshold_skew_multiplier=0.5))
    model = copy.deepcopy(ref)
    modular.shard(model, ShardingPlan(world_size=world, modules={
        "mc._embedding_module": placements_for("table_wise", model.mc._embedding_module, world)}))  # fmt: skip
    modules = model.mc._managed_collision_collection._managed_collision_modules
    assert type(modules["t_a"]) is MCHManagedCollisionModule and type(modules["t_b"]) is MCHManagedCollisionModule
    for step in range(6):
        batches = [_batch(step, r) for r in range(world)]
        _, remapped = model.mc(batches[rank])
        _, ref_remapped = ref.mc(global_batch(batches))
        want = _slice(ref_remapped, [b.stride() for b in batches], rank)
        assert all(torch.equal(remapped[k].values(), want[k]) for k in want), f"step {step}"
    return type(modules["t_a"]).__name__


def test_a_collision_module_that_cannot_be_split_stays_replicated_and_exact() -> None:
    assert run_on_ranks(2, _fallback, timeout=120) == ["MCHManagedCollisionModule"] * 2
