"""Checkpoints of 2D-sharded models (issue 36): a model trained and saved at 2x2 (mesh dims
("replicate", "shard"), 4 gloo ranks) loads into 1D at 2 and 3 ranks and into 2D at 6 ranks (3x2
and 2x3), bit for bit, its fused optimizer's state and the dense part's Adam state included, its
DTensor tables into either form;
`export` gives the same one-process state dict from every layout (and from either replica
group's rank); only replica group 0 writes table data (Note [one replica group writes] in
modular/checkpoint/_one_writer.py), which a "periodic" model whose replicas differ shows.
The 2x2 body also checks that `reshard` refuses a plan for the world size rather than the shard
group's on every rank (tests/modular/resharding/test_reshard_2d.py reshards 2D models), and that the replica
axis' own collectives (the init broadcast, sync_replicas' flag) raise CollectiveError.

Few, tiny cases: 4 and 6 gloo ranks on 2 cores are slow, so each world size runs one body that
loops over its layouts. Snapshots are assembled here (`assemble` in checkpoint_cases.py), where
overlapping pieces, the replicas among them, must agree exactly.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import modular
from modular.checkpoint._directory import read_metadata
from modular.checkpoint._entries import optimizer_state
from modular.tables.forms import is_sharded, local_pieces
from planners.types import ShardingPlan
from tests.dist import run_on_ranks
from tests.modular import checkpoint_cases as H

DIMS = ("replicate", "shard")
TIMEOUT = 300.0
# world -> (mesh shape or None for 1D, plan kind, table form): where the 2x2 checkpoint (of
# DTensor tables) is loaded, into both forms (Note [table tensor types]).
LOADS = {
    2: [(None, "B", "sharded_tensor")],
    3: [(None, "C", "dtensor")],
    6: [((3, 2), "B", "dtensor"), ((2, 3), "A", "sharded_tensor")],
}
TABLE_KEYS = ("model.ebc.embedding_bags.", "optim.tables.state.ebc.embedding_bags.")


def _model(
    seed: int, kind: str, shape: Optional[tuple[int, int]], sync: str = "exact", form: str = "sharded_tensor"
) -> tuple[Any, Any]:
    """The checkpoint model, its tables fused (row-wise Adagrad) and sharded by plan `kind` over
    a mesh of `shape` (1D over every rank when None) as `form`, the dense layer under Adam."""
    model = H.build_checkpoint_model(seed)
    fused = modular.fuse_optimizer(model, "exact_rowwise_adagrad", lr=0.1)
    group = dist.get_world_size() if shape is None else shape[1]
    plan = ShardingPlan(world_size=group, modules={"ebc": H.checkpoint_placements(kind, group)})
    if shape is None:
        modular.shard(model, plan, tensor_type=form)
    else:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=DIMS)
        modular.shard(model, plan, mesh=mesh, replica_sync=sync, tensor_type=form)
    dense = torch.optim.Adam(modular.local_parameters(model), lr=0.01)
    return model, modular.CombinedOptimizer({"tables": fused, "dense": dense})


def _snapshot(model: Any, optimizer: Any) -> dict[str, Any]:
    """H.local_snapshot for either table form: each entry's local pieces and global shape."""
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    state.update(optimizer_state(model, optimizer))
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    pieces = {
        k: [(p.offsets, p.tensor.detach().clone()) for p in local_pieces(v)] if is_sharded(v)
        else [((0,) * v.dim(), v.detach().clone())]
        for k, v in tensors.items()
    }  # fmt: skip
    shapes = {k: tuple(v.size()) for k, v in tensors.items()}
    return {"outputs": H.eval_outputs(model), "pieces": pieces, "shapes": shapes}


def _exports(model: Any) -> dict[int, Optional[dict]]:
    """`export` to rank 0 and to the last rank (another replica group's, in 2D)."""
    last = dist.get_world_size() - 1
    return {dst: modular.checkpoint.export(model, rank=dst) for dst in (0, last)}


def _collective_error(call, what: str) -> str:
    try:
        call()
    except modular.CollectiveError as e:
        return str(e)
    raise AssertionError(f"rank {dist.get_rank()}: {what} did not raise CollectiveError")


def _save_2x2(path: str, periodic_path: str) -> dict[str, Any]:
    rank = dist.get_rank()
    model, opt = _model(0, "A", (2, 2), form="dtensor")
    tables = [v for v in model.state_dict().values() if is_sharded(v)]
    assert tables and all(isinstance(v, DTensor) for v in tables)
    H.train_checkpoint_model(model, opt, range(2))
    modular.checkpoint.save(path, model, opt)
    out: dict[str, Any] = {"snapshot": _snapshot(model, opt), "exports": _exports(model)}

    # A plan for the world (4) instead of the shard group (2): refused on every rank, the model
    # left as it was.
    before = _snapshot(model, opt)
    old = model.ebc
    plan = ShardingPlan(world_size=4, modules={"ebc": H.checkpoint_placements("B", 4)})
    with pytest.raises(modular.ShardingError) as refused:
        modular.reshard(model, plan)
    assert model.ebc is old
    H.assert_unchanged(before, _snapshot(model, opt), f"rank {rank} after the refused reshard")
    out["reshard"] = str(refused.value)

    # A dead peer in the replica axis' collectives raises CollectiveError naming the collective
    # (injected on every rank, so that none is left waiting in the real collective).
    closed = RuntimeError("injected: connection closed by peer")
    # Both go through modular.comm (Note [collectives release their tensors]), whose `dist` is
    # broken inside the one call under test.
    comm = sys.modules["modular.comm"]
    for name, module_name, call in (
        ("all_reduce", "modular.replica_sync", lambda: modular.sync_replicas(model)),
        ("broadcast", "modular.tables.replicas", lambda: _model(0, "A", (2, 2))),
    ):
        def dead(*args, _name=name, **kwargs):
            with mock.patch.object(comm.dist, _name, side_effect=closed):
                return getattr(comm, _name)(*args, **kwargs)

        with mock.patch.object(sys.modules[module_name], name, dead):
            out[f"dead {name}"] = _collective_error(call, f"a failed {name}")
    modular.sync_replicas(model)  # the exact replicas still agree

    # "periodic": each replica group trains on its own batches, so the copies differ; the
    # checkpoint holds replica group 0's, whole.
    periodic, periodic_opt = _model(0, "A", (2, 2), sync="periodic")
    H.train_checkpoint_model(periodic, periodic_opt, range(1))
    modular.checkpoint.save(periodic_path, periodic, periodic_opt)
    out["periodic"] = H.local_snapshot(periodic, periodic_opt)
    return out


def _load(path: str, periodic_path: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for shape, kind, form in LOADS[dist.get_world_size()]:
        model, opt = _model(1, kind, shape, form=form)  # other weights than the saved ones, until loaded
        modular.checkpoint.load(path, model, opt)
        if shape is not None:
            modular.sync_replicas(model)  # every replica group loaded the same: checked
        out[shape] = {"snapshot": _snapshot(model, opt), "exports": _exports(model)}
        if shape is None and dist.get_world_size() == 2:
            model, opt = _model(1, kind, None)
            modular.checkpoint.load(periodic_path, model, opt)
            out["periodic"] = H.local_snapshot(model, opt)
    return out


def _writers(path: str) -> dict[str, set[int]]:
    """The ranks whose files hold each table entry's chunks (DCP names files `__<rank>_<n>`)."""
    metadata = read_metadata(Path(path))
    writers: dict[str, set[int]] = {}
    for index, info in metadata.storage_data.items():
        if index.fqn.startswith(TABLE_KEYS):
            writers.setdefault(index.fqn, set()).add(int(info.relative_path.split("_")[2]))
    return writers


def _assert_exports(per_rank: list[dict[int, Optional[dict]]], want: dict[str, torch.Tensor], where: str) -> None:
    """Each export landed on its destination only, and is `want`, bit for bit."""
    for dst in per_rank[0]:
        for rank, exports in enumerate(per_rank):
            assert (exports[dst] is not None) == (rank == dst), f"{where}: export to {dst}, rank {rank}"
        got = per_rank[dst][dst]
        assert sorted(got) == sorted(want), f"{where}: export to rank {dst} has keys {sorted(got)}"
        for k, v in want.items():
            assert torch.equal(got[k], v), f"{where}: export to rank {dst}: {k} differs"


@pytest.mark.timeout(900)
def test_2x2_checkpoint_loads_into_1d_and_2d_bit_for_bit(tmp_path: Path) -> None:
    path, periodic_path = str(tmp_path / "ckpt"), str(tmp_path / "periodic")
    saved_ranks = run_on_ranks(4, _save_2x2, path, periodic_path, timeout=TIMEOUT)
    saved = H.assemble([r["snapshot"] for r in saved_ranks])
    assert any(k.startswith("optim.tables.state.ebc.") for k in saved)
    assert any(k.startswith("optim.dense.state.dense.") for k in saved)
    # The unsharded model's state dict, from the snapshot of the 2D model itself.
    want = {k[len("model."):]: v for k, v in saved.items() if k.startswith("model.")}
    assert sorted(want) == sorted(H.build_checkpoint_model(seed=0).state_dict())
    _assert_exports([r["exports"] for r in saved_ranks], want, "2x2")

    for r in saved_ranks:
        assert "the plan is for 4 ranks but the modules are sharded in 2D over shard groups of 2" in r["reshard"], r["reshard"]
        assert "2 replica groups of 2 ranks" in r["reshard"] and "world_size=2" in r["reshard"], r["reshard"]
        assert "diverged-replica flag failed on rank" in r["dead all_reduce"], r["dead all_reduce"]
        assert "broadcast of the first replica group's shards failed" in r["dead broadcast"], r["dead broadcast"]

    # Only replica group 0 (ranks 0 and 1 of mesh [[0, 1], [2, 3]]) writes table data.
    for p in (path, periodic_path):
        writers = _writers(p)
        assert writers and all(ranks <= {0, 1} for ranks in writers.values()), writers
    periodic_ranks = [r["periodic"] for r in saved_ranks]
    with pytest.raises(AssertionError, match="replicas of .* differ"):
        H.assemble(periodic_ranks)  # the periodic replicas did drift apart
    periodic_group0 = H.assemble(periodic_ranks[:2])
    # Its eval outputs were gathered over both replica groups' copies: not group 0's model.
    periodic_group0.pop("outputs")

    for world, layouts in LOADS.items():
        per_rank = run_on_ranks(world, _load, path, periodic_path, timeout=TIMEOUT)
        for shape, _, _ in layouts:
            where = f"2x2 -> {'x'.join(map(str, shape)) if shape else f'1D at {world}'}"
            loaded = H.assemble([r[shape]["snapshot"] for r in per_rank])
            H.assert_same(saved, loaded, where)
            _assert_exports([r[shape]["exports"] for r in per_rank], want, where)
        if world == 2:
            loaded = H.assemble([r["periodic"] for r in per_rank])
            loaded.pop("outputs")
            H.assert_same(periodic_group0, loaded, "periodic 2x2 -> 1D at 2: replica group 0's model")
