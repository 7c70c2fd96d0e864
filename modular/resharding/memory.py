"""Host memory during a reshard: new shards whose pages are taken only as blocks are written into
them, round buffers given back when freed, and old shards whose pages are given back once their
blocks are in the new ones (Note [resharding in memory] in modular/resharding/__init__.py says
when).

# Note [reshard memory]
fbgemm's kernels own their buffers: one flat weights buffer per kernel (and one per optimizer
state), so a rank whose kernel gains or loses a table gets a new buffer that holds the shards it
keeps too. Built the ordinary way, beside the old one, the new buffer is filled at construction
(the dense TBE with randn, the fused one with zeros), and a rank held, beside its old shards, the
bytes it receives plus all its new shards (1 table of 1M x 64 moved onto a rank holding 2:
976.6 MiB, where issue 39 allows 488.3). Three things bring that down to the bytes it receives
plus its largest moved block, on CPU under Linux:

  * `uncommitted()`: while the new module is built, a CPU `torch.zeros` or `torch.randn` of 1 MiB
    or more is a private anonymous mapping instead, whose pages the OS gives on first write and
    which reads as zeros until then (POSIX). A zeros buffer is what fbgemm asked for; a randn
    one (the dense TBE's weights) is overwritten anyway, since the blocks write every element
    of every new shard once (tests/modular/test_reshard.py checks both). So a new shard takes
    memory only as the blocks that arrive and the blocks that stay are written into it.
  * `scratch()`: each round's send and receive buffers (`exchange.rounds` bounds them by the
    largest moved block) are mappings of their own too, given back when freed: a buffer of a
    few MiB freed into malloc's heap stays resident and would count in the peak after it.
  * `Releaser`: once every rank has every block it receives (the reshard's last agreement), the
    old shards' values are needed only for the blocks the rank keeps. Those are copied row chunk
    by row chunk (`KEEP_CHUNK_BYTES`), and each chunk of the old shard is given back right after
    (madvise(MADV_DONTNEED) on the whole pages inside it), so the copy holds one chunk twice,
    not the whole kept shard; an old shard that was sent away is given back whole. Pages read
    as zeros afterwards, so this happens only past the point where the new modules replace the
    old ones (a failure there is Note [resharding in memory]'s "Keep"). Tensors sharing bytes
    with another are left alone, so a block still to be copied never reads zeros.

The growth of a rank's peak resident set is then at most what it receives plus the larger of one
round's buffers and one kept chunk; measured in docs/benchmarks.md ("reshard.py") and
tests/modular/test_reshard.py. One case stays over issue 39's bound: a rank that neither sends
nor receives but whose module is rebuilt (another rank's table moved) copies its kept shards
into new buffers, so it holds one chunk (1 MiB) where the bound says 0; only a kernel kept as it
is (not done: the new module's tables would share tensors with the retired old ones) avoids it. Elsewhere (a GPU, another OS) all three are skipped: the new
modules' buffers are allocated when they are built, and the old shards are freed when the old
modules are dropped after the swap, so a rank holds its old and new shards side by side (the
bytes it receives plus all its new shards beyond its old ones): a GPU caching allocator cannot
give back part of a buffer, and a flat buffer per kernel cannot adopt a kept shard's storage.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import sys
from typing import Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["KEEP_CHUNK_BYTES", "Releaser", "scratch", "uncommitted"]

KEEP_CHUNK_BYTES = 1 << 20  # a kept block is copied this many bytes of rows at a time
_LAZY_FROM_BYTES = 1 << 20  # smaller buffers are allocated as usual
_PAGE = mmap.PAGESIZE
_ON_LINUX = sys.platform.startswith("linux")


def _lazy_zeros(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """Zeros whose pages are taken only when written (a private anonymous mapping)."""
    nbytes = shape.numel() * torch.empty(0, dtype=dtype).element_size()
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buffer, dtype=dtype).view(shape)  # the tensor keeps `buffer` alive


def scratch(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised 1-D buffer for one round of the exchange. On CPU under Linux a mapping of
    its own, so that its pages go back to the kernel when it is freed: from malloc's heap, a
    freed buffer of a few MiB stays resident and would count in the peak of what follows."""
    if device.type != "cpu" or not _ON_LINUX or numel == 0:
        return torch.empty(numel, dtype=dtype, device=device)
    return _lazy_zeros(torch.Size((numel,)), dtype)


class _Uncommitted(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in (torch.zeros, torch.randn) or not _plain(kwargs):
            return func(*args, **kwargs)
        meta = func(*args, **{**kwargs, "device": "meta", "requires_grad": False})
        if meta.numel() * meta.element_size() < _LAZY_FROM_BYTES:
            return func(*args, **kwargs)
        out = _lazy_zeros(meta.shape, meta.dtype)
        return out.requires_grad_(True) if kwargs.get("requires_grad") else out


def _plain(kwargs: dict) -> bool:
    """A strided, unpinned CPU tensor, without `out=` or a generator of its own."""
    device = kwargs.get("device")
    device = torch.get_default_device() if device is None else torch.device(device)
    return (
        device.type == "cpu"
        and kwargs.get("layout", torch.strided) is torch.strided
        and not kwargs.get("pin_memory")
        and kwargs.get("out") is None
        and kwargs.get("generator") is None
    )


@contextlib.contextmanager
def uncommitted(device: torch.device) -> Iterator[None]:
    """Large CPU `torch.zeros`/`torch.randn` inside are zeros that take pages only as they are
    written (Note [reshard memory]); elsewhere nothing changes."""
    if device.type != "cpu" or not _ON_LINUX:
        yield
        return
    with _Uncommitted():
        yield


class Releaser:
    """Gives the pages of old shards back to the kernel (Note [reshard memory]). Only tensors
    whose bytes no other of `tensors` shares are released, so that a block still to be copied
    can never read zeros."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._madvise = _madvise() if _ON_LINUX else None
        spans = sorted(_span(t) for t in tensors if _releasable(t))
        self._ok: set[tuple[int, int]] = set()
        reach = -1  # the furthest end of the spans before
        for k, (lo, hi) in enumerate(spans):
            nxt = spans[k + 1][0] if k + 1 < len(spans) else hi
            if reach <= lo and hi <= nxt:
                self._ok.add((lo, hi))
            reach = max(reach, hi)

    def release(self, tensor: torch.Tensor, first_row: int, end_row: int) -> None:
        """Gives back the whole pages inside rows [first_row, end_row) of `tensor`, whose values
        are read as zeros afterwards."""
        if self._madvise is None or _span(tensor) not in self._ok or end_row <= first_row:
            return
        row = tensor[0].numel() * tensor.element_size() if tensor.dim() > 1 else tensor.element_size()
        start = tensor.data_ptr() + first_row * row
        lo = -(-start // _PAGE) * _PAGE
        hi = (start + (end_row - first_row) * row) // _PAGE * _PAGE
        if hi > lo:
            self._madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), mmap.MADV_DONTNEED)


def _span(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def _releasable(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.is_contiguous() and t.numel() > 0


def _madvise() -> Optional[object]:
    libc = ctypes.CDLL(None, use_errno=True)
    call = libc.madvise
    call.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    call.restype = ctypes.c_int
    return call
