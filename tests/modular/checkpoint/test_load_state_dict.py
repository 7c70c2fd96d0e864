"""`model.load_state_dict` on a sharded model: full tables are sliced, same-plan shards copied,
and anything that would need resharding is refused with the table's name and the fix."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

import modular
from tests.dist import expect_errors_on_all_ranks, run_on_ranks
from tests.modular.compare import close, gather_table
from tests.modular.ebc_cases import global_batch, make_batch, make_ebc, plan_for


def _full_state_into_sharded(case: str) -> int:
    world, rank = dist.get_world_size(), dist.get_rank()
    source = make_ebc(False, seed=5)
    model = modular.shard(make_ebc(False, seed=6), plan_for(case, source, world))
    model.load_state_dict(source.state_dict())
    batches = [make_batch(source, seed=40 + r) for r in range(world)]
    out = model(batches[rank]).values()
    expected = source(global_batch(batches)).values()
    close(out, expected[rank * out.shape[0] : (rank + 1) * out.shape[0]], f"{case} output")
    checked = 0
    for name, p in model.named_parameters():
        full = gather_table(p, 0)
        if rank == 0:
            close(full, dict(source.named_parameters())[name].detach(), name)
            checked += 1
    return checked


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_full_state_dict_loads_into_every_plan(world: int) -> None:
    for case in ("mixed", "row_wise", "column_wise", "data_parallel"):
        assert run_on_ranks(world, _full_state_into_sharded, case, timeout=100)[0] == 4


def _same_plan_round_trip() -> bool:
    world = dist.get_world_size()
    a = modular.shard(make_ebc(False, seed=1), plan_for("mixed", make_ebc(False), world))
    b = modular.shard(make_ebc(False, seed=2), plan_for("mixed", make_ebc(False), world))
    b.load_state_dict(a.state_dict())
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        ga, gb = gather_table(pa, 0), gather_table(pb, 0)
        if dist.get_rank() == 0 and not torch.equal(ga, gb):
            raise AssertionError(f"{name} differs after load_state_dict")
    return True


@pytest.mark.timeout(120)
def test_sharded_state_dict_loads_under_the_same_plan() -> None:
    assert all(run_on_ranks(2, _same_plan_round_trip, timeout=100))


def _other_plan() -> None:
    world = dist.get_world_size()
    a = modular.shard(make_ebc(False, seed=1), plan_for("row_wise", make_ebc(False), world))
    b = modular.shard(make_ebc(False, seed=2), plan_for("column_wise", make_ebc(False), world))
    b.load_state_dict(a.state_dict())


@pytest.mark.timeout(120)
def test_state_sharded_under_another_plan_is_refused_with_the_fix() -> None:
    for message in expect_errors_on_all_ranks(2, _other_plan, timeout=100):
        assert "table weight 'embedding_bags.t_sum.weight'" in message
        assert "sharded under another plan" in message
        assert "modular.checkpoint.load" in message


def _wrong_shape() -> None:
    world = dist.get_world_size()
    model = modular.shard(make_ebc(False), plan_for("mixed", make_ebc(False), world))
    tables = [
        EmbeddingBagConfig(name=c.name, num_embeddings=c.num_embeddings + (c.name == "t_big"),
                           embedding_dim=c.embedding_dim, feature_names=c.feature_names, pooling=c.pooling)
        for c in make_ebc(False).embedding_bag_configs()
    ]
    model.load_state_dict(EmbeddingBagCollection(tables=tables).state_dict())


@pytest.mark.timeout(120)
def test_wrong_table_shape_names_the_table_and_both_shapes() -> None:
    for message in expect_errors_on_all_ranks(2, _wrong_shape, timeout=100):
        assert "table weight 'embedding_bags.t_big.weight': the state holds shape (30, 7), the model (29, 7)" in message


@pytest.mark.parametrize("kind, good_shape, bad_shape", [
    ("exact_adagrad", (9, 8), (40, 9)),
    ("exact_rowwise_adagrad", (9,), (9, 8)),
])  # fmt: skip
def test_fused_optimizer_state_of_the_wrong_shape_is_refused(kind: str, good_shape: tuple, bad_shape: tuple) -> None:
    """One process, no process group: a fused, unsharded model. It used to copy in a slice."""
    from tests.modular.checkpoint_cases import build_checkpoint_model

    opt = modular.fuse_optimizer(build_checkpoint_model(seed=0), kind, lr=0.1)
    sd = opt.state_dict()
    name = "sum" if kind == "exact_adagrad" else "row_sum"
    before = {fqn: states[name].clone() for fqn, states in sd["state"].items()}
    wrong = {fqn: {name: torch.full_like(s, 3.0)} for fqn, s in before.items()}
    wrong["ebc.embedding_bags.t2.weight"] = {name: torch.full(bad_shape, 3.0)}
    with pytest.raises(ValueError) as info:
        opt.load_state_dict({"state": wrong, "param_groups": sd["param_groups"]})
    assert (
        f"optimizer state {name!r} of table 't2' in module 'ebc' has shape {bad_shape}, but "
        f"this optimizer keeps {good_shape}"
    ) in str(info.value)
    for fqn, states in opt.state_dict()["state"].items():
        assert torch.equal(states[name], before[fqn]), f"{fqn} changed by a refused load"


def test_a_fused_state_refused_in_one_module_leaves_every_module_and_the_lr() -> None:
    """One process: two fused EBCs; the second's state is wrong, so nothing may change, not the
    first module's state (loaded first) nor the learning rate."""
    from torch import nn

    from tests.modular.ebc_cases import make_ebc

    model = nn.Module()
    model.a, model.b = make_ebc(False, seed=0), make_ebc(False, seed=1)
    opt = modular.fuse_optimizer(model, "exact_adagrad", lr=0.1)
    sd = opt.state_dict()
    before = {fqn: states["sum"].clone() for fqn, states in sd["state"].items()}
    wrong = {fqn: {"sum": torch.full_like(s, 3.0)} for fqn, s in before.items()}
    wrong["b.embedding_bags.t_big.weight"] = {"sum": torch.full((30, 7), 3.0)}
    groups = [{**sd["param_groups"][0], "lr": 0.5}]
    with pytest.raises(ValueError, match=r"table 't_big' in module 'b' has shape \(30, 7\)"):
        opt.load_state_dict({"state": wrong, "param_groups": groups})
    after = opt.state_dict()
    assert after["param_groups"][0]["lr"] == 0.1
    assert {k[0] for k in before} == {"a", "b"}
    for fqn, states in after["state"].items():
        assert torch.equal(states["sum"], before[fqn]), f"{fqn} changed by a refused load"
    good = {**wrong, "b.embedding_bags.t_big.weight": {"sum": torch.full((29, 7), 3.0)}}
    opt.load_state_dict({"state": good, "param_groups": groups})
    assert opt.state_dict()["param_groups"][0]["lr"] == 0.5  # a good load still takes both
    assert all(bool((s["sum"] == 3.0).all()) for s in opt.state_dict()["state"].values())
