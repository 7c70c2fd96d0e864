"""The two forms a sharded table's weight (and state laid out like it) can take, behind one API.

# Note [table tensor types]
`modular.shard(..., tensor_type=...)` picks how each sharded table is seen from outside:
`"sharded_tensor"` (the default, docs/design.md) a `ShardedTensor` made from this rank's shards,
or `"dtensor"` a `DTensor` over the process group's 1-D device mesh whose local tensor is a
`LocalShardsWrapper` (torch/distributed/tensor/_shards_wrapper.py) of the same shards: PyTorch's
form for unevenly sharded embedding weights, which DCP saves and loads chunk by chunk like a
ShardedTensor, with no deprecation warning. Both hold the same tensors (aliasing the kernels'
weights) under the same FQN and global shape; a checkpoint of one loads into the other because
DCP sees the same chunks. The DTensor's placements say only which dimension is cut (`Shard(1)`
for column-wise tables, `Shard(0)` otherwise; a table-wise table is `Shard(0)` too, its one
holder's shard the whole table and every other rank's an empty placeholder); the split itself is
the plan's, which DTensor's own even split cannot express, so ops that redistribute
(`full_tensor()`) raise `ShardingError` on every rank, before any collective (`_TableShards`):
use `modular.unshard` or `modular.checkpoint.export`.
In 2D (`shard(..., mesh=mesh)`, docs/design.md) the DTensor spans the whole ("replicate",
"shard") mesh with `Replicate()` on "replicate" before that placement (as TorchRec's 2D row-
and column-wise tables do): each replica group's ranks hold the same pieces, and the pieces (and
so DCP's chunks) are the 1D ones. The shard dim is the mesh's last in both (`_group`).
Data-parallel tables are plain tensors, a copy on every rank, in both forms. Code that reads
either goes through `is_sharded`, `local_pieces`, `global_pieces` and `laid_out_like` here.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import NamedTuple, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard as STShard
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

from modular.errors import ShardingError
from modular.tables.deprecation import quiet_sharded_tensor
from modular.tables.replicas import Replicas

__all__ = [
    "Piece",
    "TensorType",
    "dtensor_from_pieces",
    "dtype_of",
    "global_pieces",
    "global_size",
    "is_sharded",
    "laid_out_like",
    "local_pieces",
]


class TensorType(enum.Enum):
    """How sharded tables are seen from outside (Note [table tensor types])."""

    SHARDED_TENSOR = "sharded_tensor"
    DTENSOR = "dtensor"

    @classmethod
    def parse(cls, value: Union[str, TensorType]) -> TensorType:
        if isinstance(value, TensorType):
            return value
        try:
            return cls(value)
        except ValueError:
            choices = [t.value for t in cls]
            raise ShardingError(
                f"tensor_type={value!r} is not one of {choices}; use \"dtensor\" for DTensor "
                "tables or leave the default \"sharded_tensor\""
            ) from None


class Piece(NamedTuple):
    """One local shard of a sharded table (or of state laid out like it)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    tensor: torch.Tensor


_ALL_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default


class _TableShards(LocalShardsWrapper):
    """A LocalShardsWrapper whose `detach()` returns a new wrapper: torch 2.13's detaches in
    place, swapping its shards for detached copies, so a `state_dict()` (which detaches every
    parameter) would cut the table off from the kernels' tensors (ShardViews and their
    gradients) that the optimizer holds."""

    # Note [table tensor types]: DTensor's redistribute (`full_tensor()`) pads this rank's local
    # tensor to an even chunk and all-gathers it in mesh order, which the plan's split is not.
    # Refused at either op, before any collective: every rank reaches one of them.
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.constant_pad_nd.default, _ALL_GATHER):
            shards = zip(args[0].local_offsets(), args[0].local_shards())
            pieces = [(tuple(o), tuple(t.shape)) for o, t in shards if t.numel() > 0]
            raise ShardingError(
                "full_tensor() / redistribute of a table DTensor (this rank's pieces, offsets and "
                f"sizes: {pieces}): its shards are the plan's, not DTensor's even split, so "
                "DTensor cannot gather them. Gather tables with modular.unshard(model) or "
                "modular.checkpoint.export(model, rank=...); read this rank's pieces with "
                "modular.tables.forms.local_pieces"
            )
        return super().__torch_dispatch__(func, types, args, kwargs)

    @staticmethod
    def handle_detach(args, kwargs) -> LocalShardsWrapper:
        shards = [torch.ops.aten.detach.default(s) for s in args[0].local_shards()]
        return _TableShards(shards, args[0].local_offsets())

    # A rank without shards holds one empty placeholder (see `dtensor_from_pieces`); it offers
    # DCP no chunk, as a ShardedTensor with no local shard does: an empty chunk at offset 0
    # would be deduplicated against the real one there and lose it.
    def __create_write_items__(self, fqn: str, object: object) -> list:
        return [] if self._placeholder() else super().__create_write_items__(fqn, object)

    def __create_chunk_list__(self) -> list:
        return [] if self._placeholder() else super().__create_chunk_list__()

    def _placeholder(self) -> bool:
        return all(s.numel() == 0 for s in self.local_shards())


def is_sharded(t: object) -> bool:
    """A ShardedTensor, or a DTensor whose local tensor is a LocalShardsWrapper (a table)."""
    if isinstance(t, ShardedTensor):
        return True
    return isinstance(t, DTensor) and isinstance(t._local_tensor, LocalShardsWrapper)


def local_pieces(t: torch.Tensor) -> list[Piece]:
    """This rank's shards of a sharded table, in order (none for a rank without any)."""
    if isinstance(t, ShardedTensor):
        return [
            Piece(tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes), s.tensor)
            for s in t.local_shards()
        ]
    wrapper = t._local_tensor
    return [
        Piece(tuple(o), tuple(s.shape), s)
        for o, s in zip(wrapper.local_offsets(), wrapper.local_shards())
        if s.numel() > 0
    ]


def global_size(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.size()) if isinstance(t, ShardedTensor) else tuple(t.shape)


def dtype_of(t: torch.Tensor) -> torch.dtype:
    return t.metadata().tensor_properties.dtype if isinstance(t, ShardedTensor) else t.dtype


def _group(t: torch.Tensor) -> Optional[ProcessGroup]:
    """The group whose ranks hold `t`'s pieces: a DTensor's is its mesh's last dim ("shard")."""
    if isinstance(t, ShardedTensor):
        return t._process_group
    return t.device_mesh.get_group(t.device_mesh.ndim - 1)


def global_pieces(t: torch.Tensor) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """(owner's global rank, offsets, sizes) of every shard on every rank, the same list on
    every rank: from a ShardedTensor's metadata, or (a DTensor holds only its own) gathered
    from the mesh's ranks, which makes it a collective there."""
    if isinstance(t, ShardedTensor):
        return [
            (s.placement.rank(), tuple(s.shard_offsets), tuple(s.shard_sizes))
            for s in t.metadata().shards_metadata
        ]
    group = _group(t)
    mine = [(p.offsets, p.sizes) for p in local_pieces(t)]
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    return [
        (dist.get_global_rank(group, r), offsets, sizes)
        for r, pieces in enumerate(every)
        for offsets, sizes in pieces
    ]


def dtensor_from_pieces(
    pieces: Sequence[tuple[tuple[int, ...], torch.Tensor]],
    size: tuple[int, ...],
    *,
    group: Optional[ProcessGroup],
    device: torch.device,
    column_wise: bool = False,
    replicas: Optional[Replicas] = None,
) -> DTensor:
    """A table's DTensor (Note [table tensor types]) from this rank's shards, no collective: over
    `group`'s 1-D mesh, or in 2D (`replicas` given) over the replica axis' 2D mesh."""
    if replicas is not None:
        mesh = replicas.mesh
    else:
        mesh = DeviceMesh.from_group(group or dist.group.WORLD, device.type)
    return _dtensor(pieces, size, mesh=mesh, device=device, column_wise=column_wise)


def _dtensor(
    pieces: Sequence[tuple[tuple[int, ...], torch.Tensor]],
    size: tuple[int, ...],
    *,
    mesh: DeviceMesh,
    device: torch.device,
    column_wise: bool,
) -> DTensor:
    if pieces:
        wrapper = _TableShards([t for _, t in pieces], [tuple(o) for o, _ in pieces])
    else:  # one empty shard keeps the chunk's rank equal to the tensor's for DCP
        empty = torch.empty((0,) * len(size), device=device)
        wrapper = _TableShards([empty], [(0,) * len(size)])
    placement = Shard(1) if column_wise and len(size) > 1 else Shard(0)
    placements = (Replicate(),) * (mesh.ndim - 1) + (placement,)  # "replicate" before "shard"
    dtype = pieces[0][1].dtype if pieces else torch.float32
    meta = TensorMeta(torch.Size(size), torch.empty(size, device="meta").stride(), dtype)
    # Built directly rather than by `DTensor.from_local`, whose autograd view would replace the
    # shards by views of them: the wrapper must hold the kernels' own tensors (ShardViews with
    # their gradients, Note [dense gradient buffer]).
    spec = DTensorSpec(mesh, placements, tensor_meta=meta)
    return DTensor(wrapper, spec, requires_grad=False)


def laid_out_like(
    t: torch.Tensor, tensors: list[torch.Tensor], dtype: Optional[torch.dtype] = None
) -> torch.Tensor:
    """A tensor of `t`'s form and layout whose local shards are `tensors` (no collective)."""
    if isinstance(t, ShardedTensor):
        meta = t.metadata()
        dtype = dtype or (tensors[0].dtype if tensors else meta.tensor_properties.dtype)
        props = dataclasses.replace(meta.tensor_properties, dtype=dtype, requires_grad=False)
        meta = dataclasses.replace(meta, tensor_properties=props)
        shards = [
            STShard(x.detach(), ShardMetadata(list(p.offsets), list(p.sizes), s.metadata.placement))
            for x, p, s in zip(tensors, local_pieces(t), t.local_shards())
        ]
        with quiet_sharded_tensor():
            return ShardedTensor._init_from_local_shards_and_global_metadata(
                shards, meta, process_group=t._process_group
            )
    offsets = [p.offsets for p in local_pieces(t)]
    column_wise = isinstance(t.placements[-1], Shard) and t.placements[-1].dim == 1
    return _dtensor(
        [(o, x.detach()) for o, x in zip(offsets, tensors)], global_size(t),
        mesh=t.device_mesh, device=t._local_tensor.device, column_wise=column_wise,
    )  # fmt: skip
