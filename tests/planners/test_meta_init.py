"""Issue 51, peak memory: what `shard` holds for a moment on a meta model beyond the plan
(Note [pricing meta init] in planners/init_transient.py)."""

from __future__ import annotations

import pytest

import planners
from planners import DataType, ShardingType, Table, TableConstraint, Topology
from planners.init_transient import SHARD_RUNTIME_BYTES, STEP_RUNTIME_BYTES, WHOLE_TABLE_INIT_BYTES
from planners.types import ShardingPlan, TablePlacement

T = ShardingType


def test_the_constant_is_modulars() -> None:
    from modular.tables.meta_init import WHOLE_TABLE_INIT_BYTES as modulars

    assert WHOLE_TABLE_INIT_BYTES == modulars


def test_the_largest_table_a_rank_holds_a_piece_of() -> None:
    tables = [Table("tw", 1000, 32), Table("rw", 6000, 16), Table("cw", 4000, 64),
              Table("dp", 3000, 32), Table("half", 2000, 32, dtype=DataType.FP16),
              Table("huge", 2**28 + 8, 4)]  # over 1 GiB: its init_fn runs per shard  # fmt: skip
    plan = ShardingPlan(world_size=3, modules={"": {
        "tw": TablePlacement(T.TABLE_WISE, ranks=(0,)),
        "rw": TablePlacement(T.ROW_WISE, ranks=(0, 1)),
        "cw": TablePlacement(T.COLUMN_WISE, ranks=(1, 2), sizes=(32, 32)),
        "dp": TablePlacement(T.DATA_PARALLEL),
        "half": TablePlacement(T.ROW_WISE, ranks=(2, 0)),
        "huge": TablePlacement(T.ROW_WISE, ranks=(0, 1, 2)),
    }})  # fmt: skip
    stats = planners.plan_stats(plan, tables, Topology(3, device_memory="80GiB"), batch_size=8)
    rw, cw, half = 6000 * 16 * 4, 4000 * 64 * 4, 2000 * 32 * 2
    assert [r.meta_init for r in stats.ranks] == [max(rw, half), max(rw, cw), max(cw, half)]
    assert all(r.meta_init not in (r.memory, 0.0) for r in stats.ranks)


def test_whole_pieces_take_no_more() -> None:
    tables = [Table(f"t{i}", 5000, 32) for i in range(4)]
    cons = {t.name: TableConstraint(sharding_types=(T.TABLE_WISE, T.DATA_PARALLEL)) for t in tables}
    stats = planners.plan_with_stats(tables, Topology(2), batch_size=64, constraints=cons).stats
    assert [r.meta_init for r in stats.ranks] == [0.0, 0.0]


def test_the_per_rank_view_shows_it() -> None:
    tables = [Table("rw", 6000, 16)]
    plan = ShardingPlan(world_size=2, modules={"": {"rw": TablePlacement(T.ROW_WISE, ranks=(0, 1))}})
    stats = planners.plan_stats(plan, tables, Topology(2), batch_size=8)
    view = stats.format_ranks()
    head = next(line for line in view.splitlines() if line.split()[:2] == ["rank", "weights"])
    assert head.split()[-3:] == ["meta-init", "peak", "shard-peak"] and "meta-init: what `shard` holds" in view
    row = next(line for line in view.splitlines()[view.splitlines().index(head) + 1:] if line.split()[0] == "0")
    r0 = stats.ranks[0]
    assert row.split()[-6:] == " ".join(planners.format_bytes(b) for b in (6000 * 16 * 4, r0.peak, r0.shard_peak)).split()


def test_an_unfused_optimizers_step_temporaries_for_the_largest_piece() -> None:
    """Note [pricing step transients]: Adam's step holds two temporaries as large as the rank's
    largest local piece, Adagrad's one, SGD's none; a data-parallel copy is a whole table. The
    peak is what the rank holds plus the larger of the batch and the step's temporaries."""
    tables = [Table("rw", 6000, 16), Table("dp", 1000, 32), Table("half", 9000, 32, dtype=DataType.FP16)]
    plan = ShardingPlan(world_size=2, modules={"": {
        "rw": TablePlacement(T.ROW_WISE, ranks=(0, 1), sizes=(4000, 2000)),
        "dp": TablePlacement(T.DATA_PARALLEL),
        "half": TablePlacement(T.TABLE_WISE, ranks=(1,)),
    }})  # fmt: skip
    piece = {0: max(4000 * 16 * 4, 1000 * 32 * 4), 1: max(2000 * 16 * 4, 1000 * 32 * 4, 9000 * 32 * 2)}
    for optimizer, count in (("unfused_adam", 2), ("unfused_adagrad", 1), ("unfused_sgd", 0), ("adam", 0)):
        stats = planners.plan_stats(plan, tables, Topology(2), batch_size=8, optimizer=optimizer)
        assert [r.step_transient for r in stats.ranks] == [count * piece[0], count * piece[1]], optimizer
        for r in stats.ranks:
            assert r.peak == r.held + r.runtime + max(r.batch, r.step_transient)
            assert r.runtime == STEP_RUNTIME_BYTES
            step = r.held + max(r.batch, r.step_transient)  # the peak less the runtime's
            assert step >= r.memory and (step > r.memory) == (r.step_transient > r.batch)
    # with a small batch Adam's temporaries set the peak; the per-rank view and the dict show them
    stats = planners.plan_stats(plan, tables, Topology(2), batch_size=8, optimizer="unfused_adam")
    adam = stats.ranks[1]
    assert adam.peak == adam.held + STEP_RUNTIME_BYTES + 2 * 9000 * 32 * 2 > adam.memory
    assert stats.to_dict()["ranks"][1]["peak"] == adam.peak
    view = stats.format_ranks()
    head = next(line for line in view.splitlines() if line.split()[:2] == ["rank", "weights"])
    assert head.split()[-4:] == ["step-temp", "meta-init", "peak", "shard-peak"] and "step-temp: what the torch optimizer" in view
    sgd = planners.plan_stats(plan, tables, Topology(2), batch_size=8, optimizer="unfused_sgd")
    sgd_head = next(line for line in sgd.format_ranks().splitlines() if line.split()[:2] == ["rank", "weights"])
    assert "step-temp" not in sgd_head and "step-temp:" not in sgd.format_ranks()  # no column, no legend


def test_what_shard_leaves_a_meta_rank_is_its_weights_fused_state_and_the_table_it_fills_whole() -> None:
    """Note [pricing a step's runtime]: `shard_peak` is the weights, the fused state (a torch
    optimizer's state and the unfused gradient buffers come after `shard`), `meta_init` and
    the runtime `shard` has allocated; the rank peaks at the larger of it and `peak`."""
    tables = [Table("rw", 6000, 16), Table("tw", 3000, 32)]
    plan = ShardingPlan(world_size=2, modules={"": {
        "rw": TablePlacement(T.ROW_WISE, ranks=(0, 1), sizes=(3000, 3000)),
        "tw": TablePlacement(T.TABLE_WISE, ranks=(0,)),
    }})  # fmt: skip
    for optimizer, fused in (("adam", True), ("rowwise_adagrad", True), ("unfused_adam", False), ("unfused_sgd", False)):
        stats = planners.plan_stats(plan, tables, Topology(2), batch_size=8, optimizer=optimizer)
        for r in stats.ranks:
            state = r.optimizer_state if fused else 0.0
            assert r.shard_peak == pytest.approx(r.weights + state + r.meta_init + SHARD_RUNTIME_BYTES), optimizer
            assert r.meta_init == 6000 * 16 * 4  # the row-wise table, filled whole on both ranks
            if not fused:  # the gradient buffers and torch's state come later
                assert r.shard_peak - SHARD_RUNTIME_BYTES < r.held + r.meta_init
            assert stats.to_dict()["ranks"][r.rank]["shard_peak"] == r.shard_peak
