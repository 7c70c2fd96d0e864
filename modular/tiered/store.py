"""The backing store of one tiered shard (Note [tiered tables] in modular/tiered/__init__.py)."""

from __future__ import annotations

import mmap
import os
import tempfile
import weakref

import numpy as np
import torch

__all__ = ["HostStore", "RowStore", "file_backed_like"]

_PAGE = mmap.PAGESIZE

# The directory of each store tensor, by its data pointer, while its store lives.
_DIRECTORIES: dict[int, str] = {}


class _Store:
    """What both stores share: `weights` (rows, cols) and `states` by name, moved a row and its
    state at a time."""

    weights: torch.Tensor
    states: dict[str, torch.Tensor]

    def _row_bytes(self, cols: int, state_shapes: dict[str, tuple[int, ...]]) -> int:
        """Bytes of one row and its state, as they move between the tiers."""
        return 4 * (cols + sum(int(np.prod(s[1:], dtype=np.int64)) for s in state_shapes.values()))

    def read(self, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The rows `ids` (sorted, so that files are read in order) and their state."""
        return self.weights[ids], {name: s[ids] for name, s in self.states.items()}

    def write(self, ids: torch.Tensor, rows: torch.Tensor, states: dict[str, torch.Tensor]) -> None:
        self.weights[ids] = rows.to(self.weights.dtype)
        for name, s in self.states.items():
            s[ids] = states[name]


class RowStore(_Store):
    """All rows of one shard and their fused optimizer state, in float32 files on local disk:
    `<prefix>.weight.npy` (rows, cols) and one `<prefix>.<state>.npy` per state, its shape in
    `state_shapes` ((rows,) for a per-row statistic, (rows, cols) per element). The files are
    mapped into memory (numpy memmaps): `weights` and `states` are tensors over them, which the
    module's table weight and the fused optimizer's state alias, so that reading or writing them
    goes through the page cache, never an anonymous copy of the shard. A row and its state move
    together (`read`, `write`). The files (and their directory,
    once empty) are removed when the store is collected."""

    def __init__(
        self, prefix: str, rows: int, cols: int, state_shapes: dict[str, tuple[int, ...]]
    ) -> None:
        self.prefix, self.rows, self.cols = prefix, rows, cols
        os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
        self.paths: list[str] = []
        self._maps: list[tuple[mmap.mmap, int, int]] = []  # (mapping, data offset, row bytes)
        self.weights = self._file("weight", (rows, cols))
        self.states = {name: self._file(name, shape) for name, shape in state_shapes.items()}
        self.row_bytes = self._row_bytes(cols, state_shapes)
        weakref.finalize(self, _remove, list(self.paths))

    def _file(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        path = f"{self.prefix}.{name}.npy"
        self.paths.append(path)
        # A new file of zeros (sparse on disk until written): fbgemm's fused states start at 0.
        array = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=shape)
        # A cache miss reads one row: without this, each page fault reads ahead 128 KiB or more
        # around it (measured: 224 GB read from disk before 20 steps of a 36 GiB DLRM).
        array._mmap.madvise(mmap.MADV_RANDOM)
        self._maps.append((array._mmap, array.offset, int(np.prod(shape[1:], dtype=np.int64)) * 4))
        tensor = torch.from_numpy(array)
        _DIRECTORIES[tensor.data_ptr()] = os.path.dirname(path) or "."
        weakref.finalize(self, _DIRECTORIES.pop, tensor.data_ptr(), None)
        return tensor

    def will_need(self, ids: torch.Tensor) -> None:
        """Asks the OS to read the pages of rows `ids` (and their state) in the background
        (madvise WILLNEED): a step's missing rows of every table are asked for at once, before
        any is read, so that the disk serves them in parallel instead of one page fault at a
        time (measured: 8,000 cold rows of 256 bytes read in 120 ms instead of 530)."""
        if ids.numel() == 0:
            return
        rows = np.sort(ids.numpy().astype(np.int64))
        for mapping, offset, row_bytes in self._maps:
            starts = (offset + rows * row_bytes) // _PAGE
            ends = (offset + (rows + 1) * row_bytes - 1) // _PAGE + 1  # exclusive
            # runs of touching pages, one call each: a run starts where a row's first page is
            # past every page before it (rows are sorted, so the ends only grow)
            reach = np.maximum.accumulate(ends)
            first = np.concatenate(([0], np.flatnonzero(starts[1:] > reach[:-1]) + 1))
            last = np.concatenate((first[1:] - 1, [rows.size - 1]))
            for lo, hi in zip(starts[first].tolist(), reach[last].tolist()):
                mapping.madvise(mmap.MADV_WILLNEED, lo * _PAGE, (hi - lo) * _PAGE)


class HostStore(_Store):
    """A GPU rank's backing store of one tiered shard: its rows and their optimizer state in
    pinned host memory (`RowStore`'s interface; Note [tiered tables])."""

    def __init__(self, rows: int, cols: int, state_shapes: dict[str, tuple[int, ...]]) -> None:
        pinned = torch.cuda.is_available()
        self.rows, self.cols = rows, cols
        self.weights = torch.zeros((rows, cols), pin_memory=pinned)
        self.states = {name: torch.zeros(shape, pin_memory=pinned) for name, shape in state_shapes.items()}
        self.row_bytes = self._row_bytes(cols, state_shapes)

    def will_need(self, ids: torch.Tensor) -> None:
        """Nothing to ask for: host memory is read at once."""


def _remove(paths: list[str]) -> None:
    for path in paths:
        try:
            os.remove(path)
        except OSError:  # already gone (the directory was cleaned up first)
            pass
    try:  # the directory `tiered_kernel` made, once its last store is gone
        os.rmdir(os.path.dirname(paths[0]))
    except OSError:
        pass


def file_backed_like(like: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype):
    """A new FP32 tensor of `shape` in a file beside `like`'s, where `like` is a store's tensor
    (None otherwise): what a checkpoint load stages a tiered shard in, instead of anonymous
    memory of the shard's size. The file is unlinked at once; its pages go with the tensor."""
    directory = _DIRECTORIES.get(like.data_ptr())
    if directory is None or dtype != torch.float32:
        return None
    fd, path = tempfile.mkstemp(prefix="staging.", suffix=".npy", dir=directory)
    os.close(fd)
    try:
        array = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=tuple(shape))
    finally:
        os.remove(path)
    return torch.from_numpy(array)
