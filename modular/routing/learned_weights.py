"""Per-sample weights that require grad: how their gradient gets back to the rank that passed them.

# Note [learned per-sample weights]
torchrec's unsharded EBC back-propagates into its per-sample weights (a
`FeatureProcessedEmbeddingBagCollection`'s `PositionWeightedModule` learns them): the gradient
of a weight is the dot product of its id's row with its bag's output gradient (divided by the
bag's length in a MEAN bag). Sharded, the id and its row are on another rank than the weight, so
a step whose weights require grad (on every rank: the ranks agree in the ids' header, Note [ids
with their header], and refuse on every rank a step where only some do) runs:

  * input dist: each id's *position* in the batch the user passed travels through the checks'
    normalisation and the routing in place of its weight (as float64, exact to 2**53), not the
    weight: fbgemm's permutations are not differentiated (the backward of fbgemm's CPU
    permutation of weights corrupted memory). The routed weights are then one differentiable
    gather of the user's weights at the routed positions; their values travel in the ids'
    exchange as always, and `WeightsReturn` ties what arrives to what was sent. The arrival
    permutation and the data-parallel tables' selection move positions too, resolved by one
    gather each (`LearnedWeights.resolve`).
  * lookup: the kernels look up detached weights (their own backward trains the tables only);
    `modular/kernels/weight_grads.py` adds each id's weight gradient, from its row as it was
    in the forward (before a fused kernel's update), exactly.
  * backward: `WeightsReturn` sends each weight's gradient back with the exchange's splits
    reversed (one all-to-all of a float32 per id, on the module's group, so a prefetch thread's
    collectives never interleave with it), and the gathers' backward adds them into the user's
    weights' gradient: copies of one id (column-wise and table-row-wise pieces, a feature read
    by two tables) sum. The output dist's backward divides the pooled gradients by the world size
    (Note [grad scaling across ranks] in modular/comm.py), so the returned gradient is multiplied
    by it: each rank's weights receive the gradient of its own loss, as unsharded, which DDP or
    FSDP2 then averages over ranks like any dense gradient. Data-parallel tables' weights never
    leave the rank: their gradient is local.
A step whose weights do not require grad runs none of this.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch.distributed import ProcessGroup
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from modular.comm import all_to_all
from modular.routing.received import Received

__all__ = ["LearnedWeights", "WeightsReturn", "positions_like", "returned", "with_weights"]


def with_weights(kjt: KeyedJaggedTensor, weights: torch.Tensor) -> KeyedJaggedTensor:
    """The same batch (uniform or variable-batch) with other per-sample weights."""
    variable = kjt.variable_stride_per_key()
    return KeyedJaggedTensor(
        keys=kjt.keys(), values=kjt.values(), weights=weights, lengths=kjt.lengths(),
        stride=None if variable else kjt.stride(),
        stride_per_key_per_rank=kjt.stride_per_key_per_rank() if variable else None,
        inverse_indices=kjt.inverse_indices_or_none(),
    )  # fmt: skip


def positions_like(values: torch.Tensor) -> torch.Tensor:
    """Each element's position in `values`, as float64 per-sample weights."""
    return torch.arange(values.numel(), dtype=torch.float64, device=values.device)


class LearnedWeights(NamedTuple):
    """A batch's per-sample weights that require grad, and the batch as the input dist reads
    it: `checked` (its weights detached, for the checks) and `positions` (each id's position as
    its weight, for routing)."""

    weights: torch.Tensor
    checked: KeyedJaggedTensor
    positions: KeyedJaggedTensor

    @staticmethod
    def of(features: KeyedJaggedTensor) -> Optional[LearnedWeights]:
        """The batch's learned weights, or None when they do not require grad (or no backward
        will run)."""
        weights = features.weights_or_none()
        if weights is None or not weights.requires_grad or not torch.is_grad_enabled():
            return None
        return LearnedWeights(
            weights,
            with_weights(features, weights.detach()),
            with_weights(features, positions_like(weights)),
        )

    def at(self, positions: torch.Tensor) -> torch.Tensor:
        """The weights at routed `positions` (float64), FP32 (Note [per-sample weights of
        low-precision tables]); differentiable."""
        return self.weights.float().index_select(0, positions.long())

    def resolve(self, received: Received, arrived: torch.Tensor) -> Received:
        """`received`, whose weights are positions in `arrived` (the weights this rank's routes
        received, which require grad) and whose data-parallel batch's weights are positions in
        the user's batch, with the weights themselves."""
        weights = arrived.index_select(0, received.weights.long())
        local = received.local
        if local is not None:
            local = with_weights(local, self.at(local.weights()))
        return received._replace(weights=weights, local=local)


class WeightsReturn(torch.autograd.Function):
    """The weights another rank's ids brought (`received`, already exchanged with the ids) tied
    to the ones this rank sent (`sent`): backward sends each received weight's gradient back to
    its rank, the exchange's splits reversed, times the world size (Note [learned per-sample
    weights])."""

    @staticmethod
    def forward(ctx, sent, received, sent_counts, received_counts, group, world):  # type: ignore[override]
        ctx.splits = (received_counts, sent_counts)
        ctx.group, ctx.world = group, world
        return received.view_as(received)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        received_counts, sent_counts = ctx.splits
        back = all_to_all(
            (grad * ctx.world).contiguous(), input_splits=received_counts,
            output_splits=sent_counts, group=ctx.group,
            what="the all-to-all of per-sample weights' gradients",
        )  # fmt: skip
        return back, None, None, None, None, None


def returned(
    sent: torch.Tensor, received: torch.Tensor, exchanged: tuple[list[int], list[int]],
    group: Optional[ProcessGroup], world: int,
) -> torch.Tensor:
    """`WeightsReturn` of a step's weights; `exchanged`: the ids this rank sent each rank and
    received from each."""
    return WeightsReturn.apply(sent, received, exchanged[0], exchanged[1], group, world)
