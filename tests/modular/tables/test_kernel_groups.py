"""Kernel groups (modular/tables/layout.py `kernel_groups`): one per pooling mode and width class, so a
shard width fbgemm's fused kernels cannot take (not a multiple of 4) is emulated alone, not with
every table of its pooling mode. Pure: one process."""

from __future__ import annotations

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection

import modular
from modular.optim import fuse_now
from modular.fused.emulated import EmulatedFusedKernel
from modular.fused.fbgemm import FusedKernel
from modular.tables.layout import Layout, Pooling, TableInfo, build_layout
from modular.errors import ShardingError
from modular.tables.weights import check_widths_off_cpu
from planners.types import ShardingType, TablePlacement
from tests.modular.compare import close
from tests.modular.ebc_cases import make_batch


def _ebc(dims: dict[str, tuple[int, PoolingType]]) -> EmbeddingBagCollection:
    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(name=n, num_embeddings=11, embedding_dim=d, feature_names=[f"f_{n}"], pooling=p)
        for n, (d, p) in dims.items()
    ]  # fmt: skip
    return EmbeddingBagCollection(tables=tables)


def _kernels(model) -> list[tuple[str, tuple[str, ...]]]:
    return [
        (type(k).__name__, tuple(t for t, _ in k.group.shards))
        for k in (*model._kernels, *model._local_kernels)
    ]


def test_an_odd_width_is_emulated_alone() -> None:
    S, M = PoolingType.SUM, PoolingType.MEAN
    ebc = _ebc({"a": (8, S), "odd": (7, S), "b": (16, S), "c": (12, M)})
    ref = EmbeddingBagCollection(tables=ebc.embedding_bag_configs())
    ref.load_state_dict(ebc.state_dict())
    modular.fuse_optimizer(ebc, "exact_sgd", lr=0.5)
    fuse_now(ebc, "")  # what its first use would do (Note [fusing at shard])
    assert _kernels(ebc) == [
        ("FusedKernel", ("a", "b")),
        ("EmulatedFusedKernel", ("odd",)),
        ("FusedKernel", ("c",)),
    ]
    assert all(isinstance(k, (FusedKernel, EmulatedFusedKernel)) for k in ebc._local_kernels)
    # The split changes nothing a user sees: outputs and one SGD step match the plain EBC.
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(2):
        kjt = make_batch(ref, seed=step)
        out, want = ebc(kjt).values(), ref(kjt).values()
        close(out, want, f"step {step} output")
        out.sum().backward()
        want.sum().backward()
        opt.step()
        opt.zero_grad()


def test_widths_fbgemm_takes_stay_in_one_group() -> None:
    ebc = _ebc({"a": (8, PoolingType.SUM), "b": (4, PoolingType.SUM), "c": (16, PoolingType.SUM)})
    modular.fuse_optimizer(ebc, "exact_sgd", lr=0.5)
    fuse_now(ebc, "")  # what its first use would do (Note [fusing at shard])
    assert _kernels(ebc) == [("FusedKernel", ("a", "b", "c"))]


def _layout(dim: int, placement: TablePlacement) -> Layout:
    tables = (TableInfo("t", 10, dim, ("f",), Pooling.SUM),)
    shards = (placement.shards(num_embeddings=10, embedding_dim=dim, world_size=2, table="t"),)
    return build_layout(tables, (placement,), shards, world_size=2, rank=0)


def test_widths_fbgemm_cannot_take_are_refused_off_cpu() -> None:
    # fbgemm's CUDA kernels read rows in blocks of 4 floats; on CPU modular emulates other widths.
    cuda = torch.device("cuda")  # a device object needs no GPU
    with pytest.raises(ShardingError, match=r"table 't' of module 'm' has shards \[7\] columns wide.*embedding_dim that is a multiple of 4"):
        check_widths_off_cpu(_layout(7, TablePlacement(ShardingType.TABLE_WISE, ranks=(1,))), "m", cuda)
    cw = TablePlacement(ShardingType.COLUMN_WISE, ranks=(0, 1), sizes=(6, 10))
    with pytest.raises(ShardingError, match=r"shards \[6, 10\] columns wide.*column sizes that are multiples of 4"):
        check_widths_off_cpu(_layout(16, cw), "m", cuda)
    check_widths_off_cpu(_layout(16, TablePlacement(ShardingType.COLUMN_WISE, ranks=(0, 1))), "m", cuda)
