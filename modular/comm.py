"""Collectives as free functions over torch.distributed.

Everything goes through `all_to_all_single` with explicit splits (gloo has no uneven
`all_to_all`), on contiguous tensors, so the same code runs on gloo/CPU and NCCL/GPU. On CPU each
returns only once gloo has let go of the tensors it was handed (Note [collectives release their
tensors]).
"""

from __future__ import annotations

import time
import weakref
from typing import Any, Callable, NoReturn, Optional

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from modular.errors import CollectiveError
from modular.profiling import OUTPUT_DIST_BACKWARD, labelled


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


# Note [collectives release their tensors]
# On gloo (torch 2.13) every collective, a synchronous one too, runs on one of its group's
# `pt_gloo_runloop` threads, and the work it runs holds the tensors it was handed. `wait()`
# returns once the work has completed, a moment before that thread drops its reference to the
# work. A tensor that Python let go of in between is kept alive by the work together with its
# Python object (torch keeps a tensor's PyObject while C++ still holds the tensor), so the gloo
# thread that drops the work then needs the GIL to free it. While the interpreter finalizes,
# CPython ends a thread that asks for the GIL with `pthread_exit`, and its forced unwinding
# through the work's `noexcept` destructor calls `std::terminate`: SIGABRT after a finished run
# (issue 40; the backtrace and a script with no project code in docs/troubleshooting.md). A
# collective in a step's last backward (the fused data-parallel copies' gathers, the pooled
# gradients' all-to-all) is the last thing a job does before it exits.
# So on CPU modular's collectives hand gloo aliases that nothing else references (`_Handed`:
# one view per tensor, watched by a weakref) and return only once each alias has been freed: by
# then no work holds a tensor of theirs, and what a gloo thread does afterwards needs no GIL.
# Usually the work is gone by the time the caller woke up and the aliases die on the spot; when
# the gloo thread was descheduled, the caller waits for it with the GIL released. A collective
# that failed raises at once: the exception's traceback keeps `_collective`'s frame, whose `work`
# keeps the work and its tensors past the gloo thread's reference, so they are freed by whoever
# frees the exception, with the GIL (at exit, the main thread). Not on CUDA: NCCL's
# watchdog holds a work until the GPU has run it, and waiting for that would stall the stream.
# tests/modular/test_collective_release.py checks it with a stand-in for a late gloo thread.

RELEASE_TIMEOUT_S = 60.0
"""How long a collective waits for gloo's work to free the tensors it was handed."""


class _Handed:
    """The aliases one collective hands gloo, and a wait until all of them have been freed
    (Note [collectives release their tensors])."""

    def __init__(self) -> None:
        # Emptied by the weakrefs' callbacks, on whichever thread frees an alias (GIL held).
        self._live: set[weakref.ref] = set()

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        alias = t.view(t.shape)
        self._live.add(weakref.ref(alias, self._live.discard))
        return alias

    def wait_freed(self, what: str) -> None:
        """Returns once every alias has been freed; sleeps meanwhile, so that a gloo thread
        that needs the GIL to free one gets it."""
        deadline = time.monotonic() + RELEASE_TIMEOUT_S
        while self._live and time.monotonic() < deadline:
            time.sleep(1e-4)
        if self._live:
            raise RuntimeError(
                f"{what}: gloo's work still held {len(self._live)} of its tensors "
                f"{RELEASE_TIMEOUT_S:.0f} s after it completed; see "
                "Note [collectives release their tensors] in modular/comm.py"
            )


def _as_is(t: torch.Tensor) -> torch.Tensor:
    return t


def _collective(
    what: str,
    group: Optional[ProcessGroup],
    like: torch.Tensor,
    start: Callable[[Callable[[torch.Tensor], torch.Tensor]], Any],
) -> None:
    """Runs one collective and waits for it: `start(hand)` starts it (`async_op=True`) on the
    tensors it passes through `hand`. On CPU (`like`'s device) also waits until gloo has freed
    them (Note [collectives release their tensors]); a failure raises `CollectiveError`."""
    handed = _Handed() if like.device.type == "cpu" else None
    work = None
    try:
        work = start(handed or _as_is)
        work.wait()
    except RuntimeError as e:
        raise_failed(what, group, e)  # its traceback keeps this frame, so `work`, alive
    del work
    if handed is not None:
        handed.wait_freed(what)


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
    send = tensor.contiguous()
    _collective(what, group, out, lambda hand: dist.all_to_all_single(
        hand(out), hand(send), output_splits, input_splits, group=group, async_op=True
    ))  # fmt: skip
    return out


class _PooledAllToAll(torch.autograd.Function):
    """Moves pooled embeddings; backward moves their gradients back, divided by the world size.

    # Note [grad scaling across ranks]
    Each rank's loss is computed on its own batch, and the global objective is their mean (the
    convention of DDP and FSDP). A sharded table receives, through this function's backward, the
    sum over ranks of d loss_r / d w, so the backward divides by the world size; data-parallel
    tables take the same 1/W themselves (Note [dense data-parallel copies], Note [fused
    data-parallel copies]).
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
    @labelled(OUTPUT_DIST_BACKWARD)  # Note [profiler labels] in modular/profiling.py
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
    or 2**-8 (BF16) per pooled value, which tests/modular/kernels/test_low_precision.py checks against
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
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Every rank's `tensor` (the same shape on every rank), stacked: (world, *tensor.shape).
    One output tensor (`all_gather_single`, flat: gloo wants each rank's piece in the input's
    shape), not a list of views of it; `out`: a buffer of at least world * numel elements to
    receive into (Note [kept receive buffers])."""
    if out is None:
        out = tensor.new_empty(world, *tensor.shape)
    else:
        out = out[: world * tensor.numel()].view(world, *tensor.shape)
    send = tensor.contiguous()
    _collective(what, group, out, lambda hand: dist.all_gather_single(
        hand(out.view(-1)), hand(send.view(-1)), group=group, async_op=True
    ))  # fmt: skip
    return out


def all_reduce(
    tensor: torch.Tensor,
    *,
    group: Optional[ProcessGroup],
    what: str,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
) -> None:
    """all_reduce of `tensor` in place; `what` names it in the error raised when it fails."""
    _collective(what, group, tensor, lambda hand: dist.all_reduce(
        hand(tensor), op=op, group=group, async_op=True
    ))  # fmt: skip


def broadcast(
    tensor: torch.Tensor, *, src: int, group: Optional[ProcessGroup], what: str
) -> None:
    """broadcast of `tensor` in place from `src`, a rank of `group` (its group rank); `what` names
    it in the error raised when it fails."""
    _collective(what, group, tensor, lambda hand: dist.broadcast(
        hand(tensor), group_src=src, group=group, async_op=True
    ) if group is not None else dist.broadcast(hand(tensor), src=src, async_op=True))  # fmt: skip


def send(tensor: torch.Tensor, *, dst: int, group: Optional[ProcessGroup], what: str) -> None:
    """Point-to-point send of `tensor` to `dst`, a rank of `group`."""
    _collective(what, group, tensor, lambda hand: dist.isend(hand(tensor), group=group, group_dst=dst))


def recv(tensor: torch.Tensor, *, src: int, group: Optional[ProcessGroup], what: str) -> None:
    """Point-to-point receive into `tensor` from `src`, a rank of `group`."""
    _collective(what, group, tensor, lambda hand: dist.irecv(hand(tensor), group=group, group_src=src))


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
