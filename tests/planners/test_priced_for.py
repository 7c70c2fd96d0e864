"""A plan records what it was priced for (issue 50): `ShardingPlan.priced_for`.

Pure and single-process: `plan` and `plan_with_stats` fill the record from one `PlanOptions`;
it survives every way a plan is written and read (to_dict/JSON, `save_plan`/`load_plan`, the
CLI's `plan -o`, `replan`); a plan file written before plans recorded it still loads, recording
nothing; a plan written by hand records nothing and hashes as before. What `modular.shard` does
with the record is tested on gloo ranks in tests/modular/test_plan_assumptions.py.
"""

from __future__ import annotations

import dataclasses
import inspect
import json

import pytest

import planners
from planners import (
    ColumnWiseStatistic, DataType, Optimizer, PlanAssumptions, PlanError, PlanOptions,
    ShardingPlan, ShardingType, Table, TablePlacement, Topology,
)  # fmt: skip
from planners.__main__ import main
from planners.files import load_plan, save_plan
from planners.replicas import ReplicaSync

TABLES = [Table("t_a", 20_000, 32, pooling_factor=3.0), Table("t_b", 5_000, 16),
          Table("t_c", 1_000, 8)]  # fmt: skip
# The keyword arguments `plan` and `plan_with_stats` took before PlanOptions, in their order,
# and the tiered tables' two (issue 47) after them.
KEYWORDS = ("batch_size", "constraints", "optimizer", "module_fqn", "column_wise_statistic",
            "pooling_factors", "comm_dtype", "torchrec_compatible", "replicas", "replica_sync",
            "prefetch", "auto_tier")  # fmt: skip

# A plan file as `python -m planners plan -o` wrote it before plans recorded 'priced_for'.
OLD_PLAN_FILE = """{
  "format": 1,
  "world_size": 2,
  "ranks_per_host": 2,
  "modules": {
    "": {
      "t_a": {"sharding_type": "column_wise", "ranks": [0, 1]},
      "t_b": {"sharding_type": "table_wise", "ranks": [1]},
      "t_c": {"sharding_type": "data_parallel", "ranks": []}
    }
  },
  "planner": {
    "replicas": 1, "replica_sync": "exact", "batch_size": 64, "optimizer": "rowwise_adagrad",
    "column_wise_statistic": "exact", "comm_dtype": "fp32", "module": "",
    "torchrec_compatible": false, "world_size": 2, "ranks_per_host": 2,
    "tables": [
      {"name": "t_a", "num_embeddings": 20000, "embedding_dim": 32, "pooling_factor": 3.0},
      {"name": "t_b", "num_embeddings": 5000, "embedding_dim": 16},
      {"name": "t_c", "num_embeddings": 1000, "embedding_dim": 8}
    ],
    "constraints": {}
  }
}
"""


def test_a_plan_records_every_pricing_option_it_was_given():
    given = dict(batch_size=64, optimizer="adam",
                 column_wise_statistic="per_shard", comm_dtype="fp16", replicas=2,
                 replica_sync="periodic")  # fmt: skip
    plan = planners.plan(TABLES, Topology(4), **given)
    want = PlanAssumptions(batch_size=64, optimizer=Optimizer.ADAM,
                           column_wise_statistic=ColumnWiseStatistic.PER_SHARD,
                           comm_dtype=DataType.FP16, replicas=2, replica_sync=ReplicaSync.PERIODIC)  # fmt: skip
    assert plan.priced_for == want
    assert plan.world_size == 2  # one shard group of the 4 ranks
    assert planners.plan_with_stats(TABLES, Topology(4), **given).plan == plan
    # the defaults, and modular's spelling of the optimizer, recorded as the planner's
    default = planners.plan(TABLES, Topology(2), batch_size=32, optimizer="exact_rowwise_adagrad")
    assert default.priced_for == PlanAssumptions(batch_size=32)
    assert default.priced_for.optimizer is Optimizer.ROWWISE_ADAGRAD
    assert default.priced_for.comm_dtype is DataType.FP32 and default.priced_for.replicas == 1
    assert str(default).splitlines()[1] == (
        "  priced for batch 32 per rank, rowwise_adagrad (exact column statistic), fp32 comms, 1D")


def test_the_record_round_trips_through_json_and_is_part_of_the_plan():
    plan = planners.plan(TABLES, Topology(2), batch_size=64, comm_dtype="bf16")
    data = plan.to_dict()
    assert data["priced_for"] == {"batch_size": 64, "optimizer": "rowwise_adagrad",
                                  "column_wise_statistic": "exact", "comm_dtype": "bf16",
                                  "replicas": 1, "replica_sync": "exact"}  # fmt: skip
    assert list(data) == ["format", "world_size", "ranks_per_host", "priced_for", "modules"]
    back = ShardingPlan.from_json(plan.to_json())
    assert back == plan and back.priced_for == plan.priced_for and back.digest() == plan.digest()
    # the same placements priced for something else are another plan: ranks agreeing on a plan
    # agree on what it was priced for too
    other = dataclasses.replace(plan, priced_for=dataclasses.replace(plan.priced_for, comm_dtype="fp32"))
    assert other != plan and other.digest() != plan.digest()
    unrecorded = dataclasses.replace(plan, priced_for=None)
    assert "priced_for" not in unrecorded.to_dict() and unrecorded != plan


def test_save_plan_and_load_plan_keep_the_record(tmp_path):
    plan = planners.plan(TABLES, Topology(2), batch_size=64, optimizer="sgd")
    path = str(tmp_path / "plan.json")
    save_plan(path, plan, {"batch_size": 64})
    loaded, settings = load_plan(path)
    assert loaded == plan and loaded.priced_for.optimizer is Optimizer.SGD
    assert settings == {"batch_size": 64}


def test_the_cli_writes_the_record_and_reads_it_back(tmp_path, capsys):
    tables = tmp_path / "tables.yaml"
    tables.write_text("".join(f"- {json.dumps(t.to_dict())}\n" for t in TABLES))
    path = str(tmp_path / "plan.json")
    assert main(["plan", str(tables), "--world-size", "4", "--batch-size", "128",
                 "--optimizer", "partial_rowwise_adam", "--comm-dtype", "fp16",
                 "--replicas", "2", "--replica-sync", "periodic", "-o", path]) == 0  # fmt: skip
    capsys.readouterr()
    with open(path) as f:
        recorded = json.load(f)["priced_for"]
    assert recorded == {"batch_size": 128, "optimizer": "partial_rowwise_adam",
                        "column_wise_statistic": "exact", "comm_dtype": "fp16", "replicas": 2,
                        "replica_sync": "periodic"}  # fmt: skip
    assert main(["show", path]) == 0  # the CLI reads its own files
    assert "slowest rank" in capsys.readouterr().out


def test_replan_records_what_it_priced(tmp_path, capsys):
    topology = Topology(2)
    old = planners.plan(TABLES, topology, batch_size=64)
    drifted = [dataclasses.replace(t, pooling_factor=30.0) if t.name == "t_b" else t for t in TABLES]
    result = planners.replan(old, drifted, topology, batch_size=96, max_moved_bytes=None,
                             comm_dtype="fp16", optimizer="adagrad")  # fmt: skip
    assert result.plan.priced_for == PlanAssumptions(batch_size=96, optimizer="adagrad",
                                                     comm_dtype="fp16")  # fmt: skip
    # and on the command line, from the record of the old plan's file
    tables, new_tables = tmp_path / "old.yaml", tmp_path / "new.yaml"
    tables.write_text("".join(f"- {json.dumps(t.to_dict())}\n" for t in TABLES))
    new_tables.write_text("".join(f"- {json.dumps(t.to_dict())}\n" for t in drifted))
    old_path, new_path = str(tmp_path / "old.json"), str(tmp_path / "new.json")
    assert main(["plan", str(tables), "--world-size", "2", "--batch-size", "48", "-o", old_path]) == 0
    assert main(["replan", old_path, "--tables", str(new_tables), "-o", new_path]) == 0
    capsys.readouterr()
    assert load_plan(new_path)[0].priced_for == PlanAssumptions(batch_size=48)


def test_a_plan_file_written_before_the_record_loads_recording_nothing(tmp_path, capsys):
    path = tmp_path / "old.json"
    path.write_text(OLD_PLAN_FILE)
    plan, settings = load_plan(str(path))
    assert plan.priced_for is None and "priced_for" not in plan.to_dict()
    assert plan.placement("", "t_b") == TablePlacement(ShardingType.TABLE_WISE, ranks=(1,))
    assert settings["batch_size"] == 64
    assert ShardingPlan.from_json(OLD_PLAN_FILE) == plan
    assert main(["show", str(path)]) == 0  # shown and priced from its 'planner' block as before
    assert "slowest rank" in capsys.readouterr().out


def test_a_plan_written_by_hand_records_nothing_and_hashes_as_before():
    plan = ShardingPlan(world_size=2, modules={"": {"t": TablePlacement(ShardingType.ROW_WISE)}})
    assert plan.priced_for is None
    assert plan.to_dict() == {"format": 1, "world_size": 2, "ranks_per_host": None,
                              "modules": {"": {"t": {"sharding_type": "row_wise", "ranks": []}}}}  # fmt: skip
    recorded = ShardingPlan(2, plan.modules, priced_for=PlanAssumptions(batch_size=8))
    assert recorded.priced_for.batch_size == 8 and recorded != plan


@pytest.mark.parametrize("make, message", [
    (lambda: PlanAssumptions(batch_size=0), r"batch_size must be a positive integer \(per rank\), got 0"),
    (lambda: PlanAssumptions(batch_size=8, replicas=True), r"replicas must be a positive integer \(replica groups\), got True"),
    (lambda: PlanAssumptions(batch_size=8, optimizer="adamw"), r"unknown optimizer 'adamw'; expected one of: sgd \(exact_sgd\)"),
    (lambda: PlanAssumptions(batch_size=8, comm_dtype="fp8"), r"unknown dtype 'fp8'; expected one of: fp32, fp16, bf16"),
    (lambda: PlanAssumptions(batch_size=8, replica_sync="never"), r"unknown replica_sync 'never'"),
    (lambda: ShardingPlan(2, {}, priced_for={"batch_size": 8}), r"priced_for must be a planners.PlanAssumptions or None, got dict"),
    (lambda: PlanAssumptions.from_dict({"optimizer": "sgd"}), r"a plan's 'priced_for' needs a 'batch_size'"),
    (lambda: PlanAssumptions.from_dict({"batch_size": 8, "comm_dtyp": "fp16"}), r"unknown fields \['comm_dtyp'\] in the plan's 'priced_for'; it has 'batch_size', 'optimizer'"),
])  # fmt: skip
def test_a_bad_record_is_refused_naming_the_field(make, message):
    with pytest.raises(PlanError, match=message):
        make()


def test_a_bad_record_in_a_plan_file_names_the_file(tmp_path):
    data = json.loads(OLD_PLAN_FILE)
    data["priced_for"] = {"batch_size": 64, "optimizer": "adamw"}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(planners.FileFormatError, match=r"bad.json: not a sharding plan: unknown optimizer 'adamw'"):
        load_plan(str(path))


def test_plan_and_plan_with_stats_take_the_options_record_s_fields():
    fields = tuple(f.name for f in dataclasses.fields(PlanOptions))
    assert fields == KEYWORDS
    for fn in (planners.plan, planners.plan_with_stats):
        params = inspect.signature(fn).parameters
        assert tuple(params) == ("tables", "topology", *KEYWORDS)
        assert all(params[k].kind is inspect.Parameter.KEYWORD_ONLY for k in KEYWORDS)
        assert params["batch_size"].default is inspect.Parameter.empty
        assert params["optimizer"].default is Optimizer.ROWWISE_ADAGRAD
        assert params["replicas"].default == 1 and params["module_fqn"].default == ""
        with pytest.raises(TypeError, match="comm_dtyp"):
            fn(TABLES, Topology(2), batch_size=8, comm_dtyp="fp16")
        with pytest.raises(TypeError, match="batch_size"):
            fn(TABLES, Topology(2))
    # every keyword, given to both, gives the same plan
    given = dict(batch_size=64, constraints={"t_c": planners.TableConstraint(sharding_types=("table_wise",))},
                 optimizer="adagrad", module_fqn="sparse.ebc", column_wise_statistic="per_shard",
                 pooling_factors=None, comm_dtype="fp16", torchrec_compatible=True, replicas=1,
                 replica_sync="exact", prefetch=True, auto_tier=False)  # fmt: skip
    assert set(given) == set(KEYWORDS)
    plan = planners.plan(TABLES, Topology(2), **given)
    assert planners.plan_with_stats(TABLES, Topology(2), **given).plan == plan
    assert set(plan.modules) == {"sparse.ebc"}
    assert plan.placement("sparse.ebc", "t_c").sharding_type is ShardingType.TABLE_WISE


def test_the_options_record_parses_names_and_gives_what_the_plan_records():
    options = PlanOptions(batch_size=16, optimizer="exact_sgd", comm_dtype="FP16", replica_sync="periodic")
    assert options.optimizer is Optimizer.SGD and options.comm_dtype is DataType.FP16
    assert options.priced_for == PlanAssumptions(batch_size=16, optimizer="sgd", comm_dtype="fp16",
                                                 replica_sync="periodic")  # fmt: skip
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.batch_size = 32  # type: ignore[misc]
    with pytest.raises(TypeError):
        PlanOptions(16)  # type: ignore[misc]  keyword-only, as the functions' arguments
    # a sync given with one replica group was ignored unparsed before; now it is checked
    with pytest.raises(PlanError, match="unknown replica_sync 'sometimes'"):
        planners.plan(TABLES, Topology(2), batch_size=8, replica_sync="sometimes")
