"""Collectives as free functions over torch.distributed.

Everything goes through `all_to_all_single` with explicit splits (gloo has no uneven
`all_to_all`), on contiguous tensors, so the same code runs on gloo/CPU and NCCL/GPU.
"""

from __future__ import annotations

from typing import Callable, NoReturn, Optional

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from modular.errors import CollectiveError


def raise_failed(what: str, group: Optional[ProcessGroup], error: RuntimeError) -> NoReturn:
    # gloo reports a closed socket or a timeout as a plain RuntimeError, NCCL as a DistError;
    # any other subclass is someone else's error and passes through as it is.
    if type(error) is not RuntimeError and not isinstance(error, dist.DistError):
        raise error
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    raise CollectiveError(
        f"{what} failed on rank {rank} of {world}: {error}. Another rank most likely died or "
        "raised before reaching it (see that rank's error or exit status); this rank stops too so "
        "that none hangs (Note [a failed peer])"
    ) from error


class KeptBuffers:
    """Receive buffers kept across steps, each handed out again only once nothing else holds it.

    # Note [kept receive buffers]
    On CPU a fresh tensor of a few MiB is fresh pages for the kernel to fault in on first touch,
    inside the collective that fills it (Note [dense gradient buffer] in modular/kernels/dense.py):
    measured 0.2-0.5 ms more per 2 MiB all-to-all than into a kept buffer, three times a step. So
    a module keeps one buffer per collective and reuses it when its storage has no other user
    (no view, no autograd save, no caller keeping last step's output): a buffer still in use is
    never written, a new one is made instead. Other devices allocate as usual (their caching
    allocators already reuse memory).
    """

    def __init__(self) -> None:
        self._kept: dict[str, torch.Tensor] = {}

    def empty(self, key: str, numel: int, like: torch.Tensor) -> torch.Tensor:
        """An uninitialised 1-D tensor of `numel` elements with `like`'s dtype and device."""
        if like.device.type != "cpu":
            return like.new_empty(numel)
        kept = self._kept.get(key)
        if kept is None or kept.dtype != like.dtype or kept.numel() < numel or _in_use(kept):
            # Room for a slightly larger batch next step, so that id counts that vary from step
            # to step do not make a new buffer each time.
            kept = self._kept[key] = like.new_empty(numel + numel // 8)
        return kept[:numel]


_use_count = getattr(torch._C, "_storage_Use_Count", None)  # private: absent means never reuse


def _in_use(t: torch.Tensor) -> bool:
    # `t` itself and the temporary storage object hold one reference each; anything more is a
    # view, a saved tensor or a caller's reference.
    return _use_count is None or _use_count(t.untyped_storage()._cdata) > 2


def all_to_all(
    tensor: torch.Tensor,
    *,
    input_splits: list[int],
    output_splits: list[int],
    group: Optional[ProcessGroup],
    what: str = "an all-to-all of a sharded EmbeddingBagCollection",
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """all_to_all_single of a 1-D tensor with element splits (no autograd); `what` names it in
    the error raised when it fails (Note [a failed peer]). Receives into `out` when given."""
    if out is None:
        out = tensor.new_empty(sum(output_splits))
    try:
        dist.all_to_all_single(
            out, tensor.contiguous(), output_splits, input_splits, group=group
        )
    except RuntimeError as e:
        raise_failed(what, group, e)
    return out


class _PooledAllToAll(torch.autograd.Function):
    """Moves pooled embeddings; backward moves their gradients back, divided by the world size.

    # Note [grad scaling across ranks]
    Each rank's loss is computed on its own batch, and the global objective is their mean (the
    convention of DDP and FSDP). A sharded table receives, through this function's backward, the
    sum over ranks of d loss_r / d w, so the backward divides by the world size; data-parallel
    tables take the same 1/W themselves (Note [dense replicas], Note [fused replicas]).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        tensor: torch.Tensor,
        input_splits: list[int],
        output_splits: list[int],
        group: Optional[ProcessGroup],
        grad_scale: float,
        buffers: Optional[KeptBuffers],
        wire: Optional[torch.dtype],
    ) -> torch.Tensor:
        ctx.splits = (input_splits, output_splits)
        ctx.group = group
        ctx.grad_scale = grad_scale
        ctx.shape = tensor.shape
        ctx.buffers = buffers
        ctx.wire = wire
        dtype = tensor.dtype
        if wire is not None:  # Note [low-precision comms]
            tensor = tensor.to(wire)
        out = buffers.empty("pooled", sum(output_splits), tensor) if buffers else None
        out = all_to_all(
            tensor.reshape(-1), input_splits=input_splits, output_splits=output_splits, group=group,
            what="the output-dist all-to-all of pooled embeddings", out=out,
        )
        return out if wire is None else out.to(dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        input_splits, output_splits = ctx.splits
        buffers = ctx.buffers
        dtype = grad.dtype
        if ctx.wire is not None:
            grad = grad.to(ctx.wire)
        out = buffers.empty("pooled grad", sum(input_splits), grad) if buffers else None
        out = all_to_all(
            grad.contiguous(), input_splits=output_splits, output_splits=input_splits,
            group=ctx.group, what="the backward all-to-all of pooled-embedding gradients", out=out,
        )
        if ctx.wire is not None:
            out = out.to(dtype)
        if ctx.grad_scale != 1.0:
            out.mul_(ctx.grad_scale)
        return out.view(ctx.shape), None, None, None, None, None, None


def pooled_all_to_all(
    tensor: torch.Tensor,
    *,
    input_splits: list[int],
    output_splits: list[int],
    group: Optional[ProcessGroup],
    grad_scale: float,
    buffers: Optional[KeptBuffers] = None,
    wire: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Differentiable all_to_all of a tensor flattened to 1-D; see Note [grad scaling across ranks].
    With `buffers`, both directions receive into kept buffers (Note [kept receive buffers]).

    # Note [low-precision comms]
    With `wire` (FP16 or BF16, TorchRec's "qcomms"), both directions travel in that dtype, half
    the bytes of FP32: the pooled embeddings are rounded to it once before the all-to-all and
    widened back to the tensor's dtype on arrival, so row-wise partial sums are added in FP32
    (`Arrival`), and the gradients likewise, scaled by `grad_scale` after widening. Each value
    is rounded once per direction: a relative error of at most 2**-11 (FP16, in its normal range)
    or 2**-8 (BF16) per pooled value, which tests/modular/test_low_precision.py checks against
    FP32 comms. FP16's range ends at 65504: a pooled sum beyond it becomes inf (BF16 has FP32's
    range)."""
    if torch.is_grad_enabled() and not tensor.requires_grad:
        # The backward is a collective too, so every rank must run it once its peers do. A rank
        # that looks up nothing trainable (it holds no shard of the module) sends an input without
        # a grad_fn; its output would then have none either, its backward would never reach this
        # all-to-all, and the ranks that do would wait for it forever.
        tensor = tensor.detach().requires_grad_()
    return _PooledAllToAll.apply(
        tensor, input_splits, output_splits, group, grad_scale, buffers, wire
    )


def all_gather(
    tensor: torch.Tensor,
    *,
    group: Optional[ProcessGroup],
    world: int,
    what: str = "an all-gather of a sharded EmbeddingBagCollection",
) -> torch.Tensor:
    """Every rank's `tensor` (the same shape on every rank), stacked: (world, *tensor.shape)."""
    out = tensor.new_empty(world, *tensor.shape)
    try:
        dist.all_gather(list(out.unbind(0)), tensor.contiguous(), group=group)
    except RuntimeError as e:
        raise_failed(what, group, e)
    return out


def all_gather_padded(
    pieces: list[torch.Tensor], size: int, group, world: int, dtype: torch.dtype, device
) -> torch.Tensor:
    """All-gathers 1-D data of different lengths per rank (gloo needs equal ones): each rank's
    pieces, back to back, padded to `size`; returns (world, size). Buffers are not zero-filled (a
    fresh 40 MB zeros costs more than the collective); only the padding is."""
    padded = torch.empty(size, dtype=dtype, device=device)
    used = 0
    for p in pieces:
        padded[used : used + p.numel()] = p
        used += p.numel()
    padded[used:].zero_()
    return all_gather(padded, group=group, world=world, what=f"an all-gather of {size} values")


def all_gather_bytes(payload: bytes, *, width: int, group: Optional[ProcessGroup]) -> list[bytes]:
    """Gathers a fixed-width byte string from every rank (one small collective)."""
    if len(payload) != width:
        raise ValueError(f"payload must be {width} bytes, got {len(payload)}")
    mine = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(collective_device(group))
    out = all_gather(
        mine, group=group, world=dist.get_world_size(group), what=f"an all_gather of {width} bytes"
    )
    return [bytes(t.cpu().tolist()) for t in out]


def raise_shared_failure(
    failure: Optional[BaseException],
    failed: list[int],
    group: Optional[ProcessGroup],
    text: Callable[[BaseException], str] = str,
) -> Optional[tuple[int, str]]:
    """After a gather every rank joined showed which ranks `failed` (none: returns None at once),
    a second gather shares their messages (`text(failure)`): a rank that failed raises its own
    `failure`, the others get the first failing rank and its message back, to raise in their
    own words."""
    if not failed:
        return None
    messages: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(messages, None if failure is None else text(failure), group=group)
    if failure is not None:
        raise failure
    return failed[0], messages[failed[0]]


def collective_device(group: Optional[ProcessGroup]) -> torch.device:
    """The device of the tensors `group`'s collectives take: the current CUDA device where the
    group runs NCCL ("nccl", or "cpu:gloo,cuda:nccl" from `init_process_group()` with no
    backend on a GPU machine), else the CPU (gloo)."""
    if backend_for("cuda", dist.get_backend_config(group)) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def backend_for(device_type: str, config: str) -> Optional[str]:
    """The backend a process group runs `device_type`'s collectives on, from its backend config:
    "gloo" (every device), or "cpu:gloo,cuda:nccl" as `init_process_group()` with no backend
    makes; None if it has none for that device."""
    if ":" not in config:
        return config
    for pair in config.split(","):
        device, _, backend = pair.partition(":")
        if device.strip() == device_type:
            return backend.strip()
    return None
