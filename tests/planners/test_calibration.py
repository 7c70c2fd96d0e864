"""Issue 51, time: `python -m planners calibrate`'s topology file (planners/calibration.py) and
how the cost model prices with it (Note [calibrated prices]). The measuring itself runs once, in
--quick mode, at world 2; the rest is pure Python on hand-written constants."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import planners
from planners.__main__ import main
from planners.calibration import Calibration, CalibrationError, KernelRate
from planners.types import ShardingPlan, ShardingType, TablePlacement

RATES = {
    "fused": KernelRate(per_id=10e-9, per_id_byte=0.2e-9, per_bag_column=1e-9),
    "emulated": KernelRate(per_id=50e-9, per_id_byte=1e-9, per_bag_column=2e-9),
    "dense": KernelRate(per_id=30e-9, per_id_byte=0.5e-9, per_bag_column=1e-9, per_table_byte=0.1e-9),
}


def _calibration(**changes) -> Calibration:
    fields = dict(kernels=RATES, all_to_all_latency=200e-6, all_to_all_bandwidth=1e9,
                  all_reduce_latency=300e-6, all_reduce_bandwidth=1e9, stream_bandwidth=20e9,
                  step_fixed=3e-3, kernel_fixed=1e-3, sent_id=5e-9,
                  world_size=2, threads_per_rank=1, backend="gloo", device="cpu", host="h",
                  measured_at=1.0e9)  # fmt: skip
    return Calibration(**{**fields, **changes})


def _tables() -> list[planners.Table]:
    return [planners.Table(f"t{i}", 10_000, 64, features=(f"f{i}",), pooling_factor=10) for i in range(4)]


def _tw_plan() -> ShardingPlan:
    return ShardingPlan(world_size=2, modules={"": {
        f"t{i}": TablePlacement(ShardingType.TABLE_WISE, ranks=(i % 2,)) for i in range(4)}})  # fmt: skip


def test_a_topology_file_round_trips_and_reaches_the_topology(tmp_path: Path) -> None:
    path = tmp_path / "h.json"
    _calibration().save(path)
    topology = planners.Topology.from_file(str(path))
    got = topology.calibration
    assert topology.world_size == 2 and got is not None and got.path == str(path)
    assert got.kernels == RATES and got.step_fixed == 3e-3 and got.host == "h"
    assert planners.Topology.from_file(str(path), 4, device_memory="20GiB").world_size == 4
    assert "calibrated constants from" in topology.constants and "measured on h" in topology.constants
    assert "over 30 days old" in topology.constants  # measured in 2001
    assert planners.Topology(2).calibration is None and "default constants" in planners.Topology(2).constants


@pytest.mark.parametrize("mangle,words", [
    (lambda d: {**d, "schema": "other/9"}, "schema 'other/9'"),
    (lambda d: {k: v for k, v in d.items() if k != "step_fixed"}, "missing or unexpected field"),
    (lambda d: {**d, "all_to_all_bandwidth": 0}, "all_to_all_bandwidth must be a positive number"),
    (lambda d: {**d, "kernels": {"fused": d["kernels"]["fused"]}}, "kernel rates for ['emulated', 'dense'] are missing"),
    (lambda d: [d], "expected a JSON object"),
])  # fmt: skip
def test_a_bad_topology_file_names_the_file_and_what_is_wrong(tmp_path: Path, mangle, words) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(mangle(_calibration().to_json())))
    with pytest.raises(CalibrationError) as e:
        planners.Topology.from_file(str(path))
    assert str(path) in str(e.value) and words in str(e.value)
    path.write_text("{not json")
    with pytest.raises(CalibrationError, match="not JSON"):
        Calibration.load(path)


def test_calibrated_prices_are_the_measured_rates_plus_the_fixed_part() -> None:
    """A table-wise rank's lookup is its kernel family's rate on the ids it receives, the dists
    move bytes at the measured all-to-all bandwidth, and `fixed` is the fixed part plus the
    rank's own batch's routing: worked out by hand for one rank."""
    cal = _calibration()
    topology = planners.Topology(2, calibration=cal)
    stats = planners.plan_stats(_tw_plan(), _tables(), topology, batch_size=100, optimizer="sgd")
    r0 = stats.ranks[0]
    ids = 2 * 100 * 10  # both ranks' batches of one table, 10 ids per bag
    lookup = 2 * RATES["fused"].seconds(ids, 64 * 4, 2 * 100 * 64, 0)  # two tables on rank 0
    assert r0.lookup == pytest.approx(lookup, rel=1e-9)
    assert r0.input_dist == pytest.approx(2 * 100 * 10 * 4 / 1e9, rel=1e-9)  # int32 ids from 1 peer
    assert r0.output_dist == pytest.approx(2 * 2 * 100 * 64 * 4 / 1e9, rel=1e-9)  # bags out, grads in
    own_batch = 5e-9 * 100 * 10 * 4  # each of its batch's ids sent once
    assert r0.fixed == pytest.approx(3e-3 + own_batch, rel=1e-9)
    assert r0.cost == pytest.approx(r0.lookup + r0.input_dist + r0.output_dist + r0.fixed)
    # Another family, and the dense kernel's whole-table step
    dense = planners.plan_stats(_tw_plan(), _tables(), topology, batch_size=100, optimizer="unfused_sgd")
    want = 2 * RATES["dense"].seconds(ids, 64 * 4, 2 * 100 * 64, 10_000 * 64 * 4)
    assert dense.ranks[0].lookup == pytest.approx(want, rel=1e-9)


def test_touched_rows_and_each_shards_call_are_priced_per_shard() -> None:
    """`per_touched_byte` prices the distinct rows a shard's ids touch (N (1 - exp(-n / N)) of
    uniform ids) and `per_shard` each shard's call: worked out by hand for a row-wise table."""
    rate = KernelRate(per_id=0.0, per_id_byte=0.0, per_bag_column=0.0, per_touched_byte=1e-9, per_shard=1e-4)
    cal = _calibration(kernels={**RATES, "fused": rate})
    plan = ShardingPlan(world_size=2, modules={"": {"t0": TablePlacement(ShardingType.ROW_WISE, ranks=(0, 1))}})
    stats = planners.plan_stats(plan, _tables()[:1], planners.Topology(2, calibration=cal), batch_size=100,
                                optimizer="sgd")  # fmt: skip
    rows, ids = 5_000, 2 * 100 * 10 / 2  # half the rows; half of both ranks' ids
    touched = rows * (1 - math.exp(-ids / rows))
    assert stats.ranks[0].lookup == pytest.approx(touched * 64 * 4 * 1e-9 + 1e-4, rel=1e-9)
    # A file written before these two were measured prices them at 0.
    data = _calibration().to_json()
    for r in data["kernels"].values():
        del r["per_touched_byte"], r["per_shard"]
    assert Calibration.from_json(data).kernels["fused"] == RATES["fused"]


def test_kernel_rates_are_recovered_from_their_shapes() -> None:
    """calibrate's kernel fit (modular/measure_kernels.py) over its own shapes: steps made from
    known rates plus a one-rank step's fixed part give those rates back, and the shapes tell
    every rate apart."""
    import numpy as np

    from modular.measure_kernels import fit_kernel_rate, kernel_features, kernel_shapes

    want = KernelRate(per_id=30e-9, per_id_byte=0.01e-9, per_bag_column=1e-9, per_table_byte=0.0,
                      per_touched_byte=0.3e-9, per_shard=20e-6)  # fmt: skip
    for quick in (False, True):
        shapes = kernel_shapes(quick)
        a = np.array([kernel_features(*s) + [1.0] for s in shapes])
        assert len(set(shapes)) == len(shapes) and np.linalg.matrix_rank(a) == a.shape[1]
        seconds = a @ np.array([getattr(want, p) for p in KernelRate.PARTS] + [0.4e-3])
        got = fit_kernel_rate(shapes, list(seconds))
        for part in KernelRate.PARTS:
            assert getattr(got, part) == pytest.approx(getattr(want, part), rel=1e-6, abs=1e-15), part
    # One step the machine slowed 2.5x (and one 1.3x) barely moves the rates: the fit is robust.
    slowed = seconds.copy()
    slowed[5] *= 2.5
    slowed[9] *= 1.3
    got = fit_kernel_rate(shapes, list(slowed))
    for part in ("per_id", "per_touched_byte", "per_shard"):
        assert getattr(got, part) == pytest.approx(getattr(want, part), rel=0.05), part


def test_fixed_costs_count_kinds_of_shards_and_data_parallel_tables() -> None:
    topology = planners.Topology(2, calibration=_calibration(sent_id=0.0))
    mixed = ShardingPlan(world_size=2, modules={"": {
        "t0": TablePlacement(ShardingType.TABLE_WISE, ranks=(0,)),
        "t1": TablePlacement(ShardingType.ROW_WISE, ranks=(0, 1)),
        "t2": TablePlacement(ShardingType.DATA_PARALLEL),
        "t3": TablePlacement(ShardingType.TABLE_WISE, ranks=(1,)),
    }})  # fmt: skip
    stats = planners.plan_stats(mixed, _tables(), topology, batch_size=100)
    # rank 0: table-wise, row-wise, data-parallel = 2 further kinds; rank 1 the same
    assert [r.fixed for r in stats.ranks] == pytest.approx([3e-3 + 2e-3 + 300e-6] * 2)
    assert stats.lower_bound >= min(r.fixed for r in stats.ranks)


def _dp_stats(cal: Calibration, rows: int, optimizer: str):
    tables = [planners.Table("t0", rows, 64, features=("f0",), pooling_factor=10)]
    plan = ShardingPlan(world_size=2, modules={"": {"t0": TablePlacement(ShardingType.DATA_PARALLEL)}})
    return planners.plan_stats(plan, tables, planners.Topology(2, calibration=cal), batch_size=100,
                               optimizer=optimizer).ranks[0]  # fmt: skip


def test_data_parallel_copies_are_priced_as_modular_runs_them() -> None:
    """Note [dense data-parallel copies]: an unfused copy whose global batch has at most as many
    ids as its table has rows replays the peers' ids and bag gradients (an all-to-all's worth),
    else all-reduces its gradient; its backward then runs on the global batch. A fused copy
    gathers touched rows. A file's `*_dp` rates price data-parallel copies; without them, the
    family's own."""
    cal = _calibration()
    ids, bags = 100 * 10, 100  # one rank's batch of t0
    replay = _dp_stats(cal, 10_000, "unfused_sgd")  # 2 x 1,000 ids <= 10,000 rows
    assert replay.grad_sync == pytest.approx(200e-6 + (ids * 8 + bags * 64 * 4) / 1e9, rel=1e-9)
    reduce = _dp_stats(cal, 1_000, "unfused_sgd")  # 2,000 ids > 1,000 rows
    assert reduce.grad_sync == pytest.approx(300e-6 + 1_000 * 64 * 4 / 1e9, rel=1e-9)
    rate = RATES["dense"]
    whole = rate.seconds(1.5 * ids, 64 * 4, bags * 64, 10_000 * 64 * 4)  # forward alone, backward global
    assert replay.lookup > whole  # and the whole-table step at the copy rate
    assert reduce.lookup >= rate.seconds(ids, 64 * 4, bags * 64, 1_000 * 64 * 4)
    touched = 10_000 * -math.expm1(-ids / 10_000)
    fused = _dp_stats(cal, 10_000, "rowwise_adagrad")
    assert fused.grad_sync == pytest.approx(200e-6 + touched * (8 + 64 * 4) / 1e9, rel=1e-9)
    assert fused.lookup == pytest.approx(RATES["fused"].seconds(1.5 * ids, 64 * 4, bags * 64, 10_000 * 64 * 4), rel=1e-9)
    own = KernelRate(per_id=1e-6, per_id_byte=0.0, per_bag_column=0.0)
    apart = _dp_stats(_calibration(kernels={**RATES, "fused_dp": own}), 10_000, "rowwise_adagrad")
    assert apart.lookup == pytest.approx(own.seconds(1.5 * ids, 0, 0, 0), rel=1e-9)


def test_uncalibrated_prices_do_not_change() -> None:
    plain = planners.plan_stats(_tw_plan(), _tables(), planners.Topology(2), batch_size=100)
    assert all(r.fixed == 0 for r in plain.ranks)
    lookup = 2 * (2000 * 64 * 4 + 200 * 64 * 4 + 200 * 64 * 4 + 2000 * (2 * 64 * 4 + 2 * 4)) / 3.35e12
    assert plain.ranks[0].lookup == pytest.approx(lookup, rel=1e-9)


def test_the_cli_prices_with_a_topology_file_and_records_it(tmp_path: Path, capsys) -> None:
    topo = tmp_path / "h.json"
    _calibration(measured_at=__import__("time").time() - 7200).save(topo)
    tables = tmp_path / "t.yaml"
    tables.write_text("- {name: a, num_embeddings: 1000, embedding_dim: 16, pooling_factor: 3}\n"
                      "- {name: b, num_embeddings: 5000, embedding_dim: 32, pooling_factor: 1}\n")
    plan = tmp_path / "p.json"
    assert main(["plan", str(tables), "--world-size", "2", "--batch-size", "64", "--topology", str(topo),
                 "-o", str(plan)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert f"priced with calibrated constants from {topo}" in out and "2.0 hours ago" in out
    assert "fixed" in out  # the per-rank column
    assert main(["show", str(plan)]) == 0  # the file is recorded in the plan
    assert f"calibrated constants from {topo}" in capsys.readouterr().out
    assert main(["compare", str(plan), str(plan), "--topology", str(topo)]) == 0
    assert "calibrated constants" in capsys.readouterr().out
    assert main(["show", str(plan), "--format", "json"]) == 0
    assert "calibrated" in json.loads(capsys.readouterr().out)["constants"]
    assert main(["plan", str(tables), "--world-size", "2", "--batch-size", "64"]) == 0
    assert "H100 defaults in effect" in capsys.readouterr().out
    topo.write_text("[]")
    assert main(["show", str(plan)]) == 2
    assert str(topo) in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_calibrate_measures_this_machine_and_writes_a_file_plan_reads(tmp_path: Path, capsys) -> None:
    out = tmp_path / "h.json"
    assert main(["calibrate", "--out", str(out), "--world-size", "2", "--quick"]) == 0
    printed = capsys.readouterr().out
    assert "probe steps" in printed and "shapes, apart from the wire" in printed and f"wrote {out}" in printed
    cal = planners.Topology.from_file(str(out)).calibration
    assert cal is not None and cal.world_size == 2 and (cal.backend, cal.device, cal.notes) == ("gloo", "cpu", ())
    assert "notes" not in json.loads(out.read_text()) and "gloo, world 2" in printed
    assert cal.step_fixed > 0 and all(math.isfinite(cal.kernels[f].per_id_byte) for f in cal.kernels)
    assert cal.all_to_all_bandwidth > 1e6 and cal.stream_bandwidth > cal.all_to_all_bandwidth
