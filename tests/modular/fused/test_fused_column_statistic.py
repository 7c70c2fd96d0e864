"""Row-wise Adagrad with `column_wise_statistic="per_shard"`: each column piece keeps the row
statistic of its own columns (TorchRec's approximation), against a reference that trains each
piece as a table of its own (`FusedReference` in tests/modular/fused_reference.py, with `pieces`). The
default stays exact (test_fused.py); checkpoints of this mode: test_checkpoint.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor

import modular
from modular.checkpoint._entries import like_sharded
from planners.types import ShardingPlan, ShardingType, TablePlacement
from tests.dist import run_on_ranks
from tests.modular.compare import local_blocks
from tests.modular.ebc_cases import make_batch, placements_for
from tests.modular.fused_reference import fused_ebc
from tests.modular.fused.test_fused import EPS, LR, STEPS, _meta_order, _same, _train

CW, TW = ShardingType.COLUMN_WISE, ShardingType.TABLE_WISE


def _pieces() -> dict[str, TablePlacement]:
    """Column pieces in each kernel of Note [fused tables], on 2 ranks."""
    return {
        "t_sum": TablePlacement(CW, ranks=(0, 1)),  # 4/4: fbgemm's kernel; read by f_a and f_b
        "t_mean": TablePlacement(CW, ranks=(1, 0), sizes=(4, 3)),  # fbgemm / the torch emulation
        "t_small": TablePlacement(TW, ranks=(0,)),
        "t_big": TablePlacement(CW, ranks=(1, 1, 0), sizes=(4, 4, 8)),  # two pieces on rank 1
    }


def _train_per_shard() -> dict[str, tuple[dict, dict]]:
    out = {}
    for weight_decay in (0.0, 0.05):
        kernels: dict = {}
        shapes: dict = {}
        _train("", "exact_rowwise_adagrad", weight_decay, placements=_pieces(),
               statistic="per_shard", kernels=kernels, shapes=shapes)  # fmt: skip
        out[f"weight_decay={weight_decay}"] = (kernels, shapes)
    return out


@pytest.mark.timeout(120)
def test_per_shard_column_pieces_train_like_tables_of_their_own() -> None:
    # `_train` compares outputs, weights and state with the reference at every step (atol 1e-5);
    # fused before `shard` (each piece starts from the unsharded table's zero statistic), and
    # with weight decay (every table on the torch emulation on CPU).
    results = run_on_ranks(2, _train_per_shard, timeout=100)
    for rank, runs in enumerate(results):
        for run, (kernels, shapes) in runs.items():
            assert shapes == {
                "embedding_bags.t_sum.weight": (13, 2),
                "embedding_bags.t_mean.weight": (11, 2),
                "embedding_bags.t_small.weight": (7,),
                "embedding_bags.t_big.weight": (29, 3),
            }, (rank, run, shapes)
            assert "RowStatsFusedKernel" not in kernels.values(), (rank, run, kernels)
    # One plain fused pass, as for whole tables; widths 3 and 5 take the emulation.
    plain = "weight_decay=0.0"
    assert results[0][plain][0] == {"t_sum": "FusedKernel", "t_mean": "EmulatedFusedKernel",
                                    "t_small": "EmulatedFusedKernel", "t_big": "FusedKernel"}  # fmt: skip
    assert results[1][plain][0] == {"t_sum": "FusedKernel", "t_mean": "FusedKernel", "t_big": "FusedKernel"}


def _run(placements: dict, statistic: str) -> tuple[list, dict]:
    """Trains the fused model STEPS steps; this rank's kernel classes, weights and states."""
    ebc = fused_ebc()
    opt = modular.fuse_optimizer(ebc, "exact_rowwise_adagrad", lr=LR, eps=EPS, column_wise_statistic=statistic)
    model = modular.shard(ebc, ShardingPlan(world_size=dist.get_world_size(), modules={"": placements}))
    for step in range(STEPS):
        model(make_batch(ebc, seed=100 * step + dist.get_rank())).values().square().sum().backward()
        opt.step()
    kernels = [(type(k).__name__, k.group.shards) for k in (*model._kernels, *model._local_kernels)]
    out = {n: t.clone() for n, p in model.named_parameters() for t, _, _ in local_blocks(p)}
    for fqn, states in opt.state_dict()["state"].items():
        row_sum = states["row_sum"]
        out[f"{fqn} state shape"] = tuple(row_sum.size())
        if not isinstance(row_sum, ShardedTensor):  # a data-parallel copy's
            out[f"{fqn} state"] = row_sum.clone()
            continue
        for s in row_sum.local_shards():
            out[f"{fqn} state {s.metadata.shard_offsets}"] = s.tensor.clone()
    return kernels, out


def _exact_and_per_shard_off_column_pieces() -> list[str]:
    world = dist.get_world_size()
    names = [c.name for c in fused_ebc().embedding_bag_configs()]
    plans = {case: placements_for(case, fused_ebc(), world) for case in ("table_wise", "row_wise", "table_row_wise", "data_parallel")}
    plans["one column piece"] = {n: TablePlacement(CW, ranks=(i % world,)) for i, n in enumerate(names)}
    differences = []
    for case, placements in plans.items():
        exact, per_shard = _run(placements, "exact"), _run(placements, "per_shard")
        if exact[0] != per_shard[0]:
            differences.append(f"{case}: kernels {exact[0]} != {per_shard[0]}")
        if exact[1].keys() != per_shard[1].keys():
            differences.append(f"{case}: keys {sorted(exact[1])} != {sorted(per_shard[1])}")
            continue
        differences += [f"{case}: {k}" for k in exact[1] if not _same(exact[1][k], per_shard[1][k])]
    return differences


@pytest.mark.timeout(120)
def test_per_shard_equals_exact_on_tables_not_cut_into_column_pieces() -> None:
    # Bit for bit: the same kernels, weights and state layout (one value per row).
    for differences in run_on_ranks(2, _exact_and_per_shard_off_column_pieces, timeout=100):
        assert differences == []


@pytest.mark.timeout(120)
def test_per_shard_survives_fusing_a_meta_ebc_before_shard() -> None:
    # The mixed plan cuts t_mean (7 wide) into 4 + 3 columns over the two ranks.
    a = run_on_ranks(2, _meta_order, "meta", "per_shard", timeout=100)
    b = run_on_ranks(2, _meta_order, "materialised", "per_shard", timeout=100)
    for rank, (x, y) in enumerate(zip(a, b)):
        assert x["embedding_bags.t_mean.weight/state shape"] == (11, 2), x
        assert "RowStatsFusedKernel" not in x.values() and "FusedKernel" in x.values(), x
        assert x.keys() == y.keys()
        for name in x:
            assert _same(x[name], y[name]), f"rank {rank} {name}"


def _cloned(sd: dict) -> dict:
    state = {}
    for fqn, states in sd["state"].items():
        v = states["row_sum"]
        tensors = [s.tensor.clone() for s in v.local_shards()]
        state[fqn] = {"row_sum": like_sharded(v, tensors) if isinstance(v, ShardedTensor) else v.clone()}
    return {"state": state, "param_groups": sd["param_groups"]}


def _local(sd: dict) -> dict[str, list[torch.Tensor]]:
    return {fqn: [s.tensor.clone() for s in v["row_sum"].local_shards()] for fqn, v in sd["state"].items()}


def _equal(a: dict[str, list[torch.Tensor]], b: dict[str, list[torch.Tensor]]) -> bool:
    return a.keys() == b.keys() and all(
        len(a[k]) == len(b[k]) and all(torch.equal(x, y) for x, y in zip(a[k], b[k])) for k in a
    )


def _state_dict_round_trip_and_the_other_statistic() -> dict[str, str]:
    rank = dist.get_rank()
    plan = ShardingPlan(world_size=dist.get_world_size(), modules={"": _pieces()})
    models = {}
    for statistic in ("exact", "per_shard"):
        ebc = fused_ebc()
        opt = modular.fuse_optimizer(ebc, "exact_rowwise_adagrad", lr=LR, column_wise_statistic=statistic)
        model = modular.shard(ebc, plan)
        model(make_batch(ebc, seed=rank)).values().sum().backward()
        models[statistic] = (ebc, model, opt)
    ebc, model, opt = models["per_shard"]
    saved = _cloned(opt.state_dict())
    model(make_batch(ebc, seed=10 + rank)).values().sum().backward()
    assert not _equal(_local(saved), _local(opt.state_dict())), "a step must move the state"
    opt.load_state_dict(saved)
    assert _equal(_local(saved), _local(opt.state_dict()))
    messages = {}
    for source, target in (("per_shard", "exact"), ("exact", "per_shard")):
        before = _local(models[target][2].state_dict())
        with pytest.raises(ValueError) as info:
            models[target][2].load_state_dict(models[source][2].state_dict())
        assert _equal(before, _local(models[target][2].state_dict())), "a refused load changed it"
        messages[f"{source} -> {target}"] = str(info.value)
    return messages


@pytest.mark.timeout(120)
def test_per_shard_state_dict_round_trip_and_refusing_the_other_statistic() -> None:
    for messages in run_on_ranks(2, _state_dict_round_trip_and_the_other_statistic, timeout=100):
        into_exact, into_per_shard = messages["per_shard -> exact"], messages["exact -> per_shard"]
        # t_sum is the first table cut into column pieces: the first refused.
        assert "optimizer state 'row_sum' of table 't_sum' has shape (13, 2)" in into_exact, into_exact
        assert "but this optimizer keeps (13,)" in into_exact, into_exact
        assert "fuse with column_wise_statistic='per_shard' and shard the table into 2 column pieces" in into_exact, into_exact
        assert "optimizer state 'row_sum' of table 't_sum' has shape (13,)" in into_per_shard, into_per_shard
        assert "fuse with column_wise_statistic='exact', or shard the table without cutting" in into_per_shard, into_per_shard


def test_per_shard_is_refused_for_optimizers_without_a_row_statistic() -> None:
    for kind in ("exact_sgd", "exact_adagrad"):
        with pytest.raises(ValueError, match=f"fused {kind}: column_wise_statistic='per_shard' applies to exact_rowwise_adagrad only"):
            modular.fuse_optimizer(fused_ebc(), kind, lr=0.1, column_wise_statistic="per_shard")
    with pytest.raises(ValueError, match="unknown column_wise_statistic 'per_piece'; expected one of: exact, per_shard"):
        modular.fuse_optimizer(fused_ebc(), "exact_rowwise_adagrad", lr=0.1, column_wise_statistic="per_piece")
