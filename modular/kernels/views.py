"""Per-shard views into a kernel's flat weight buffer, and that buffer's kept gradient.

One kernel's weights are one flat buffer; each shard is exposed as a `ShardView`, a parameter that
aliases its slice of the buffer and whose `.grad` is the matching slice of the buffer's gradient,
so a torch optimizer can update each shard on its own even though the kernel batches them
(TorchRec's TableBatchedEmbeddingSlice does the same). See Note [dense gradient buffer] in
modular/kernels/dense.py.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.optim.optimizer import _foreach_supported_types as optimizer_foreach_types
from torch.utils._foreach_utils import _foreach_supported_types as utils_foreach_types

__all__ = ["GradBuffer", "ShardView"]


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
# DTensor (torch/distributed/tensor/__init__.py). tests/modular/kernels/test_dense_grads.py checks that a
# foreach Adam over shard views updates them exactly like the per-tensor loop.
for _registry in (optimizer_foreach_types, utils_foreach_types):
    if ShardView not in _registry:
        _registry.append(ShardView)


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
