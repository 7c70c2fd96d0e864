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
    of every new shard once (tests/modular/resharding/test_reshard.py checks both). So a new shard takes
    memory only as the blocks that arrive and the blocks that stay are written into it.
  * `scratch()`: each round's send and receive buffers (`rounds.rounds` bounds them by the
    largest moved block) are mappings of their own too, given back when freed: a buffer of a
    few MiB freed into malloc's heap stays resident and would count in the peak after it.
  * `Releaser`: once every rank has every block it receives (the reshard's last agreement), the
    old shards' values are needed only for the blocks the rank keeps. Those are copied row chunk
    by row chunk (`KEEP_CHUNK_BYTES`), and each chunk of the old shard is given back right after
    (madvise(MADV_DONTNEED) on the whole pages inside it), so the copy holds one chunk twice,
    not the whole kept shard; an old shard that was sent away is given back whole. Pages read
    as zeros afterwards, so this happens only once the new modules have replaced the old ones
    (a failure there is Note [resharding in memory]'s "Keep"), and only for an old storage that
    nothing but the mover can see. Tensors sharing bytes with another are left alone, so a
    block still to be copied never reads zeros.

What else may see an old storage: a user's `state_dict()` (its ShardedTensors and DTensors wrap
new detached tensors on the shards' storages), a view of a shard, the old parameter objects, a
torch optimizer over the old `local_parameters`, the last step's loss (its autograd graph holds
the old kernels until it is dropped), a Python storage object. Each of those is a tensor of its
own on the storage, or keeps one alive (a shard's view keeps its kernel's flat buffer), so it
counts in the storage's use count (`torch._C._storage_Use_Count`, torch 2.13), or it is a
reference to the storage's Python object. So the mover swaps the new modules in and drops the
old ones (and their readers) first, and holds each old shard and state only through one
`detach()`ed tensor of its own (`Kept`), which no one else can hold; an old storage is given
back only where its use count is exactly the mover's tensors on it (plus the storage object the
check itself makes) and nothing else refers to that storage object. Anything more, or any doubt,
keeps the storage whole: its values stay as they were, the blocks kept from it are copied beside
it (the peak goes over the bound by them), and it is freed when its last holder goes; `reshard`
warns once per call, naming the tables and both sizes. An old module in a reference cycle (its
prefetcher holds it) outlives the drop until the collector runs, so where an old module's insides
(its `ShardedCollection`, weakly referenced) outlived it, a storage that looks held is counted
again after `gc.collect()` (0.2 s in a process that imported torchrec, so not otherwise). A
rank that releases nothing (a GPU, another OS) does not check or warn.

Kernels that stay are adopted, not copied (`Adoption`, modular/resharding/adopt.py): a local
kernel whose shards are all the same on this rank in both layouts (its kernel group: tables,
shard indices, row and column ranges, routes; its sizes; and each of its tables cut as before,
which decides the kernel's kind and dtype) is moved into the new module as it is, with its
buffers, its optimizer state and its replica sync. Its blocks are neither copied nor given back
(`kept_blocks` leaves them out; `Kept.adopted` marks an adopted tensor that another new shard
still reads from), so a rank whose module is rebuilt only because another rank's table moved
copies nothing. Its tables' ShardedTensors and DTensors are made anew on the new layout over
the same local tensors; a fused module's step count object passes to the new module (the Adam
family's kernels read it); an adopted dense kernel gets new parameter objects on the same
storage, so that the old ones are retired and an optimizer built before the reshard raises on
every rank alike.

Where nothing else holds the old shards, the growth of a rank's peak resident set is then at
most what it receives plus the larger of one round's buffers and one kept chunk; measured in
docs/benchmarks.md ("reshard.py") and tests/modular/resharding/test_reshard.py: a rank that neither sends
nor receives (world 3, one table moved) copies nothing, where copying its kept shards took a 1
MiB chunk (2.0-2.1 MiB measured). What it still grows by is no shard's: 192 KiB of libtorch's
code (libtorch_cpu.so 128, libtorch_python.so 64), file pages that the first all_to_all_single
of a process maps in whatever its splits (an empty one too), clean and shared by the ranks
(Pss_File +64 KiB on each of 3), which any training step's output dist has mapped before, and
30-50 KiB of Python heap where the new module's objects are built beside the old ones until the
commit (no shard bytes: its kernels are adopted). Processes that never ran an all-to-all show
both (0.23 MiB); the benchmark's and the test's ranks train a step first and show the heap (0-64
KiB). Every rank of the group joins every round's all-to-all, as a collective must, so the code
pages come with the call. Elsewhere (another OS) the three above are skipped: the new modules'
buffers are allocated when they are built, and the old shards are freed when the old modules are
dropped after the swap.

On a device (any but CPU; `staging.stages`), the three do not apply and a kernel that gains or
loses a table is rebuilt whole: a caching allocator cannot give back part of a buffer, and a flat
buffer per kernel cannot adopt a kept shard's storage. So the old storages of the kernels that no
new module can adopt (`Adoption.candidate_shards` are left alone) pass through host memory
(`Staged`, modular/resharding/host_staging.py): before the build, each is copied into a host storage
and freed in place (`resize_(0)`: every tensor on it, views and fbgemm's own included, stays the
same object and is whole again after `resize_` and a copy back), and the move and `keep` read
their blocks from host tensors over those copies. A failure before the commit gives every freed
storage its bytes back; after the swap, those that something besides the mover holds (the check
above, on the one tensor the mover keeps per storage) get theirs back and are warned about, so
that they read what they read. The new modules are then built the ordinary way, on the memory
the old kernels gave back: the device grows by the growth of the rebuilt kernels (at most what
the rank receives) plus one round's buffers. The held check runs after the swap only (before it
the old module's own references hide others'), so a reader on another thread or stream during
the call would read freed memory. Tests run the path on CPU ranks (`_STAGE_THROUGH_HOST`); the
new modules are then built without `uncommitted`, whose mappings cannot be resized. It has never
run on a GPU, so it is off by default (`_STAGE_THROUGH_HOST = False`) until a GPU session has
checked it (docs/resharding.md, "Memory", says what to check and measure).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import mmap
import sys
from typing import Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["KEEP_CHUNK_BYTES", "Releaser", "scratch", "sole_holders", "uncommitted"]

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
    """Gives the pages of old shards back to the kernel (Note [reshard memory]). `tensors` are
    the only tensors the caller holds on their storages. Only tensors whose bytes no other of
    `tensors` shares, so that a block still to be copied can never read zeros, and whose storage
    nothing but `tensors` holds (`held_outside`) are released."""

    def __init__(self, tensors: list[torch.Tensor], *, collect: bool) -> None:
        self._madvise = _madvise() if _ON_LINUX else None
        self._outside = _held_outside(tensors, collect) if self._madvise is not None else set()
        spans = sorted(_span(t) for t in tensors if _releasable(t))
        self._ok: set[tuple[int, int]] = set()
        reach = -1  # the furthest end of the spans before
        for k, (lo, hi) in enumerate(spans):
            nxt = spans[k + 1][0] if k + 1 < len(spans) else hi
            if reach <= lo and hi <= nxt:
                self._ok.add((lo, hi))
            reach = max(reach, hi)

    def held_outside(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor`'s storage, which would have been given back, was kept whole because
        something besides the caller's tensors holds it."""
        return _storage_key(tensor) in self._outside

    def release(self, tensor: torch.Tensor, first_row: int, end_row: int) -> None:
        """Gives back the whole pages inside rows [first_row, end_row) of `tensor`, whose values
        are read as zeros afterwards."""
        if self._madvise is None or end_row <= first_row or _span(tensor) not in self._ok:
            return
        if _storage_key(tensor) in self._outside:  # kept whole: someone else reads it
            return
        row = tensor[0].numel() * tensor.element_size() if tensor.dim() > 1 else tensor.element_size()
        start = tensor.data_ptr() + first_row * row
        lo = -(-start // _PAGE) * _PAGE
        hi = (start + (end_row - first_row) * row) // _PAGE * _PAGE
        if hi > lo:
            self._madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), mmap.MADV_DONTNEED)


def _held_outside(tensors: list[torch.Tensor], collect: bool) -> set[int]:
    """The storages (by `_storage_key`) of `tensors` that something else holds too: another
    tensor on them (a view, a parameter, a `state_dict()`'s detached tensors, an optimizer's
    params), each of which counts in the storage's use count, or a Python storage object. With
    `collect` (something of the old modules outlived their drop: a cycle, which only the
    collector frees, or a user's reference) a storage that looks held is looked at again after
    `gc.collect()`, which takes a good fraction of a second in a large process."""
    held = _extra_holders(tensors)
    if held and collect:
        gc.collect()
        held = _extra_holders(tensors)
    return held


def _extra_holders(tensors: list[torch.Tensor]) -> set[int]:
    """The storages of `tensors` with something to give back whose holders are more than the
    caller's tensors on them."""
    mine: dict[int, set[int]] = {}  # storage -> ids of the caller's tensors on it
    releasable: dict[int, torch.Tensor] = {}
    for t in tensors:
        key = _storage_key(t)
        mine.setdefault(key, set()).add(id(t))
        if _releasable(t):
            releasable.setdefault(key, t)
    sole_refs, sole_uses = _SOLE
    return {k for k, t in releasable.items() if _holders(t) != (sole_refs, sole_uses + len(mine[k]) - 1)}


def _holders(t: torch.Tensor) -> tuple[int, int]:
    """(Python references to `t`'s storage object, the storage's use count): with a storage
    object made here, the use count is one for it plus one per tensor on the storage (torch 2.13,
    `torch._C._storage_Use_Count`); references beyond `_SOLE`'s are someone else's."""
    storage = t.untyped_storage()
    return sys.getrefcount(storage), torch._C._storage_Use_Count(storage._cdata)


def sole_holders(t: torch.Tensor) -> bool:
    """Whether `t` is the only tensor on its storage and nothing else refers to that storage."""
    return _holders(t) == _SOLE


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


_SOLE = _holders(torch.empty(1))  # what one tensor alone on its storage shows


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
