"""The kernel interface, and what every fbgemm TBE kernel shares.

A kernel looks up every route of one `KernelGroup` (modular/tables/layout.py) in a single fbgemm
call. Five kinds implement `Kernel`: `DenseKernel` (gradients for a torch optimizer),
`FusedKernel` (fbgemm's optimizer fused into backward), `EmulatedFusedKernel` (the same update
done in torch), and the two `DeferredFusedKernel`s whose update waits for the end of backward.
Which one a shard group gets is decided in one place: `FusedTables.kernel` in
modular/fused/tables.py for fused modules, `DenseKernel` otherwise. Kernels with work at the end
of backward (`EndOfBackward` in modular/fused/backward.py drives it) implement `EndOfStep` too.
"""

from __future__ import annotations

import warnings
from typing import Optional, Protocol, runtime_checkable

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    DenseTableBatchedEmbeddingBagsCodegen,
)

from modular.kernels.lookups import Lookup
from modular.kernels.table_dtypes import sparse_type
from modular.kernels.weight_grads import pool_with_weight_grads
from modular.profiling import LOOKUP_BACKWARD, labelled
from modular.tables.layout import KernelGroup, Pooling

__all__ = [
    "Kernel",
    "KernelLookup",
    "dense_tbe",
    "lookup_without_weight_grads",
    "no_weight_grads",
    "pool",
    "sum_weights",
]

# A kernel that cannot look sequences up unpooled takes each id as a bag of one in a SUM kernel
# (Note [sequence lookups] in modular/sequence/lookup.py); `FusedKernel` takes PoolingMode.NONE.
POOLING = {Pooling.SUM: PoolingMode.SUM, Pooling.MEAN: PoolingMode.MEAN, Pooling.NONE: PoolingMode.SUM}


# fbgemm 1.8's dense TBE backward goes through torch's deprecated autograd fallback, which warns on
# every backward that it "may lead to silently incorrect behavior". Its gradients are exact: the
# parity tests compare every table's gradient with the unsharded EBC's (tests/modular/). The
# filter is global (the warning comes from the autograd engine, outside any call of ours):
# README.md, "What `import modular` changes", says how to see the warning again.
warnings.filterwarnings(
    "ignore",
    message="fbgemm::dense_embedding_codegen_lookup_function: an autograd kernel was not registered",
)


@runtime_checkable
class Kernel(Protocol):
    """One kernel group's lookup: what the sharded module and the fused machinery rely on."""

    group: KernelGroup
    sizes: list[tuple[int, int]]  # (rows, cols) of each shard, in `group.shards` order
    views: list[torch.Tensor]  # each shard's weights, aliasing the kernel's own buffer
    states: list[dict[str, torch.Tensor]]  # each shard's optimizer state by name (fused only)
    # fbgemm's PoolingMode.NONE: one bag per route in, one row per id out (Note [sequence
    # lookups] in modular/sequence/lookup.py); False: pooled bags (of one, for sequences).
    nobag: bool

    def __call__(
        self, indices: torch.Tensor, offsets: torch.Tensor, weights: Optional[torch.Tensor]
    ) -> torch.Tensor:
        """The pooled outputs (bags, sum of the group's route widths); a `nobag` kernel's rows
        (ids, the group's one width)."""
        ...

    def backward(self, batch: Lookup) -> None:
        """This lookup's backward, where the kernel runs its own (`KernelLookup`): the pooled
        outputs' gradient and the ids, offsets and weights it looked up."""
        ...


def dense_tbe(
    group: KernelGroup, sizes: list[tuple[int, int]], device: torch.device
) -> DenseTableBatchedEmbeddingBagsCodegen:
    """fbgemm's dense TBE over one kernel group's shards: one flat buffer of the group's dtype
    (Note [low-precision tables] in modular/kernels/table_dtypes.py), tables in order; its pooled
    outputs are FP32."""
    tbe = DenseTableBatchedEmbeddingBagsCodegen(
        embedding_specs=sizes,
        feature_table_map=list(group.feature_table_map),
        pooling_mode=POOLING[group.pooling],
        use_cpu=device.type == "cpu",
        weights_precision=sparse_type(group.dtype),
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
    `feature_requires_grad` says which features need it. Kernels always look up detached weights;
    weights that require grad get their gradient beside the kernel (Note [learned per-sample
    weights] in modular/routing/learned_weights.py), so no feature needs fbgemm's. Measured on one
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


class KernelLookup(torch.autograd.Function):
    """fbgemm's forward for a kernel whose backward is its own: autograd hands the pooled
    outputs' gradient and the lookup to `kernel.backward(Lookup)` and gives no
    gradient to `anchor` (a tensor that requires grad, so that backward reaches the kernel)."""

    @staticmethod
    def forward(ctx, anchor, kernel, indices, offsets, weights):  # type: ignore[override]
        ctx.kernel = kernel
        ctx.inputs = (indices, offsets, weights)
        return kernel.tbe(indices, offsets, per_sample_weights=weights)  # grad mode is off here

    @staticmethod
    @labelled(LOOKUP_BACKWARD)  # Note [profiler labels] in modular/profiling.py
    def backward(ctx, grad_out):  # type: ignore[override]
        ctx.kernel.backward(Lookup.of(grad_out, *ctx.inputs))
        return None, None, None, None, None


def pool(
    kernels: list, values: torch.Tensor, offsets: torch.Tensor, weights, bags_per_route: int
) -> torch.Tensor:
    """Runs each kernel on its consecutive routes' slice of one (values, offsets) batch, where
    every route holds `bags_per_route` bags; the kernels' pooled outputs side by side. Weights
    that require grad get their gradient beside the kernels' (Note [learned per-sample weights]
    in modular/routing/learned_weights.py), even from a rank with no kernel."""
    if weights is not None and weights.requires_grad:
        return pool_with_weight_grads(pool, kernels, values, offsets, weights, bags_per_route)
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
