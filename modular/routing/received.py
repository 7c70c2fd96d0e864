"""What the input dist hands to lookup and output dist, for every kind of collection."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from modular.routing.variable_batch import VariableBatch

__all__ = ["Received"]


class Received(NamedTuple):
    """One batch after input dist (`ShardedCollection.input_dist` in modular/collection.py)."""

    batch_size: int
    kjt: KeyedJaggedTensor  # this rank's batch, its features in the module's order
    lengths: torch.Tensor  # (routes on this rank, world * batch_size), route-major
    values: torch.Tensor  # ids of this rank's routes, route by route, source rank by source rank
    weights: Optional[torch.Tensor]
    local: Optional[KeyedJaggedTensor]  # this rank's own batch for its data-parallel tables
    extra: Any  # what the kind's part prepared (`KindPart.prepare`), or None
    # The kind's part that runs this batch's lookup and output dist (modular/parts.py): chosen
    # once, by the input dist, for a uniform batch or a variable-batch one
    part: Any
    # A variable-batch step's strides and inverse indices (Note [variable batch per feature]):
    # then `lengths` is 1-D, each route's bags from every rank, route by route
    vbe: Optional[VariableBatch] = None
