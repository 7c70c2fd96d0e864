"""Issue 47, the planner's part: tiered tables in the CLI (per-table cache columns, per-rank cache
and tier bytes, the settings a plan file records), through plan rewrites (replan, nearby moves)
and both ways through TorchRec's UVM caching. Pure and single-process."""

from __future__ import annotations

import csv
import io
import json

import numpy as np
import pytest

import planners
from planners import PlanError, ShardingPlan, Table, TableConstraint, TablePlacement, Topology
from planners.__main__ import main
from planners.moves import adapt_placement
from planners.nearby import recuts, relocations
from planners.types import ShardingType as T

TABLES_YAML = """\
- {name: t_big, num_embeddings: 4000000, embedding_dim: 64, pooling_factor: 4}
- {name: t_mid, num_embeddings: 1000000, embedding_dim: 64}
- {name: t_small, num_embeddings: 1000, embedding_dim: 64}
"""


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_shows_each_tiered_table_and_each_ranks_cache_and_tier(tmp_path, capsys):
    tables = tmp_path / "t.yaml"
    tables.write_text(TABLES_YAML)
    plan_path = str(tmp_path / "p.json")
    flags = ["--world-size", "2", "--batch-size", "64", "--device-memory", "367MiB",
             "--reserved", "0", "--tier-bandwidth", "1e9", "--tier-memory", "10GiB"]  # fmt: skip
    code, out, _ = _run(capsys, "plan", str(tables), *flags, "-o", plan_path)
    assert code == 0
    head = next(line for line in out.splitlines() if line.startswith("table "))
    assert head.split()[-4:] == ["cache", "cache", "rows", "hit"]
    big = next(line for line in out.splitlines() if line.startswith("t_big "))
    factor = json.load(open(plan_path))["modules"][""]["t_big"]["cache_load_factor"]
    rows = 4_000_000 // 2  # row-wise over both ranks
    assert f"{factor:g} lru" in big and f"{2 * int(np.ceil(rows * factor)):_}" in big
    assert out.count("t_small ") == 1 and next(
        line for line in out.splitlines() if line.startswith("t_small ")).rstrip().endswith("-")
    mem_head = next(line for line in out.splitlines() if line.split()[:2] == ["rank", "weights"])
    assert mem_head.split()[-7:] == ["cache", "batch", "tier", "tier-io", "meta-init", "peak", "shard-peak"]
    assert "planner tiered 1 table" in out and "of 10.0 GiB" in out
    recorded = json.load(open(plan_path))["planner"]
    assert (recorded["tier_memory"], recorded["tier_bandwidth"], recorded["prefetch"]) == (
        10 * 2**30, 1e9, False)
    # `show` prices it as planned; --prefetch takes the traffic out of the step
    code, shown, _ = _run(capsys, "show", plan_path, "--format", "csv")
    assert code == 0
    rows_ = list(csv.DictReader(io.StringIO(shown)))
    big_rows = [r for r in rows_ if r["table"] == "t_big"]
    assert {r["cache_load_factor"] for r in big_rows} == {str(factor)}
    assert all(float(r["tier_s"]) > 0 and 0 < float(r["hit_rate"]) < 1 for r in big_rows)
    assert {r["cache_rows"] for r in rows_ if r["table"] == "t_mid"} == {""}
    code, plain, _ = _run(capsys, "show", plan_path)
    code, ahead, _ = _run(capsys, "show", plan_path, "--prefetch")
    assert "prefetch True (the plan records False)" in ahead
    cost = lambda text: float(text.split("slowest rank")[1].split(":")[1].split()[0])  # noqa: E731
    assert cost(ahead) < cost(plain)
    # --no-auto-tier: the resident explanation
    code, _, err = _run(capsys, "plan", str(tables), *flags, "--no-auto-tier")
    assert code == 1 and err.startswith("error: no plan fits")


def test_rewrites_keep_the_tier():
    table = Table("t", 1_000, 64)
    p = TablePlacement(T.ROW_WISE, (0, 1), sizes=(600, 400), cache_load_factor=0.1, cache_policy="lfu")
    grown = adapt_placement(p, Table("t", 2_000, 64))
    assert grown.sizes == (1200, 800) and (grown.cache_load_factor, grown.cache_policy) == (0.1, "lfu")
    load = np.array([3.0, 1.0, 0.0, 0.0])
    moved = relocations(p, 1, np.array([0.0, 3.0, 1.0, 1.0]), 4, None)
    assert moved and all((q.cache_load_factor, q.cache_policy) == (0.1, "lfu") for q in moved)
    cuts = recuts(p, table, 0, load, 4, None, own=1.0)
    assert cuts and all(q.cache_load_factor == 0.1 and q.sharding_type is not T.DATA_PARALLEL
                        for q, _ in cuts)  # fmt: skip
    resident = TablePlacement(T.ROW_WISE, (0, 1), sizes=(600, 400))
    assert any(q.sharding_type is T.DATA_PARALLEL for q, _ in recuts(resident, table, 0, load, 4, None, own=1.0))
    assert "tiered (cache 0.1, lfu)" in p.describe(4) and "cache_load_factor=0.1" in repr(p)


def test_replan_keeps_the_tier():
    tables = [Table("t_a", 200_000, 64, pooling_factor=8.0), Table("t_b", 50_000, 32)]
    cons = {"t_a": TableConstraint(cache_load_factor=0.05)}
    topo = Topology(4)
    old = planners.plan(tables, topo, batch_size=256, constraints=cons)
    assert old.placement("", "t_a").cache_load_factor == 0.05
    grown = [Table("t_a", 200_000, 64, pooling_factor=30.0), Table("t_b", 50_000, 32, pooling_factor=6.0)]
    for budget in (None, 0):
        new = planners.replan(old, grown, topo, batch_size=256, max_moved_bytes=budget, constraints=cons)
        assert new.plan.placement("", "t_a").cache_load_factor == 0.05
        assert new.plan.placement("", "t_b").cache_load_factor is None
        assert new.stats.table("t_a").cache_rows > 0


def test_a_topology_file_may_give_the_tier(tmp_path):
    from tests.planners.test_calibration import _calibration

    path = tmp_path / "h.json"
    data = _calibration().to_json() | {"tier_memory": "300GiB", "tier_bandwidth": 3e9}
    path.write_text(json.dumps(data))
    topo = Topology.from_file(str(path))
    assert (topo.tier_memory, topo.tier_bandwidth) == (300 * 2**30, 3e9)
    assert Topology.from_file(str(path), tier_bandwidth=1e9).tier_bandwidth == 1e9  # given wins
    plain = tmp_path / "p.json"
    _calibration().save(plain)  # a file without them: Topology's defaults
    assert Topology.from_file(str(plain)).tier_memory == Topology(2).tier_memory
    path.write_text(json.dumps(data | {"tier_bandwidth": -1}))
    with pytest.raises(PlanError, match="tier_bandwidth must be a positive number"):
        Topology.from_file(str(path))


torch = pytest.importorskip("torch")
pytest.importorskip("torchrec")


def test_tiered_placements_are_torchrecs_uvm_caching_both_ways():
    from torchrec.distributed.types import CacheAlgorithm, CacheParams

    tables = [Table("t_rw", 1_000, 16), Table("t_tw", 100, 8), Table("t_res", 50, 8)]
    plan = ShardingPlan(2, {"": {
        "t_rw": TablePlacement(T.ROW_WISE, (0, 1), cache_load_factor=0.1, cache_policy="lfu"),
        "t_tw": TablePlacement(T.TABLE_WISE, (1,), cache_load_factor=0.02),
        "t_res": TablePlacement(T.TABLE_WISE, (0,)),
    }}, ranks_per_host=2)  # fmt: skip
    for kernel in ("fused", "dense"):
        tr = planners.to_torchrec(plan, tables, device_type="cpu", compute_kernel=kernel)
        rw, tw, res = (tr.plan[""][n] for n in ("t_rw", "t_tw", "t_res"))
        assert rw.compute_kernel == tw.compute_kernel == "fused_uvm_caching"
        assert rw.cache_params == CacheParams(algorithm=CacheAlgorithm.LFU, load_factor=0.1)
        assert tw.cache_params == CacheParams(algorithm=CacheAlgorithm.LRU, load_factor=0.02)
        assert res.compute_kernel == kernel and res.cache_params is None
        assert planners.from_torchrec(tr, world_size=2, ranks_per_host=2) == plan
    rw.cache_params = None  # left to the sharder's fused_params
    with pytest.raises(PlanError, match="'t_rw' uses fused_uvm_caching with no cache_params.load_factor"):
        planners.from_torchrec(tr, world_size=2)
