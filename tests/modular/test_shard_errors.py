"""Bad plans and bad batches raise clear errors, on every rank, and never hang a peer.

Plan problems are agreed in the one small gather every rank always joins (Note [agreeing on the
plan] in modular/sharding.py), and raised before any other collective: their rank bodies run
`modular.shard` under `no_collectives(allow=AGREEMENT)`, which turns any other collective into a
`CollectiveCalled` error (so a check that came after building a table would show the wrong
message). Batch problems are seen by one
rank; its peers must raise too, and afterwards every rank must still compute correct results.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

import modular
from planners.types import ShardingPlan, ShardingType, TablePlacement
from tests.dist import RankError, expect_errors_on_all_ranks, run_on_ranks
from tests.modular.collectives import no_collectives
from tests.modular.compare import close
from tests.modular.ebc_cases import (
    BATCH, global_batch, make_batch, make_ebc, placements_for, plan_for, rank_batches, unweighted_tables,
)

TIMEOUT_S = 60

# -- plans -----------------------------------------------------------------------------------------


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ebc = make_ebc(False)
        self.dense = nn.Linear(3, 2)


def _bad_plan(problem: str) -> None:
    world = dist.get_world_size()
    model = _Model()
    good = placements_for("mixed", model.ebc, world)
    tw = TablePlacement(ShardingType.TABLE_WISE, ranks=(0,))
    if problem == "missing_module":
        plan = ShardingPlan(world_size=world, modules={"tower.ebc": good})
    elif problem == "not_an_ebc":
        plan = ShardingPlan(world_size=world, modules={"ebc": good, "dense": {"t": tw}})
    elif problem == "unknown_table":
        plan = ShardingPlan(world_size=world, modules={"ebc": {**good, "t_nope": tw}})
    elif problem == "table_left_out":
        plan = ShardingPlan(world_size=world, modules={"ebc": {k: v for k, v in good.items() if k != "t_mean"}})
    elif problem == "rank_out_of_range":  # the plan itself refuses it
        plan = ShardingPlan(world_size=world, modules={"ebc": {**good, "t_small": TablePlacement(ShardingType.TABLE_WISE, ranks=(world,))}})
    elif problem == "plan_for_bigger_world":
        plan = ShardingPlan(world_size=world + 1, modules={"ebc": {**good, "t_small": TablePlacement(ShardingType.TABLE_WISE, ranks=(world,))}})
    elif problem == "sizes_do_not_sum":
        sizes = (7,) + (2,) * (world - 1)  # 't_sum' has 13 rows
        plan = ShardingPlan(world_size=world, modules={"ebc": {**good, "t_sum": TablePlacement(ShardingType.ROW_WISE, ranks=tuple(range(world)), sizes=sizes)}})
    elif problem == "column_sizes_do_not_sum":
        plan = ShardingPlan(world_size=world, modules={"ebc": {**good, "t_mean": TablePlacement(ShardingType.COLUMN_WISE, ranks=(0, 0), sizes=(3, 3))}})
    elif problem == "more_shards_than_columns":
        plan = ShardingPlan(world_size=world, modules={"ebc": {**good, "t_small": TablePlacement(ShardingType.COLUMN_WISE, ranks=(0,) * 6)}})
    elif problem == "already_sharded":
        plan = ShardingPlan(world_size=world, modules={"ebc": good})
        modular.shard(model, plan)
    elif problem == "aliased":  # two towers sharing one EBC; named_modules() lists only 'ebc'
        model.twin = model.ebc
        plan = ShardingPlan(world_size=world, modules={"twin": good})
    elif problem == "after_fully_shard":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
        plan = ShardingPlan(world_size=world, modules={"ebc": good})
    else:
        raise ValueError(problem)
    with no_collectives(allow=AGREEMENT):
        modular.shard(model, plan)


# The plan agreement: a digest all-gather, and the messages when some rank rejected the plan
# (all_gather_object runs an all_gather inside).
AGREEMENT = ("all_gather_single", "all_gather_object", "all_gather")
W = r"\d"
PLAN_ERRORS = {
    "missing_module": r"the plan names module 'tower\.ebc', which does not exist in the model; the model's EmbeddingBagCollections are \['ebc'\]",
    "not_an_ebc": r"the plan names module 'dense', which is a Linear, not an EmbeddingBagCollection",
    "unknown_table": r"the plan for module 'ebc' places tables \['t_nope'\], which the module does not have",
    "table_left_out": r"the plan for module 'ebc' has no placement for tables \['t_mean'\]",
    "rank_out_of_range": rf"table 't_small' of module 'ebc' is placed on rank ({W}) but the plan's world size is \1; use ranks in \[0, {W}\]",
    "plan_for_bigger_world": rf"the plan is for ({W}) ranks but the process group has {W}; make a plan for world_size={W}",
    "sizes_do_not_sum": r"module 'ebc': row_wise shards of 't_sum' \(13 rows\) over ranks \([0-9, ]+\) must sum to 13, got 7( \+ 2)+ = \d+",
    "column_sizes_do_not_sum": r"module 'ebc': column_wise shards of 't_mean' \(7 columns\) over ranks \(0, 0\) must sum to 7, got 3 \+ 3 = 6",
    "more_shards_than_columns": r"module 'ebc': table 't_small' has 5 columns but is column_wise over 6 ranks \(0, 0, 0, 0, 0, 0\); use at most 5 ranks",
    "already_sharded": r"module 'ebc' is already sharded; shard a model only once",
    "aliased": r"module 'twin' is one EmbeddingBagCollection registered under several names \['ebc', 'twin'\]; shard replaces the module at one name",
    "after_fully_shard": r"module 'ebc'.s tables are DTensors: fully_shard \(or apply_fully_shard\) ran on them before modular\.shard\. Call modular\.shard first",
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("problem", sorted(PLAN_ERRORS))
@pytest.mark.parametrize("world_size", [2, 3])
def test_bad_plan_raises_the_same_error_on_every_rank_before_building_tables(world_size: int, problem: str) -> None:
    messages = expect_errors_on_all_ranks(world_size, _bad_plan, problem, timeout=TIMEOUT_S)
    assert len(set(messages)) == 1, messages
    assert re.search(PLAN_ERRORS[problem], messages[0]), messages[0]
    if problem in ("rank_out_of_range", "plan_for_bigger_world"):
        assert str(world_size) in messages[0]


def _init_fn_fails_on_rank_1() -> None:
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    def init(shard: torch.Tensor) -> None:
        if dist.get_rank() == 1:
            raise ValueError("pretrained rows do not fit")
        shard.fill_(1.0)

    def ebc(name: str, init_fn) -> EmbeddingBagCollection:
        cfg = EmbeddingBagConfig(name=name, num_embeddings=8, embedding_dim=4, feature_names=[f"f_{name}"], init_fn=init_fn)
        return EmbeddingBagCollection(tables=[cfg], device=torch.device("meta"))

    model = nn.Module()
    model.a = ebc("t_a", lambda t: t.fill_(2.0))  # built first, fine everywhere
    model.b = ebc("t_b", init)
    cw = {"t_b": TablePlacement(ShardingType.COLUMN_WISE, ranks=(0, 1))}
    plan = ShardingPlan(world_size=2, modules={"a": {"t_a": TablePlacement(ShardingType.ROW_WISE, ranks=(0, 1))}, "b": cw})
    try:
        modular.shard(model, plan)
    finally:  # nothing was swapped in: 'a' was built, but the model keeps both originals
        assert type(model.a) is EmbeddingBagCollection and type(model.b) is EmbeddingBagCollection


@pytest.mark.timeout(120)
def test_init_fn_failing_on_one_rank_raises_on_every_rank_and_leaves_the_model() -> None:
    messages = expect_errors_on_all_ranks(2, _init_fn_fails_on_rank_1, timeout=TIMEOUT_S)
    own = (
        r"init_fn of table 't_b' of module 'b' failed on the whole table \(shape \(8, 4\)\): "
        r"ValueError: pretrained rows do not fit\. init_fn is called once on the whole table when"
    )
    assert re.fullmatch(own + ".*", messages[1]), messages[1]
    assert re.fullmatch(r"module 'b': rank 1 could not initialise its shards: ShardingError: " + own + r".* \(ranks \[1\] failed; this rank stops too so that no rank hangs\)", messages[0]), messages[0]


def _optimizer_built_before_shard(step_first: bool) -> None:
    world = dist.get_world_size()
    model = _Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # holds the unsharded tables
    if step_first:  # the hook's check passes and is remembered; shard must invalidate it
        model.ebc(make_batch(model.ebc, seed=dist.get_rank())).values().sum().backward()
        opt.step()
    modular.shard(model, plan_for("row_wise", model.ebc, world, module="ebc"))
    model.ebc(make_batch(model.ebc, seed=dist.get_rank())).values().sum().backward()
    opt.step()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("step_first", [False, True], ids=["new", "stepped-before-shard"])
def test_an_optimizer_built_before_shard_raises_at_its_first_step(step_first: bool) -> None:
    messages = expect_errors_on_all_ranks(2, _optimizer_built_before_shard, step_first, timeout=TIMEOUT_S)
    assert messages[0] == messages[1]
    assert messages[0].startswith(
        "SGD param group 0, parameter 0 is table 'embedding_bags.t_sum.weight' of module 'ebc', which modular.shard has since replaced: "
        "this optimizer was built before sharding"
    ), messages[0]


def _good_plan_under_no_collectives() -> None:
    model = _Model()
    with no_collectives(allow=AGREEMENT):
        modular.shard(model, ShardingPlan(world_size=dist.get_world_size(), modules={"ebc": placements_for("data_parallel", model.ebc, dist.get_world_size())}))


@pytest.mark.timeout(120)
def test_no_collectives_guard_catches_building_tables() -> None:
    # The guard the plan-error tests rely on: a good plan passes the agreement, starts building
    # its tables, and is stopped at the first other collective (the data-parallel copies' broadcast).
    messages = expect_errors_on_all_ranks(2, _good_plan_under_no_collectives, timeout=TIMEOUT_S)
    assert all(m.startswith("collective broadcast was called") for m in messages), messages


def _different_plans() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    ebc = make_ebc(False)
    placements = placements_for("row_wise", ebc, world)
    placements["t_small"] = TablePlacement(ShardingType.TABLE_WISE, ranks=(rank,))  # differs by rank
    modular.shard(ebc, ShardingPlan(world_size=world, modules={"": placements}))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_given_different_plans_all_raise(world_size: int) -> None:
    messages = expect_errors_on_all_ranks(world_size, _different_plans, timeout=TIMEOUT_S)
    assert len(set(messages)) == 1, messages
    assert messages[0].startswith("ranks disagree on the plan or on the tables of the planned modules (ranks [0] hold ")
    assert "every rank must call modular.shard with the same plan" in messages[0]
    assert messages[0].count("hold") == world_size  # each rank's plan differs


# -- batches ---------------------------------------------------------------------------------------

BAD_RANK = 1


def _jt(values: list[int], lengths: list[int], weights: list[float] | None = None) -> JaggedTensor:
    return JaggedTensor(
        values=torch.tensor(values),
        lengths=torch.tensor(lengths),
        weights=None if weights is None else torch.tensor(weights),
    )


def _corrupt(kjt: KeyedJaggedTensor, problem: str) -> KeyedJaggedTensor:
    jts = kjt.to_dict()
    if problem == "id_too_big":  # 'f_a' feeds 't_sum' (13 rows) and 't_small' (7 rows)
        jts["f_a"] = _jt([1, 7, 2], [0, 2, 1])
    elif problem == "id_negative":
        jts["f_c"] = _jt([3, -1], [1, 0, 1])
    elif problem == "missing_feature":
        del jts["f_c"]
    elif problem == "repeated_feature":  # 'f_b' named twice (extra features alone are fine)
        kjt, jt = KeyedJaggedTensor.from_jt_dict(jts), jts["f_b"]
        return KeyedJaggedTensor(
            keys=[*kjt.keys(), "f_b"],
            values=torch.cat([kjt.values(), jt.values()]),
            lengths=torch.cat([kjt.lengths(), jt.lengths()]),
        )
    elif problem == "nan_weight":
        jts["g_c"] = _jt([1, 2, 3], [1, 0, 2], [0.5, float("nan"), 1.0])
    elif problem == "inf_weight":
        jts["g_c"] = _jt([1, 2, 3], [1, 0, 2], [0.5, 1.0, float("-inf")])
    else:
        raise ValueError(problem)
    return KeyedJaggedTensor.from_jt_dict(jts)


def _bad_batch_on_one_rank(problem: str, case: str) -> str:
    """Rank BAD_RANK feeds a bad batch; returns each rank's error, then checks a good step works."""
    rank, world = dist.get_rank(), dist.get_world_size()
    weighted = problem.endswith("_weight")
    ref = make_ebc(weighted)
    ebc = modular.shard(copy.deepcopy(ref), plan_for(case, ref, world))
    batch = make_batch(ref, seed=rank)
    if rank == BAD_RANK:
        batch = _corrupt(batch, problem)
    try:
        ebc(batch)
    except modular.InputError as e:
        message = str(e)
    else:
        raise AssertionError(f"rank {rank}: the forward of a bad batch ({problem} on rank {BAD_RANK}) did not raise")
    # Nothing is left half-sent: the next good batch gives the right answer on every rank.
    batches = rank_batches(ref, world, step=1)
    close(ebc(batches[rank]).values(), ref(global_batch(batches)).values()[rank * BATCH : (rank + 1) * BATCH], f"rank {rank}: good batch after a bad one")
    return message


BATCH_ERRORS = {
    "id_too_big": (
        r"feature 'f_a' of module '' has id 7, outside table 't_sum', 't_small' \(valid ids are 0 to 6\); 1 ids are out of range",
        r"ids out of range in feature 'f_a'",
    ),
    "id_negative": (
        r"feature 'f_c' of module '' has id -1, outside table 't_mean' \(valid ids are 0 to 10\)",
        r"ids out of range in feature 'f_c'",
    ),
    "missing_feature": (
        r"the batch for module '' does not match its tables: feature 'f_c' \(table 't_mean'\) is missing\. "
        r"It reads the features \['f_a', 'f_b', 'f_c', 'f_d', 'f_e'\], each once, in any order",
        r"missing or repeated features in feature 'f_c'",
    ),
    "repeated_feature": (
        r"the batch for module '' does not match its tables: feature 'f_b' appears 2 times in the keys "
        r"\['f_a', 'f_b', 'f_c', 'f_d', 'f_e', 'f_b'\]",
        r"missing or repeated features in feature 'f_b'",
    ),
    "nan_weight": (
        r"feature 'g_c' \(table 'w_y'\) of module '' has a non-finite per-sample weight \(nan\); 1 weights are NaN or inf",
        r"bad per-sample weights in feature 'g_c'",
    ),
    "inf_weight": (
        r"feature 'g_c' \(table 'w_y'\) of module '' has a non-finite per-sample weight \(-inf\)",
        r"bad per-sample weights in feature 'g_c'",
    ),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("problem", sorted(BATCH_ERRORS))
@pytest.mark.parametrize("world_size", [2, 3])
def test_bad_batch_on_one_rank_raises_there_and_on_its_peers(world_size: int, problem: str) -> None:
    messages = run_on_ranks(world_size, _bad_batch_on_one_rank, problem, "mixed", timeout=TIMEOUT_S)
    own, peer = BATCH_ERRORS[problem]
    assert re.search(own, messages[BAD_RANK]), messages[BAD_RANK]
    for rank, message in enumerate(messages):
        if rank != BAD_RANK:
            assert message.startswith(f"rank {BAD_RANK} rejected its batch for module '' ("), message
            assert re.search(peer, message), message
            assert f"See rank {BAD_RANK}'s error for the details" in message


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["data_parallel", "table_wise"])
def test_bad_ids_are_caught_whatever_the_placement(case: str) -> None:
    # Data-parallel tables are looked up locally; table-wise ones on one rank only.
    messages = run_on_ranks(3, _bad_batch_on_one_rank, "id_too_big", case, timeout=TIMEOUT_S)
    assert re.search(BATCH_ERRORS["id_too_big"][0], messages[BAD_RANK]), messages
    assert all(m.startswith(f"rank {BAD_RANK} rejected its batch") for r, m in enumerate(messages) if r != BAD_RANK), messages


def _different_batch_sizes() -> list[int]:
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = make_ebc(False)
    ebc = modular.shard(copy.deepcopy(ref), plan_for("mixed", ref, world))
    return list(ebc(make_batch(ref, seed=rank, batch_size=2 + rank)).values().shape)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_different_batch_sizes_are_each_ranks_own(world_size: int) -> None:
    # Once refused ("needs the same batch size on every rank"); now each rank's output has its own
    # batch's rows (parity: tests/modular/test_batch_per_rank.py, Note [a batch size per rank]).
    shapes = run_on_ranks(world_size, _different_batch_sizes, timeout=TIMEOUT_S)
    assert shapes == [[2 + r, 34] for r in range(world_size)]


def _missing_weights() -> None:
    ref = make_ebc(True)
    ebc = modular.shard(copy.deepcopy(ref), plan_for("mixed", ref, dist.get_world_size()))
    batch = make_batch(ref, seed=0)
    if dist.get_rank() == 0:
        batch = KeyedJaggedTensor(keys=batch.keys(), values=batch.values(), lengths=batch.lengths())
    ebc(batch)


@pytest.mark.timeout(120)
def test_weighted_ebc_without_weights_raises_on_every_rank() -> None:
    with pytest.raises(RankError) as info:
        run_on_ranks(2, _missing_weights, timeout=TIMEOUT_S)
    errors = info.value.errors
    assert sorted(errors) == [0, 1]
    assert errors[0].message == "module '' is weighted (is_weighted=True) but the batch has no per-sample weights"
    assert errors[1].message.startswith("rank 0 rejected its batch for module '' (bad per-sample weights)")


# -- materialised tables that differ between ranks (Note [weights that differ between ranks]) ----


def _shard_with_weights(how: str) -> list[str]:
    """Shards a mixed plan (t_small data-parallel) over EBCs built per `how`; the warnings."""
    import warnings

    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    rank, world = dist.get_rank(), dist.get_world_size()
    if how == "meta_on_rank_1":
        tables = unweighted_tables()
        for cfg in tables:
            cfg.init_fn = torch.nn.init.ones_
        ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta" if rank == 1 else "cpu"))
        if rank == 0:
            for name in ("t_sum", "t_mean", "t_small"):  # only t_big, all-ones, matches init_fn
                ebc.embedding_bags[name].weight.data.fill_(1.0)
            ebc.embedding_bags["t_big"].weight.data.fill_(1.0)
    else:
        seed = {"seeded_alike": 0, "seeded_by_rank": rank, "one_row_differs": 0}[how]
        ebc = make_ebc(False, seed=seed)
        if how == "one_row_differs" and rank == 1:  # the last row: always among those compared
            ebc.embedding_bags["t_big"].weight.data[-1, 0] += 1.0
    placements = placements_for("mixed", ebc, world)
    placements["t_small"] = TablePlacement(ShardingType.DATA_PARALLEL)  # data-parallel: broadcast
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        modular.shard(ebc, ShardingPlan(world_size=world, modules={"": placements}))
    return [str(w.message) for w in caught if "differ" in str(w.message) or "meta device" in str(w.message)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "how, named",
    [
        ("seeded_alike", None),
        ("seeded_by_rank", ["t_sum", "t_mean", "t_big"]),
        ("one_row_differs", ["t_big"]),
        ("meta_on_rank_1", None),
    ],
)
def test_tables_copied_from_copies_that_differ_warn_on_every_rank(how: str, named) -> None:
    out = run_on_ranks(2, _shard_with_weights, how, timeout=TIMEOUT_S)
    assert out[0] == out[1], out
    if how == "meta_on_rank_1":
        (message,) = out[0]
        for name in ("t_sum", "t_mean", "t_big"):
            assert f"table {name!r} is on the meta device on ranks [1] (their shards run init_fn) and materialised on ranks [0]" in message, message
        assert "t_small" not in message
        return
    if named is None:
        assert out[0] == [], out
        return
    (message,) = out[0]
    assert message.startswith("modular.shard of module '': table "), message
    for name in ("t_sum", "t_mean", "t_small", "t_big"):
        said = f"table {name!r} holds different weights on ranks [0] and [1]" in message
        assert said == (name in named), (name, message)
    assert "Seed every rank alike before building the model" in message


# -- tables sharding cannot take (one process: no collective involved) -------------------------


@pytest.mark.parametrize(
    "change, weighted, message",
    [
        ({"data_type": "INT8"}, False, r"table 't' of module 'm' has data type INT8; sharding takes FP32, FP16, BF16 tables"),
        ({"pooling": "MEAN"}, True, r"table 't' of module 'm' has MEAN pooling in a weighted EmbeddingBagCollection; .*use PoolingType\.SUM"),
    ],
)
def test_tables_that_cannot_be_sharded_are_named(change: dict, weighted: bool, message: str) -> None:
    from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from modular.errors import ShardingError
    from modular.tables.weights import table_infos

    kwargs = {"data_type": DataType[change["data_type"]]} if "data_type" in change else {"pooling": PoolingType[change["pooling"]]}
    cfg = EmbeddingBagConfig(name="t", num_embeddings=4, embedding_dim=4, feature_names=["f"], **kwargs)
    ebc = EmbeddingBagCollection(tables=[cfg], is_weighted=weighted, device=torch.device("meta"))
    with pytest.raises(ShardingError, match=message):
        table_infos(ebc, "m")
    # the same table is fine as SUM / FP32, weighted or not
    ok = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t", num_embeddings=4, embedding_dim=4, feature_names=["f"])], is_weighted=weighted, device=torch.device("meta"))
    assert [t.name for t in table_infos(ok, "m")] == ["t"]
