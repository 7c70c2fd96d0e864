"""Table-batched lookup kernels (fbgemm TBE) and per-shard views into their weights.

One kernel looks up every route of one `KernelGroup` in a single call. Its weights are one flat
buffer; each shard is exposed as a `ShardView`, a parameter that aliases its slice of the buffer
and whose `.grad` is the matching slice of the buffer's gradient, so a torch optimizer can update
each shard on its own even though the kernel batches them (TorchRec's TableBatchedEmbeddingSlice
does the same).
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    DenseTableBatchedEmbeddingBagsCodegen,
)

from modular._layout import KernelGroup, Pooling

_POOLING = {Pooling.SUM: PoolingMode.SUM, Pooling.MEAN: PoolingMode.MEAN}

# fbgemm 1.8's dense TBE backward goes through torch's deprecated autograd fallback, which warns on
# every backward that it "may lead to silently incorrect behavior". Its gradients are exact: the
# parity tests compare every table's gradient with the unsharded EBC's (tests/modular/).
warnings.filterwarnings(
    "ignore",
    message="fbgemm::dense_embedding_codegen_lookup_function: an autograd kernel was not registered",
)


class ShardView(torch.nn.Parameter):
    """A (rows, cols) parameter aliasing a slice of a kernel's flat weight buffer.

    In-place updates write through to the kernel. `.grad` reads (and writes) the matching slice of
    the buffer's gradient; setting it to None clears the whole buffer's gradient, which is what
    `optimizer.zero_grad()` does for every shard of the kernel anyway.
    """

    _flat: torch.Tensor
    _start: int
    _end: int

    def __new__(cls, flat: torch.Tensor, start: int, rows: int, cols: int) -> ShardView:
        data = flat.detach()[start : start + rows * cols].view(rows, cols)
        view = torch.Tensor._make_subclass(cls, data, flat.requires_grad)
        view._flat = flat
        view._start = start
        view._end = start + rows * cols
        return view

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    @property
    def grad(self) -> Optional[torch.Tensor]:  # type: ignore[override]
        g = self._flat.grad
        if g is None:
            return None
        return g[self._start : self._end].view(self.shape)

    @grad.setter
    def grad(self, value: Optional[torch.Tensor]) -> None:
        if value is None:
            self._flat.grad = None
            return
        if self._flat.grad is None:
            self._flat.grad = torch.zeros_like(self._flat)
        self._flat.grad[self._start : self._end].copy_(value.reshape(-1))

    def __deepcopy__(self, memo: dict) -> torch.Tensor:
        return torch.nn.Parameter(self.detach().clone(), self.requires_grad)

    def __reduce_ex__(self, proto: int):  # pickles as a plain tensor (the alias cannot travel)
        return (_rebuild_plain, (self.detach().clone(),))

    def __repr__(self) -> str:
        return f"ShardView({tuple(self.shape)}, of a {self._flat.numel()}-element kernel buffer)"


def _rebuild_plain(t: torch.Tensor) -> torch.Tensor:
    return t


def dense_tbe(
    group: KernelGroup, sizes: list[tuple[int, int]], device: torch.device
) -> DenseTableBatchedEmbeddingBagsCodegen:
    """fbgemm's dense TBE over one kernel group's shards: one flat fp32 buffer, tables in order."""
    tbe = DenseTableBatchedEmbeddingBagsCodegen(
        embedding_specs=sizes,
        feature_table_map=list(group.feature_table_map),
        pooling_mode=_POOLING[group.pooling],
        use_cpu=device.type == "cpu",
    )
    return tbe.to(device)


class DenseKernel:
    """fbgemm's dense TBE for one kernel group: autograd gives the flat buffer a dense gradient.

    Not an nn.Module on purpose: its flat buffer must not appear in the owning module's
    `named_parameters()`, which lists the tables under their unsharded names instead.
    """

    def __init__(
        self,
        group: KernelGroup,
        sizes: list[tuple[int, int]],
        device: torch.device,
    ) -> None:
        self.group = group
        self.sizes = sizes
        self.tbe = dense_tbe(group, sizes, device)
        offsets, start = [], 0
        for rows, cols in sizes:
            offsets.append(start)
            start += rows * cols
        self.views = [
            ShardView(self.tbe.weights, off, rows, cols) for off, (rows, cols) in zip(offsets, sizes)
        ]

    @property
    def flat_weight(self) -> torch.nn.Parameter:
        return self.tbe.weights

    def __call__(
        self, indices: torch.Tensor, offsets: torch.Tensor, weights: Optional[torch.Tensor]
    ) -> torch.Tensor:
        return self.tbe(indices, offsets, per_sample_weights=weights)


# -- fused kernels (Note [fused tables]) ------------------------------------------------------


class FusedKernel:
    """fbgemm's split TBE with the optimizer fused into backward: rows it touched are updated,
    no gradient is materialised. Needs shard widths that are multiples of 4."""

    def __init__(
        self, group: KernelGroup, sizes: list[tuple[int, int]], device: torch.device, config
    ) -> None:
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        on_cpu = device.type == "cpu"
        location = EmbeddingLocation.HOST if on_cpu else EmbeddingLocation.DEVICE
        compute = ComputeDevice.CPU if on_cpu else ComputeDevice.CUDA
        self.group = group
        self.sizes = sizes
        self.config = config
        self._lr = config.lr
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[(rows, cols, location, compute) for rows, cols in sizes],
            feature_table_map=list(group.feature_table_map),
            optimizer=config.optimizer.fbgemm_type(),
            learning_rate=config.lr,
            eps=config.eps,
            pooling_mode=_POOLING[group.pooling],
            device=device,
            **_weight_decay_args(config),
        )
        self.views = [
            torch.nn.Parameter(w, requires_grad=False) for w in self.tbe.split_embedding_weights()
        ]
        self.states = self._state_views()

    def _state_views(self) -> list[dict[str, torch.Tensor]]:
        name = self.config.optimizer.state_name()
        if name is None:
            return [{} for _ in self.sizes]
        out = []
        for (rows, cols), states in zip(self.sizes, self.tbe.split_optimizer_states()):
            shape = (rows,) if self.config.optimizer.rowwise() else (rows, cols)
            out.append({name: states[0].view(shape)})
        return out

    def __call__(
        self, indices: torch.Tensor, offsets: torch.Tensor, weights: Optional[torch.Tensor]
    ) -> torch.Tensor:
        lr = self.config.lr
        if lr != self._lr:  # an LR scheduler changed the optimizer's param group
            self.tbe.set_learning_rate(lr)
            self._lr = lr
        return self.tbe(indices, offsets, per_sample_weights=weights)


def _weight_decay_args(config) -> dict:
    if config.weight_decay == 0.0:
        return {}
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import WeightDecayMode

    return {"weight_decay": config.weight_decay, "weight_decay_mode": WeightDecayMode.L2}
