"""plan(..., torchrec_compatible=True): plans that `to_torchrec` converts with no warning and no
moved row (issue 38; Note [plans TorchRec runs unchanged] in planners/options.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import warnings

import pytest

import planners
from planners import NoPlanError, ShardingType, Table, TableConstraint, Topology, block_split
from planners.__main__ import main
from tests.planners.helpers import check_valid, synthetic

pytest.importorskip("torch")
pytest.importorskip("torchrec")

T = ShardingType
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RANKING = os.path.join(ROOT, "examples", "tables_ranking.yaml")


def _odd(tables: list[Table]) -> list[Table]:
    """The synthetic tables with a few widths TorchRec's fused kernel refuses and a few tables
    too short to split over every rank without an empty block."""
    out = list(tables)
    for i in range(0, len(out), 7):
        t = out[i]
        out[i] = Table(t.name, t.num_embeddings, t.embedding_dim + 2, pooling_factor=t.pooling_factor)
    for i in range(3, len(out), 11):
        t = out[i]
        out[i] = Table(t.name, 5 + i, t.embedding_dim, pooling_factor=40.0)
    return out


def _check_torchrec_layout(plan: planners.ShardingPlan, tables: list[Table], topology: Topology) -> None:
    world, host = topology.world_size, topology.ranks_per_host
    for t in tables:
        p = plan.modules[""][t.name]
        shards = p.shards(num_embeddings=t.num_embeddings, embedding_dim=t.embedding_dim,
                          world_size=world)  # fmt: skip
        if t.embedding_dim % 4:
            assert p.sharding_type is T.DATA_PARALLEL, f"{t.name} ({t.embedding_dim} wide): {p}"
        if p.sharding_type is T.ROW_WISE:
            assert [s.rank for s in shards] == list(range(world)), f"{t.name}: {p}"
            assert tuple(s.num_rows for s in shards) == block_split(t.num_embeddings, world)
        if p.sharding_type is T.TABLE_ROW_WISE:
            first = shards[0].rank
            assert first % host == 0 and [s.rank for s in shards] == list(range(first, first + host))
            assert tuple(s.num_rows for s in shards) == block_split(t.num_embeddings, host)
        if p.sharding_type in (T.ROW_WISE, T.TABLE_ROW_WISE):
            assert all(s.num_rows > 0 for s in shards), f"{t.name}: an empty block"
        if p.sharding_type is T.COLUMN_WISE:
            assert all(s.num_cols % 4 == 0 for s in shards), f"{t.name}: {p}"
    # TorchRec holds it as planned: no warning, on GPUs and on CPU (where fbgemm's fused
    # kernel refuses empty blocks), and back to the same plan
    with warnings.catch_warnings():
        warnings.simplefilter("error", planners.TorchRecLayoutWarning)
        for device in ("cuda", "cpu"):
            tr_plan = planners.to_torchrec(plan, tables, device_type=device)
    back = planners.from_torchrec(tr_plan, world_size=world, ranks_per_host=host)
    assert back == dataclasses.replace(plan, priced_for=None)  # TorchRec's plan records no pricing


@pytest.mark.parametrize("n,world,per_host,comm", [(12, 8, 4, "fp32"), (40, 16, 8, "fp16"),
                                                   (60, 64, 8, "fp32"), (200, 32, 4, "bf16"),
                                                   (25, 6, 3, "fp32")])  # fmt: skip
def test_compatible_plans_convert_to_torchrec_unchanged(n, world, per_host, comm):
    tables = _odd(synthetic(n, seed=n + world, max_rows=1e7))
    topology = Topology(world, ranks_per_host=per_host)
    result = planners.plan_with_stats(tables, topology, batch_size=512, comm_dtype=comm,
                                      torchrec_compatible=True)  # fmt: skip
    check_valid(result.plan, tables, topology, 512)
    _check_torchrec_layout(result.plan, tables, topology)
    # the bound of the restricted problem is no lower than the bound of every plan, and
    # plan_stats gives it back when told
    free = planners.plan_stats(result.plan, tables, topology, batch_size=512, comm_dtype=comm)
    again = planners.plan_stats(result.plan, tables, topology, batch_size=512, comm_dtype=comm,
                                torchrec_compatible=True)  # fmt: skip
    assert result.stats.lower_bound == again.lower_bound >= free.lower_bound
    assert again.max_cost == result.stats.max_cost >= result.stats.lower_bound * (1 - 1e-12)
    assert again.over_capacity == ()
    assert "(of torchrec-compatible plans)" in result.stats.summary()


def test_the_planners_own_row_splits_are_not_torchrecs_but_compatible_ones_are():
    # Without the flag the search refines row splits (ranks get uneven blocks), which
    # to_torchrec has to move and warn about; with it, TorchRec's block split stays.
    tables = synthetic(30, seed=3, max_rows=1e8)
    topology = Topology(16, ranks_per_host=8)
    cons = {t.name: TableConstraint(sharding_types=(T.ROW_WISE, T.TABLE_ROW_WISE))
            for t in tables[:6]}  # fmt: skip
    free = planners.plan(tables, topology, batch_size=512, constraints=cons)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        planners.to_torchrec(free, tables)
    assert any(issubclass(w.category, planners.TorchRecLayoutWarning) for w in caught)
    plan = planners.plan(tables, topology, batch_size=512, constraints=cons,
                         torchrec_compatible=True)  # fmt: skip
    kinds = {plan.modules[""][t.name].sharding_type for t in tables[:6]}
    assert kinds <= {T.ROW_WISE, T.TABLE_ROW_WISE} and len(kinds) >= 1
    _check_torchrec_layout(plan, tables, topology)


def test_a_table_torchrec_cannot_shard_says_why():
    # 90 wide: TorchRec's fused kernel takes no shard of it, and a data-parallel copy does not fit
    # (its weights alone, 79.2 GB: a fused copy holds no dense gradient)
    tables = [Table("t_wide", 220_000_000, 90), Table("t_ok", 1000, 16, features=("f",))]
    with pytest.raises(NoPlanError) as e:
        planners.plan(tables, Topology(8), batch_size=512, torchrec_compatible=True)
    msg = str(e.value)
    assert e.value.tables == ("t_wide",)
    assert "a width that is a multiple of 4 (e.g. 92): torchrec_compatible lets a 90-wide table " \
           "only be data_parallel" in msg
    assert "to_torchrec(..., compute_kernel='dense')" in msg
    planners.plan(tables, Topology(8), batch_size=512)  # without the flag it is cut in rows


def test_cli_records_the_flag_and_show_prices_the_same_bound(tmp_path, capsys):
    path = str(tmp_path / "plan.json")
    cluster = ["--world-size", "16", "--ranks-per-host", "8", "--batch-size", "1024"]
    assert main(["plan", RANKING, *cluster, "--torchrec-compatible", "-o", path]) == 0
    planned = capsys.readouterr().out
    with open(path) as f:
        assert json.load(f)["planner"]["torchrec_compatible"] is True
    assert main(["show", path]) == 0
    shown = capsys.readouterr().out
    line = next(x for x in planned.splitlines() if x.startswith("lower bound"))
    assert "(of torchrec-compatible plans)" in line and line in shown.splitlines()
    free = str(tmp_path / "free.json")
    assert main(["plan", RANKING, *cluster, "-o", free]) == 0
    capsys.readouterr()
    assert main(["compare", free, path]) == 0
    assert "DIFFERENT torchrec_compatible: False vs True" in capsys.readouterr().out
