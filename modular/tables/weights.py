"""One table of a sharded EBC, as the model sees it: its `weight` under the unsharded name.

Reads a torchrec EBC's tables (`table_infos`), refuses shard widths the device cannot take
(`check_widths_off_cpu`), makes each table's weight from this rank's shards (`table_weight`: a
`ShardedTensor`, or the copy of a data-parallel table) and holds it (`ShardedTable`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import (
    Shard,
    ShardedTensor,
    init_from_local_shards,
)
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata
from torchrec.modules.embedding_configs import DataType, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from modular.errors import ShardingError
from modular.tables.config_fields import check_config_fields
from modular.tables.deprecation import quiet_sharded_tensor, quietly
from modular.tables.forms import TensorType, dtensor_from_pieces, is_sharded, local_pieces
from modular.tables.layout import Layout, Pooling, RankLayout, TableInfo, odd_width
from planners.types import ShardingType, ShardSpec

__all__ = [
    "TABLE_DTYPES",
    "ShardedTable",
    "check_widths_off_cpu",
    "frozen",
    "local_shard_metadata",
    "sharded_from_metadata",
    "table_info",
    "table_infos",
    "table_weight",
]


# The weights' dtype of each torchrec data type that sharding takes (fbgemm's TBE weights
# precision follows it: modular/kernels/table_dtypes.py).
TABLE_DTYPES = {
    DataType.FP32: torch.float32,
    DataType.FP16: torch.float16,
    DataType.BF16: torch.bfloat16,
}


def table_infos(ebc: EmbeddingBagCollection, module: str) -> tuple[TableInfo, ...]:
    """Reads the tables of a torchrec EBC, rejecting what sharding does not support."""
    infos = []
    for cfg in ebc.embedding_bag_configs():
        check_config_fields(cfg, module)  # Note [table config fields]
        if cfg.data_type not in TABLE_DTYPES:
            raise ShardingError(
                f"table {cfg.name!r} of module {module!r} has data type {cfg.data_type.name}; "
                f"sharding takes {', '.join(d.name for d in TABLE_DTYPES)} tables (quantised "
                "tables are for inference, which modular does not shard)"
            )
        if cfg.pooling not in (PoolingType.SUM, PoolingType.MEAN):
            raise ShardingError(
                f"table {cfg.name!r} of module {module!r} has pooling {cfg.pooling.name}; "
                "only SUM and MEAN are supported"
            )
        if cfg.pooling == PoolingType.MEAN and ebc.is_weighted():
            # torchrec's own forward raises on it (nn.EmbeddingBag takes per-sample weights only
            # with mode="sum"), and fbgemm's CPU TBE computes the weighted mean but leaves the
            # 1/length out of its gradient: refuse it rather than train a wrong table.
            raise ShardingError(
                f"table {cfg.name!r} of module {module!r} has MEAN pooling in a weighted "
                "EmbeddingBagCollection; per-sample weights work only with SUM pooling (torchrec's "
                "unsharded EBC refuses them too): use PoolingType.SUM or an unweighted EBC"
            )
        infos.append(table_info(cfg, Pooling.SUM if cfg.pooling == PoolingType.SUM else Pooling.MEAN))
    return tuple(infos)


def table_info(cfg, pooling: Pooling) -> TableInfo:
    """One torchrec table config (an EBC's or an EC's) as the layout sees it."""
    return TableInfo(
        name=cfg.name,
        num_embeddings=cfg.num_embeddings,
        embedding_dim=cfg.embedding_dim,
        features=tuple(cfg.feature_names),
        pooling=pooling,
        dtype=TABLE_DTYPES[cfg.data_type],
    )


def check_widths_off_cpu(layout: Layout, module: str, device: torch.device) -> None:
    """fbgemm's CUDA kernels read rows in blocks of 4 floats, so off CPU every shard must be a
    multiple of 4 columns wide. On CPU, modular runs other widths through fbgemm's CPU kernel or
    the torch emulation (Note [fused tables]); off CPU it has no kernel for them yet."""
    for table, placement, shards in zip(layout.tables, layout.placements, layout.shards):
        odd = sorted({s.num_cols for s in shards if odd_width(s.num_cols)})
        if odd:
            split_badly = placement.sharding_type is ShardingType.COLUMN_WISE and not odd_width(
                table.embedding_dim
            )
            how = (
                "choose column sizes that are multiples of 4 (TablePlacement(sizes=...); the "
                "planner's are when the dim is)"
                if split_badly
                else "give the table an embedding_dim that is a multiple of 4"
            )
            raise ShardingError(
                f"table {table.name!r} of module {module!r} has shards {odd} columns wide, which "
                f"fbgemm's kernels on {device.type} cannot take (widths must be multiples of 4); "
                f"{how}"
            )


class ShardedTable(nn.Module):
    """Holds one table's `weight` under the unsharded name (a ShardedTensor, or a data-parallel
    copy)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        # register_parameter rejects a ShardedTensor; the dict accepts it.
        self._parameters["weight"] = weight

    @property
    def weight(self) -> torch.Tensor:
        return self._parameters["weight"]

    @quietly  # Note [ShardedTensor warnings]
    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)

    @quietly
    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ) -> None:
        """`load_state_dict` for one table: a full (unsharded) tensor is sliced into this rank's
        shards; a ShardedTensor must have the same shards (another plan's goes through
        `modular.checkpoint.load`, which reshards); anything else is an error naming the table."""
        key = prefix + "weight"
        if key not in state_dict:
            if strict:
                missing_keys.append(key)
            return
        value, weight = state_dict[key], self._parameters["weight"]
        if tuple(value.size()) != tuple(weight.size()):
            error_msgs.append(
                f"table weight {key!r}: the state holds shape {tuple(value.size())}, the model "
                f"{tuple(weight.size())}"
            )
            return
        with torch.no_grad():
            if not is_sharded(weight):
                if is_sharded(value):
                    error_msgs.append(
                        f"table weight {key!r} is data-parallel here but sharded in the state; "
                        "load it with modular.checkpoint.load, which reshards"
                    )
                    return
                weight.copy_(value)
                return
            if not is_sharded(value):  # a full table: keep this rank's slices
                for (r0, c0), (nr, nc), tensor in local_pieces(weight):
                    tensor.copy_(value[r0 : r0 + nr, c0 : c0 + nc])
                return
            theirs = {(p.offsets, p.sizes): p.tensor for p in local_pieces(value)}
            for offsets, sizes, tensor in local_pieces(weight):
                if (offsets, sizes) not in theirs:
                    error_msgs.append(
                        f"table weight {key!r}: the state was sharded under another plan (no "
                        f"shard at offsets {list(offsets)} with sizes {list(sizes)} on this "
                        "rank); load it with modular.checkpoint.load, which reshards"
                    )
                    return
                tensor.copy_(theirs[(offsets, sizes)])

    def extra_repr(self) -> str:
        w = self._parameters["weight"]
        kind = "sharded" if is_sharded(w) else "data-parallel"
        return f"{kind}, size={tuple(w.size())}"


def table_weight(
    t: int,
    views: dict[tuple[str, int], torch.Tensor],
    *,
    at: RankLayout,
    global_rank: int,
    tensor_type: TensorType = TensorType.SHARDED_TENSOR,
) -> torch.Tensor:
    """Table `t`'s weight from this rank's shards: a ShardedTensor made with
    `init_from_local_shards` (a collective, in table order on every rank) or a DTensor (none;
    Note [table tensor types] in modular/tables/forms.py), or the copy of a data-parallel
    table."""
    layout = at.layout
    table = layout.tables[t]
    sharding = layout.placements[t].sharding_type
    if sharding is ShardingType.DATA_PARALLEL:
        return views[(table.name, at.shard_of_rank(t))]
    if tensor_type is TensorType.DTENSOR:
        mine = [
            ((spec.row_offset, spec.col_offset), views[(table.name, j)])
            for j, spec in enumerate(layout.shards[t])
            if spec.rank == at.rank
        ]
        return dtensor_from_pieces(
            mine, (table.num_embeddings, table.embedding_dim), group=at.group,
            device=at.device, column_wise=sharding is ShardingType.COLUMN_WISE,
            replicas=at.replicas,
        )  # fmt: skip
    local = []
    for j, spec in enumerate(layout.shards[t]):
        if spec.rank != at.rank:
            continue
        meta = ShardMetadata(
            shard_offsets=[spec.row_offset, spec.col_offset],
            shard_sizes=[spec.num_rows, spec.num_cols],
            # the shard's own device: a tiered shard on a GPU rank lives in host memory
            placement=f"rank:{global_rank}/{views[(table.name, j)].device}",
        )
        local.append(Shard(tensor=views[(table.name, j)], metadata=meta))
    with quiet_sharded_tensor():
        return init_from_local_shards(
            local, table.num_embeddings, table.embedding_dim, process_group=at.group
        )


def frozen(metadata: ShardedTensorMetadata) -> ShardedTensorMetadata:
    """The same layout for tensors that take no gradient (fused weights, optimizer state)."""
    props = dataclasses.replace(metadata.tensor_properties, requires_grad=False)
    return dataclasses.replace(metadata, tensor_properties=props)


def sharded_from_metadata(
    local: list[Shard], metadata: ShardedTensorMetadata, group: Optional[ProcessGroup]
) -> ShardedTensor:
    """A ShardedTensor from known global metadata (no collective: the plan is already agreed)."""
    with quiet_sharded_tensor():
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            local, metadata, process_group=group
        )


def local_shard_metadata(
    shards: tuple[ShardSpec, ...], rank: int, weight: ShardedTensor
) -> list[tuple[int, ShardMetadata]]:
    """(shard index in the plan, its metadata in `weight`) of each shard `rank` holds."""
    out = []
    for j, spec in enumerate(shards):
        if spec.rank == rank:
            for shard in weight.local_shards():
                if list(shard.metadata.shard_offsets) == [spec.row_offset, spec.col_offset]:
                    out.append((j, shard.metadata))
    return out
