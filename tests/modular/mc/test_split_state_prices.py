"""The planner's price of the split collision state (Note [pricing managed collisions] in
planners/mc_cost.py) against what `modular.shard` allocates for it, rank by rank: each rank's
slot entries exactly (an uneven split: 101 usable slots over 2 ranks), and the history of its
own ids within the priced bound, on 2 gloo ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import modular
import planners
from modular.mc.sharded_mch import ShardedMCHModule
from planners.mc_cost import HISTORY_BYTES, collision_price
from tests.dist import run_on_ranks
from tests.modular.mc.test_split_state import _model

BATCH = 6  # samples per rank; one id per bag
SPECS = {"t_a": ("distance_lfu", 3, 102), "t_b": ("lru", 1, 41)}  # (policy, interval, zch_size)


def _batch(step: int, rank: int) -> KeyedJaggedTensor:
    ids = torch.arange(3 * BATCH, dtype=torch.int64) + 1_000 * (step * 2 + rank) + 2**40
    return KeyedJaggedTensor(keys=["fa1", "fa2", "fb"], values=ids,
                             lengths=torch.ones(3 * BATCH, dtype=torch.int64))  # fmt: skip


def _held() -> tuple[dict[str, float], dict[str, float], dict[str, float], dict[str, float]]:
    """(priced slot bytes, allocated slot bytes, priced history bytes, kept history bytes), by
    table, on this rank after two training calls."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model = _model(SPECS)
    tables = planners.tables_from_model(model)
    cost = planners.CostModel(planners.Topology(world), BATCH)
    plan = planners.plan(model, planners.Topology(world), batch_size=BATCH)
    stats = planners.plan_stats(plan, tables, planners.Topology(world), batch_size=BATCH)
    flat = [t for group in tables.values() for t in group]
    whole = collision_price(flat, cost)
    assert stats.ranks[rank].collision_state == whole.state[rank]
    priced_slots = {t.name: float(collision_price([t], cost).slots[rank]) for t in flat}
    priced_history = {t.name: collision_price([t], cost).history for t in flat}
    modular.shard(model, plan)
    for step in range(2):
        model.mc(_batch(step, rank))
    modules = model.mc._managed_collision_collection._managed_collision_modules
    slots, history = {}, {}
    for name, module in modules.items():
        assert isinstance(module, ShardedMCHModule)
        shard = module._shard
        kept = [t for t in (shard.raw, shard.slots, shard.counts, shard.access) if t is not None]
        slots[name] = float(sum(t.numel() * t.element_size() for t in kept))
        history[name] = float(sum(ids.numel() * 8 + iters.numel() * 8 for ids, iters in module._history))
    return priced_slots, slots, priced_history, history


def test_the_priced_collision_state_is_what_each_rank_allocates() -> None:
    got = run_on_ranks(2, _held, timeout=120)
    for rank, (priced_slots, slots, priced_history, history) in enumerate(got):
        # slot entries: (101 usable slots dealt 51 / 50) x (raw id, slot, metadata columns)
        assert slots == priced_slots, f"rank {rank}: allocated {slots}, priced {priced_slots}"
        share = len(range(rank, 101, 2))  # Note [slots dealt round]
        assert slots["t_a"] == share * 8 * 4 and slots["t_b"] == len(range(rank, 40, 2)) * 8 * 3
        # history: t_a keeps its calls until the third (its interval), priced at the full
        # interval, 3 calls of 2 features x BATCH ids; t_b evicts every call and keeps none
        assert priced_history["t_a"] == 3 * 2 * BATCH * HISTORY_BYTES
        assert history["t_a"] == 2 * 2 * BATCH * HISTORY_BYTES <= priced_history["t_a"]
        assert history["t_b"] == 0 < priced_history["t_b"]
