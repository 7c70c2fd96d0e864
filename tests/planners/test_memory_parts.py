"""The planner prices, per rank, what modular allocates (Note [what a rank holds] in
planners/cost.py): weights, optimizer state, unfused gradient buffers, kept buffers. Pure."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

import planners
from planners import Optimizer, PlanAssumptions, Table, Topology
from planners.__main__ import main
from planners.files import load_plan
from planners.cost import CostModel, TableArrays, column_scratch_bytes
from planners.types import ShardingType as T

TOPO = Topology(world_size=2, ranks_per_host=2)
TABLE = TableArrays.of([Table("t", 1000, 64, pooling_factor=2.0)])
FP16 = TableArrays.of([Table("h", 1000, 64, pooling_factor=2.0, dtype="fp16")])


def parts(optimizer, kind=T.TABLE_WISE, arrays=TABLE, rows=1000, cols=64, k=1, **kw):
    c = CostModel(TOPO, batch_size=100, optimizer=optimizer, **kw).shard(
        kind, arrays, float(rows), float(cols), float(k))
    return {n: float(np.asarray(getattr(c, n)).ravel()[0])
            for n in ("weights", "state", "gradients", "buffers", "memory")}


def test_unfused_members_have_no_fused_name_and_parse_by_value():
    for name, member in (("unfused_sgd", Optimizer.UNFUSED_SGD),
                         ("unfused_adagrad", Optimizer.UNFUSED_ADAGRAD),
                         ("unfused_adam", Optimizer.UNFUSED_ADAM)):
        assert Optimizer.parse(name) is member and Optimizer.parse(name.upper()) is member
        assert member.fused_name is None and not member.fused
    assert all(o.fused for o in Optimizer if not o.value.startswith("unfused_"))
    assert Optimizer.parse("exact_sgd") is Optimizer.SGD
    assert PlanAssumptions(batch_size=8, optimizer="unfused_adam").to_dict()["optimizer"] == "unfused_adam"
    with pytest.raises(planners.PlanError, match="unfused_sgd"):
        Optimizer.parse("momentum")


@pytest.mark.parametrize("optimizer,per_elem", [("unfused_sgd", 0), ("unfused_adagrad", 1),
                                                ("unfused_adam", 2)])
@pytest.mark.parametrize("arrays,elem", [(TABLE, 4), (FP16, 2)])
def test_unfused_tables_keep_a_gradient_as_large_as_the_weights_and_torch_state(
        optimizer, per_elem, arrays, elem):
    for kind in (T.TABLE_WISE, T.DATA_PARALLEL):
        p = parts(optimizer, kind, arrays)
        assert p["weights"] == 1000 * 64 * elem
        assert p["gradients"] == p["weights"]  # Note [dense gradient buffer]
        assert p["state"] == per_elem * 1000 * 64 * elem  # torch's state: the weights' dtype
        assert p["buffers"] == 0


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adagrad"])
def test_fused_data_parallel_copies_hold_no_gradient_and_fbgemm_replays_keep_no_buffers(optimizer):
    p = parts(optimizer, T.DATA_PARALLEL)
    assert p["gradients"] == 0 and p["buffers"] == 0
    assert p["state"] == Optimizer.parse(optimizer).state_bytes_per_row(64) * 1000
    odd = parts(optimizer, T.DATA_PARALLEL, cols=63)  # emulated: gather buffers
    assert odd["buffers"] > 0


def test_adam_family_data_parallel_copies_keep_gather_buffers():
    p = parts("adam", T.DATA_PARALLEL)
    ids = 100 * 2
    mine, every = 1000 * -math.expm1(-ids / 1000), 1000 * -math.expm1(-2 * ids / 1000)
    packed = mine * (8 + 64 * 4)
    assert p["buffers"] == pytest.approx(1.125 * (3 * packed + every * 64 * 4))
    assert p["gradients"] == 0 and p["state"] == 1000 * 64 * 8
    assert parts("adam", T.TABLE_WISE)["buffers"] == 0  # only the copies gather


def test_column_scratch_only_where_a_kernel_group_mixes_widths():
    rowwise, exact = Optimizer.ROWWISE_ADAGRAD, planners.ColumnWiseStatistic.EXACT
    same = [(1000, 32, "fp32", False), (500, 32, "fp32", False)]
    assert column_scratch_bytes(rowwise, exact, same) == 0
    mixed = [(1000, 32, "fp32", False), (500, 16, "fp32", False)]
    assert column_scratch_bytes(rowwise, exact, mixed) == 4 * 1500
    # groups by dtype, odd widths emulated, sequences one width per group
    assert column_scratch_bytes(rowwise, exact, [(1000, 32, "fp32", False),
                                                 (500, 16, "fp16", False)]) == 0
    assert column_scratch_bytes(rowwise, exact, [(1000, 32, "fp32", False),
                                                 (500, 18, "fp32", False)]) == 0
    assert column_scratch_bytes(rowwise, exact, [(1000, 32, "fp32", True),
                                                 (500, 16, "fp32", True)]) == 0
    per_shard = planners.ColumnWiseStatistic.PER_SHARD
    assert column_scratch_bytes(rowwise, per_shard, mixed) == 0
    assert column_scratch_bytes(Optimizer.ADAGRAD, exact, mixed) == 0


def _column_plan(dims):
    tables = [Table(f"t{i}", 1000, d, features=(f"f{i}",)) for i, d in enumerate(dims)]
    cons = {t.name: planners.TableConstraint(sharding_types=("column_wise",), min_shards=2)
            for t in tables}
    plan = planners.plan(tables, TOPO, batch_size=16, constraints=cons)
    return tables, plan, planners.plan_stats(plan, tables, TOPO, batch_size=16)


def test_plan_stats_prices_the_scratch_per_rank_and_never_more_than_the_search():
    tables, plan, stats = _column_plan([64, 64])  # one width on each rank: no scratch
    assert all(r.buffers == 0 for r in stats.ranks)
    tables, plan, stats = _column_plan([64, 32])  # mixed widths on each rank
    for r in stats.ranks:
        pieces = [(s.num_rows, s.num_cols) for t in stats.tables for s in t.shards if s.rank == r.rank]
        assert r.buffers == (4 * sum(n for n, _ in pieces)
                             if len({c for _, c in pieces}) > 1 else 0)


def test_plan_stats_shows_each_part_per_rank_and_they_add_up():
    tables = [Table("a", 5000, 64), Table("b", 300, 16), Table("c", 20_000, 32)]
    for optimizer in ("rowwise_adagrad", "unfused_sgd", "unfused_adam", "adam"):
        plan = planners.plan(tables, TOPO, batch_size=64, optimizer=optimizer)
        assert plan.priced_for.optimizer is Optimizer.parse(optimizer)
        stats = planners.plan_stats(plan, tables, TOPO, batch_size=64, optimizer=optimizer)
        for r in stats.ranks:
            assert r.memory == pytest.approx(r.weights + r.optimizer_state + r.gradients
                                             + r.buffers + r.batch)
            assert r.held == pytest.approx(r.memory - r.batch) and r.batch > 0
            assert (r.gradients == r.weights) is (optimizer.startswith("unfused"))
        row = stats.to_dict()["ranks"][0]
        assert {"weights", "optimizer_state", "gradients", "buffers", "batch"} <= set(row)
        text = stats.format()
        assert "weights" in text and "grads" in text and "buffers" in text


def test_cli_takes_the_unfused_optimizers(tmp_path, capsys):
    path = tmp_path / "tables.json"
    path.write_text('[{"name": "a", "num_embeddings": 5000, "embedding_dim": 64}]')
    out = str(tmp_path / "plan.json")
    assert main(["plan", str(path), "--world-size", "2", "--batch-size", "64",
                 "--optimizer", "unfused_adam", "-o", out]) == 0
    text = capsys.readouterr().out
    assert "unfused_adam" in text and "grads" in text
    plan, _ = load_plan(out)
    assert plan.priced_for.optimizer is Optimizer.UNFUSED_ADAM
