"""fbgemm's split TBE with the optimizer fused into backward (Note [fused tables] in
modular/fused/choice.py)."""

from __future__ import annotations

from typing import Optional

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
    BoundsCheckMode,
    EmbeddingLocation,
    PoolingMode,
)
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
    WeightDecayMode,
)

from modular.fused.adam import StepCount
from modular.kernels.base import POOLING, lookup_without_weight_grads, no_weight_grads
from modular.kernels.table_dtypes import sparse_type
from modular.profiling import FUSED_UPDATE, LOOKUP_BACKWARD, label_backward
from modular.tables.layout import KernelGroup, Pooling

__all__ = ["FusedKernel", "SEQUENCE_KERNEL_DEVICES"]

# Where sequence groups take fbgemm's PoolingMode.NONE kernel (Note [sequence lookups] in
# modular/sequence/lookup.py): CUDA. On CPU, fbgemm-gpu-cpu 1.8.0's NONE backward measured
# 2.3-6.5x the SUM backward on bags of one, so CPU keeps bags of one; tests set "cpu" here to
# hold the NONE path to the same parity on CPU.
SEQUENCE_KERNEL_DEVICES = frozenset({"cuda"})


class FusedKernel:
    """fbgemm's split TBE with the optimizer fused into backward: rows it touched are updated,
    no gradient is materialised. Needs shard widths that are multiples of 4. Sequence groups
    take fbgemm's PoolingMode.NONE (`nobag`) on the devices in SEQUENCE_KERNEL_DEVICES, except in
    the deferred kernels, which replay fbgemm's SUM backward ops (Note [sequence lookups] in
    modular/sequence/lookup.py)."""

    replays_sum_backward = False  # the deferred kernels (modular/fused/deferred.py) do

    def __init__(
        self,
        group: KernelGroup,
        sizes: list[tuple[int, int]],
        device: torch.device,
        config,
        *,
        steps: Optional[StepCount] = None,
    ) -> None:
        """`steps`: the module's step count, which the Adam family's bias correction reads
        (Note [fused Adam and LAMB] in modular/fused/adam.py)."""
        on_cpu = device.type == "cpu"
        location = EmbeddingLocation.HOST if on_cpu else EmbeddingLocation.DEVICE
        compute = ComputeDevice.CPU if on_cpu else ComputeDevice.CUDA
        self.group = group
        self.sizes = sizes
        self.config = config
        self._lr = config.lr
        self._steps = steps if config.optimizer.adam_family() else None
        self.nobag = (
            group.pooling is Pooling.NONE
            and not self.replays_sum_backward
            and device.type in SEQUENCE_KERNEL_DEVICES
        )
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[(rows, cols, location, compute) for rows, cols in sizes],
            feature_table_map=list(group.feature_table_map),
            optimizer=config.optimizer.fbgemm_type(),
            learning_rate=config.lr,
            eps=config.eps,
            pooling_mode=PoolingMode.NONE if self.nobag else POOLING[group.pooling],
            device=device,
            # Input dist has checked every id against its table (Router.check), so fbgemm's own
            # per-forward bounds check would only repeat it.
            bounds_check_mode=BoundsCheckMode.NONE,
            # Note [low-precision tables] in modular/kernels/table_dtypes.py: FP32 state, one
            # rounding per update (stochastic where fbgemm's kernels for the device do it).
            weights_precision=sparse_type(group.dtype),
            output_dtype=sparse_type(torch.float32),
            stochastic_rounding=config.stochastic_rounding,
            **_optimizer_args(config),
        )
        self.views = [
            torch.nn.Parameter(w, requires_grad=False) for w in self.tbe.split_embedding_weights()
        ]
        self.states = self._state_views()
        self._no_weight_grads = no_weight_grads(group, device)

    def _state_views(self) -> list[dict[str, torch.Tensor]]:
        kind = self.config.optimizer
        names = kind.state_names()
        if not names:
            return [{} for _ in self.sizes]
        out = []
        for (rows, cols), states in zip(self.sizes, self.tbe.split_optimizer_states()):
            out.append(
                {
                    name: state.view((rows,) if kind.row_state(name) else (rows, cols))
                    for name, state in zip(names, states)
                }
            )
        return out

    def __call__(
        self, indices: torch.Tensor, offsets: torch.Tensor, weights: Optional[torch.Tensor]
    ) -> torch.Tensor:
        self._sync_lr()
        if self._steps is not None:
            self._sync_step(self._steps.value)
        no_grads = self._no_weight_grads
        out = lookup_without_weight_grads(self.tbe, indices, offsets, weights, no_grads)
        return label_backward(out, LOOKUP_BACKWARD, FUSED_UPDATE)  # the update is fbgemm's backward

    def _sync_lr(self) -> None:
        lr = self.config.lr
        if lr != self._lr:  # an LR scheduler changed the optimizer's param group
            self.tbe.set_learning_rate(lr)
            self._lr = lr

    def _sync_step(self, step: int) -> None:
        """fbgemm's Adam-family forward adds one to its own count and corrects by that: it is
        set to the module's count before (Note [fused Adam and LAMB])."""
        self.tbe.iter_cpu.fill_(step - 1)
        self.tbe.iter.fill_(step - 1)


def _optimizer_args(config) -> dict:
    """The TBE's hyperparameters beyond the learning rate and eps: the Adam family's betas and
    (decoupled) weight decay, row-wise Adagrad's weight decay in fbgemm's L2 mode."""
    kind = config.optimizer
    if kind.adam_family():
        beta1, beta2 = config.betas
        return {"beta1": beta1, "beta2": beta2, "weight_decay": config.weight_decay}
    if config.weight_decay == 0.0:
        return {}
    return {"weight_decay": config.weight_decay, "weight_decay_mode": WeightDecayMode.L2}
