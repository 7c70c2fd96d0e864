"""Table-batched lookup kernels (fbgemm TBE) and per-shard views into their weights.

One kernel looks up every route of one `KernelGroup` in a single call. Its weights are one flat
buffer; each shard is exposed as a `ShardView`, a parameter that aliases its slice of the buffer
and whose `.grad` is the matching slice of the buffer's gradient, so a torch optimizer can update
each shard on its own even though the kernel batches them (TorchRec's TableBatchedEmbeddingSlice
does the same).

# Note [dense gradient buffer]
A dense kernel's gradient is as large as its weights, and on CPU a fresh tensor that large is a
fresh mmap: the kernel pays a page fault per 4 KiB on first touch, every step (measured: a new
zeroed 100 MiB buffer 43 ms, zeroing the same buffer again 3 ms; fbgemm's dense TBE backward
allocates one per call, so it spent 44 ms of a 61 ms step there). So a dense kernel keeps its
flat gradient across steps, as `zero_grad(set_to_none=False)` would: `.grad = None` (what
`optimizer.zero_grad()` does) hides it, and the next backward zeroes it and accumulates into it.
On CPU the accumulation is fbgemm's exact-SGD backward with a learning rate of -1 run on the
gradient buffer instead of the weights (`w -= lr * g` with lr = -1 is `buf += g`, per touched row,
with fbgemm's own sort and sums: bit-identical to its dense gradient for SUM). MEAN bags go in as
SUM with 1/length folded into per-id weights, because fbgemm's weighted CPU backward leaves the
1/length out. Other devices keep fbgemm's dense TBE backward (their caching allocators make a new
buffer cheap). A reference to last step's `.grad` taken before `zero_grad()` therefore sees this
step's gradient, as with set_to_none=False.

# Note [dense replicas]
A data-parallel table's gradient must be the mean over ranks of their batches' gradients, the same
on every rank. DDP all-reduces the whole (rows, dim) gradient; but a step touches only the rows
its ids name, so on CPU a replica first all-gathers every rank's bag lengths (one small
collective), and when the global batch's ids x dim is at most the buffer's size (`replay_pays`)
it gathers the ids and the pooled outputs' gradients divided by the world size and runs the same
fbgemm backward on the global batch, ranks in order: the same sum, from bags x dim floats and ids
instead of a table's worth, and the same bits on every rank. Otherwise (more ids than the table
has rows) it accumulates its own batch and all-reduces the buffer. The choice rests on the
gathered lengths, so every rank makes the same one. Measured in docs/benchmarks.md; the fused
twin is Note [fused replicas] in modular/_deferred.py.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch
import torch.distributed as dist
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    DenseTableBatchedEmbeddingBagsCodegen,
)
from torch.distributed import ProcessGroup
from torch.optim.optimizer import _foreach_supported_types as optimizer_foreach_types
from torch.utils._foreach_utils import _foreach_supported_types as utils_foreach_types

from modular._comm import raise_failed
from modular._layout import KernelGroup, Pooling
from modular._lookups import Lookup, gather_batch, gather_lengths

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
    `optimizer.zero_grad()` does for every shard of the kernel anyway (the buffer itself is kept
    for the next step: Note [dense gradient buffer]).
    """

    _flat: torch.Tensor
    _grads: GradBuffer
    _start: int
    _end: int

    def __new__(cls, grads: GradBuffer, start: int, rows: int, cols: int) -> ShardView:
        flat = grads.flat
        data = flat.detach()[start : start + rows * cols].view(rows, cols)
        view = torch.Tensor._make_subclass(cls, data, flat.requires_grad)
        view._flat = flat
        view._grads = grads
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
        self._grads.acquire()[self._start : self._end].copy_(value.reshape(-1))

    def __deepcopy__(self, memo: dict) -> torch.Tensor:
        return torch.nn.Parameter(self.detach().clone(), self.requires_grad)

    def __reduce_ex__(self, proto: int):  # pickles as a plain tensor (the alias cannot travel)
        return (_rebuild_plain, (self.detach().clone(),))

    def __repr__(self) -> str:
        return f"ShardView({tuple(self.shape)}, of a {self._flat.numel()}-element kernel buffer)"


def _rebuild_plain(t: torch.Tensor) -> torch.Tensor:
    return t


# Note [ShardView and foreach]
# torch's optimizers take their multi-tensor (foreach) or fused kernels only when every parameter's
# type is in a registry, and fall back to one kernel launch per tensor per op otherwise, for the
# whole optimizer: one ShardView among an Adam's dense parameters would make the dense tower's
# update on a GPU the slow loop too. A ShardView's data is a plain strided slice of its kernel's
# buffer (no __torch_function__ of its own) and its `.grad` a plain slice of the gradient, so the
# foreach and fused kernels treat it as the tensor it is. It is registered the way torch registers
# DTensor (torch/distributed/tensor/__init__.py). tests/modular/test_dense_grads.py checks that a
# foreach Adam over shard views updates them exactly like the per-tensor loop.
for _registry in (optimizer_foreach_types, utils_foreach_types):
    if ShardView not in _registry:
        _registry.append(ShardView)


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


def sum_weights(
    pooling: Pooling, offsets: torch.Tensor, weights: Optional[torch.Tensor]
) -> Optional[torch.Tensor]:
    """Per-id weights that make a SUM-mode fbgemm CPU backward exact for this lookup: 1/length for
    MEAN bags (fbgemm's weighted CPU backward leaves it out), the lookup's own weights, or None
    when unweighted. fbgemm's raw CPU backward ops take None for "no weights", and their
    unweighted path is the faster one, with bit for bit the same update (fbgemm-gpu-cpu 1.8.0):
    row-wise Adagrad's backward on 327,680 ids of 32 columns took 11.7 ms against 12.5 ms with a
    tensor of ones (benchmarks/raw_backward.py, docs/benchmarks.md)."""
    if pooling is Pooling.MEAN:
        n = int(offsets[-1])
        lengths = offsets[1:] - offsets[:-1]
        inverse = 1.0 / lengths.clamp(min=1).to(torch.float32)
        per_id = torch.repeat_interleave(inverse, lengths, output_size=n)
        return per_id if weights is None else weights.float() * per_id
    if weights is not None:
        return weights.float().contiguous()
    return None


def no_weight_grads(group: KernelGroup, device: torch.device) -> torch.Tensor:
    """fbgemm's `feature_requires_grad` for a kernel group: no feature's weights need a gradient.

    # Note [no gradient for per-sample weights]
    fbgemm's TBE autograd computes the gradient of the per-sample weights in every weighted
    backward (`split_embedding_codegen_grad_indice_weights_cpu`: a dot product of each id's row
    with its bag's output gradient), whether or not the weights require grad, unless
    `feature_requires_grad` says which features need it. The checks refuse weights that
    require grad (`BatchChecks`: nothing would reach them), so no feature does. Measured on one
    CPU thread, 4 tables x 100,000 x 64, 163,840 weighted ids, row-wise Adagrad: the fused
    backward took 46.9 ms with it and 6.9 ms without (7.9 ms unweighted).
    """
    return torch.zeros(len(group.feature_table_map), dtype=torch.int32, device=device)


def lookup_without_weight_grads(
    tbe, indices: torch.Tensor, offsets: torch.Tensor, weights: Optional[torch.Tensor],
    no_weight_grads: torch.Tensor,
) -> torch.Tensor:
    """fbgemm's TBE forward (autograd), told that the weights need no gradient (Note [no
    gradient for per-sample weights]); `no_weight_grads` from `no_weight_grads`."""
    if weights is None:
        return tbe(indices, offsets)
    return tbe(indices, offsets, per_sample_weights=weights, feature_requires_grad=no_weight_grads)


class GradBuffer:
    """The flat gradient of one dense kernel, kept across steps (Note [dense gradient buffer])."""

    def __init__(self, flat: torch.nn.Parameter) -> None:
        self.flat = flat
        self._kept: Optional[torch.Tensor] = None

    def acquire(self) -> torch.Tensor:
        """`flat.grad`, made from the kept buffer (zeroed) when it is None."""
        g = self.flat.grad
        if g is None:
            g = self._kept
            if g is None:
                g = torch.zeros_like(self.flat)
            else:
                g.zero_()
            self.flat.grad = g
        self._kept = g
        return g


class KernelLookup(torch.autograd.Function):
    """fbgemm's forward for a kernel whose backward is its own: autograd hands the pooled
    outputs' gradient to `kernel.backward(grad_out, indices, offsets, weights)` and gives no
    gradient to `anchor` (a tensor that requires grad, so that backward reaches the kernel)."""

    @staticmethod
    def forward(ctx, anchor, kernel, indices, offsets, weights):  # type: ignore[override]
        ctx.kernel = kernel
        ctx.inputs = (indices, offsets, weights)
        return kernel.tbe(indices, offsets, per_sample_weights=weights)  # grad mode is off here

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        ctx.kernel.backward(grad_out, *ctx.inputs)
        return None, None, None, None, None


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
        self.grads = GradBuffer(self.tbe.weights)
        offsets, start = [], 0
        for rows, cols in sizes:
            offsets.append(start)
            start += rows * cols
        self.views = [
            ShardView(self.grads, off, rows, cols) for off, (rows, cols) in zip(offsets, sizes)
        ]
        self._on_cpu = device.type == "cpu"
        self._no_weight_grads = no_weight_grads(group, device)
        self._replicas: Optional[tuple[Optional[ProcessGroup], int]] = None
        self.replay_ratio = 1.0  # Note [dense replicas]; tests force either way with 0 or inf
        if self._on_cpu:
            from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation

            self._placements = torch.full(
                (len(sizes),), EmbeddingLocation.HOST.value, dtype=torch.int32
            )
            self._minus_one = torch.tensor(-1.0)

    @property
    def flat_weight(self) -> torch.nn.Parameter:
        return self.tbe.weights

    def replicate(self, group: Optional[ProcessGroup], world: int) -> None:
        """Makes this kernel a data-parallel replica on `world` ranks: each backward leaves the
        mean over ranks of their batches' gradients in the buffer (Note [dense replicas])."""
        if self._on_cpu:
            self._replicas = (group, world)
            return

        def all_reduce_mean(flat: torch.Tensor) -> None:
            _all_reduce_mean(flat.grad, group, world)

        self.flat_weight.register_post_accumulate_grad_hook(all_reduce_mean)

    def __call__(
        self, indices: torch.Tensor, offsets: torch.Tensor, weights: Optional[torch.Tensor]
    ) -> torch.Tensor:
        if not self._on_cpu:
            no_grads = self._no_weight_grads
            return lookup_without_weight_grads(self.tbe, indices, offsets, weights, no_grads)
        return KernelLookup.apply(self.tbe.weights, self, indices, offsets, weights)

    def backward(
        self,
        grad_out: torch.Tensor,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        weights: Optional[torch.Tensor],
    ) -> None:
        """Adds this lookup's gradient into the kept buffer (Note [dense gradient buffer]); for a
        replica, the mean over ranks (Note [dense replicas])."""
        batch = Lookup.of(grad_out, indices, offsets, weights)
        reduce = False
        if self._replicas is not None:
            group, world = self._replicas
            lengths = gather_lengths(batch, group, world)
            ids = int(lengths.sum())
            if replay_pays(ids, self.tbe.max_D, self.tbe.weights.numel(), self.replay_ratio):
                batch = gather_batch(batch, lengths, len(self.group.routes), group, world)
            else:
                reduce = True
        per_id = sum_weights(self.group.pooling, batch.offsets, batch.weights)
        tbe = self.tbe
        grad = self.grads.acquire()
        torch.ops.fbgemm.split_embedding_backward_codegen_sgd_cpu(
            batch.grad_out,
            grad,
            self._placements,
            tbe.weights_offsets,
            tbe.D_offsets,
            tbe.max_D,
            tbe.hash_size_cumsum,
            tbe.total_hash_size_bits,
            batch.indices,
            batch.offsets,
            int(PoolingMode.SUM),
            per_id,
            False,  # stochastic rounding
            self._minus_one,  # learning rate: w -= lr * g is buf += g
            0,  # output dtype: fp32
        )
        if reduce:
            _all_reduce_mean(grad, *self._replicas)


def replay_pays(global_ids: int, dim: int, numel: int, ratio: float = 1.0) -> bool:
    """Whether a dense replica replays the global batch rather than all-reducing its gradient
    (Note [dense replicas]): when the replay's scatter, ids x dim adds, is at most `ratio` times
    the buffer's size."""
    return global_ids * dim <= ratio * numel


def _all_reduce_mean(grad: torch.Tensor, group: Optional[ProcessGroup], world: int) -> None:
    # Note [grad scaling across ranks] (modular/_comm.py): the mean over ranks, like DDP.
    try:
        dist.all_reduce(grad, group=group)
    except RuntimeError as e:
        raise_failed("the gradient all-reduce of a data-parallel table", group, e)
    grad.div_(world)


# -- fused kernels (Note [fused tables]) ------------------------------------------------------


class FusedKernel:
    """fbgemm's split TBE with the optimizer fused into backward: rows it touched are updated,
    no gradient is materialised. Needs shard widths that are multiples of 4."""

    def __init__(
        self, group: KernelGroup, sizes: list[tuple[int, int]], device: torch.device, config
    ) -> None:
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
            BoundsCheckMode,
            EmbeddingLocation,
        )
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
            # Input dist has checked every id against its table (Router.check), so fbgemm's own
            # per-forward bounds check would only repeat it.
            bounds_check_mode=BoundsCheckMode.NONE,
            **_weight_decay_args(config),
        )
        self.views = [
            torch.nn.Parameter(w, requires_grad=False) for w in self.tbe.split_embedding_weights()
        ]
        self.states = self._state_views()
        self._no_weight_grads = no_weight_grads(group, device)

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
        self._sync_lr()
        no_grads = self._no_weight_grads
        return lookup_without_weight_grads(self.tbe, indices, offsets, weights, no_grads)

    def _sync_lr(self) -> None:
        lr = self.config.lr
        if lr != self._lr:  # an LR scheduler changed the optimizer's param group
            self.tbe.set_learning_rate(lr)
            self._lr = lr


def _weight_decay_args(config) -> dict:
    if config.weight_decay == 0.0:
        return {}
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import WeightDecayMode

    return {"weight_decay": config.weight_decay, "weight_decay_mode": WeightDecayMode.L2}


def pool(
    kernels: list, values: torch.Tensor, offsets: torch.Tensor, weights, bags_per_route: int
) -> torch.Tensor:
    """Runs each kernel on its consecutive routes' slice of one (values, offsets) batch, where
    every route holds `bags_per_route` bags; the kernels' pooled outputs side by side."""
    if len(kernels) == 1:  # the whole batch (its offsets start at 0 and end at its last id)
        return kernels[0](values, offsets, weights)
    ends = [0]
    for kernel in kernels:
        ends.append(ends[-1] + len(kernel.group.routes) * bags_per_route)
    # Where each kernel's ids start and end: one read from the device for all kernels.
    cuts = offsets[torch.tensor(ends, device=offsets.device)].tolist()
    outs = []
    for kernel, lo, hi, v0, v1 in zip(kernels, ends, ends[1:], cuts, cuts[1:]):
        outs.append(
            kernel(
                values[v0:v1],
                offsets[lo : hi + 1] - v0,
                None if weights is None else weights[v0:v1],
            )
        )
    return torch.cat(outs, dim=1)
