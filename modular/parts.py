"""What a kind of collection adds to the one step (Note [collection kinds] in modular/kinds.py).

`ShardedCollection` (modular/collection.py) runs input dist -> lookup -> output dist for every kind;
what differs by kind is a `KindPart`: how the kernels look the routed ids up, what goes on the
output dist's wire (`Wire`), and where what arrives lands in the output. A kind may have a second
part for batches whose features have their own bag counts (torchrec's VBE KJTs); the input dist
picks one part per step and hands it on in `Received.part`, so no stage after it asks which
batch it has (Note [variable batch per feature] in modular/routing/variable_batch.py).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Protocol

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from modular.local_shards import LocalShards
from modular.routing.received import Received
from modular.routing.variable_batch import VariableBatch

__all__ = ["KindPart", "Wire"]


class Wire(NamedTuple):
    """What a kind's part puts on the output dist's wire (`KindPart.send`)."""

    send: Optional[torch.Tensor]  # for every rank, in rank order; None when no route exists
    input_splits: list[int]
    output_splits: list[int]
    local: Optional[torch.Tensor]  # this rank's data-parallel result, placed after the arrivals


class KindPart(Protocol):
    """What differs by kind in the step (Note [collection kinds])."""

    def attach(self, shards: LocalShards) -> None:
        """Sees this rank's kernels once they are built (before any step)."""

    def prepare(
        self, kjt: KeyedJaggedTensor, lengths: torch.Tensor, vbe: Optional[VariableBatch]
    ) -> Any:
        """Per-kind facts of a batch, made in the input dist (a prefetch makes them early);
        `vbe`: the strides of a variable-batch step, whose `lengths` are then 1-D."""

    def lookup(self, shards: LocalShards, received: Received) -> Any:
        """The kernels' results for the routed ids and the data-parallel ones."""

    def send(self, looked: Any, received: Received) -> Wire:
        """What goes to each rank."""

    def place(self, arrived: torch.Tensor, received: Received) -> torch.Tensor:
        """The output, from the flat arrivals (every source rank's, then the local part)."""

    def wrap(self, out: torch.Tensor, received: Received) -> Any:
        """The output as torchrec's unsharded module returns it."""
