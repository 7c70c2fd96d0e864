"""Selecting a KeyedJaggedTensor's features in a given order, with fbgemm's segment permutation.

Used by input dist to put a batch's features in the module's order (dropping the features of a
larger batch that no table of the module reads), and by data-parallel tables to take their own
features out of a batch.
"""

from __future__ import annotations

from typing import Optional

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


class Permutation:
    """A feature order for `permute`: the host list, and its int32 tensor per device, made once,
    so that permuting a batch off the CPU reads nothing back from the device and copies nothing
    to it."""

    def __init__(self, order: list[int]) -> None:
        self.order = list(order)
        # Every one of len(order) features once: a batch of that many features keeps every id.
        self.is_permutation = sorted(self.order) == list(range(len(self.order)))
        self._on: dict[torch.device, torch.Tensor] = {}

    def on(self, device: torch.device) -> torch.Tensor:
        t = self._on.get(device)
        if t is None:
            t = self._on[device] = torch.tensor(self.order, dtype=torch.int32, device=device)
        return t


def permute(
    kjt: KeyedJaggedTensor, perm: Permutation, *, total: Optional[int] = None
) -> KeyedJaggedTensor:
    """Selects a KJT's features in the order of `perm` (fbgemm's segment permutation, weights
    included). `perm` may repeat a feature (a feature read by two data-parallel tables is looked
    up once per table) or leave features out (a batch that carries more features than a module
    reads). `total`, the selected ids' count where the caller knows it, spares fbgemm summing the
    selected lengths (on a GPU, a read on the host)."""
    keys = kjt.keys()
    batch = kjt.stride()
    lengths = kjt.lengths().view(len(keys), batch)
    order = perm.order
    # The output has as many ids as the input only for a true permutation; otherwise fbgemm must
    # sum the selected lengths (telling it the input's count overruns its output buffer).
    if total is None and perm.is_permutation and len(order) == len(keys):
        total = kjt.values().numel()
    new_lengths, values, weights = torch.ops.fbgemm.permute_2D_sparse_data(
        perm.on(lengths.device), lengths, kjt.values(), kjt.weights_or_none(), total
    )
    return KeyedJaggedTensor(
        keys=[keys[i] for i in order],
        values=values,
        weights=weights,
        lengths=new_lengths.reshape(-1),
        stride=batch,
    )
