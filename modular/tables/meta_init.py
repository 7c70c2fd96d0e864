"""A meta table's shards, filled by its config's `init_fn`: once on the whole table where it fits
(the unsharded module's values), once per shard where it does not (Note [shard init])."""

from __future__ import annotations

import contextlib
import hashlib
import logging
from typing import Callable, Iterator

import torch

from modular.errors import ShardingError
from planners.types import ShardSpec

__all__ = [
    "WHOLE_TABLE_INIT_BYTES", "init_meta_table", "initialised_whole", "shard_seed", "table_seed",
]

logger = logging.getLogger(__name__)

# The largest meta table (rows x columns x bytes per weight) whose init_fn runs on the whole
# table, on each rank that holds a piece of it (Note [shard init]). A module constant, not a
# rank's free memory, so that every rank takes the same path for a table.
WHOLE_TABLE_INIT_BYTES = 1 << 30


def initialised_whole(num_embeddings: int, embedding_dim: int, dtype: torch.dtype) -> bool:
    """Whether a meta table of this shape and dtype runs its init_fn on the whole table."""
    size = num_embeddings * embedding_dim * torch.empty((), dtype=dtype).element_size()
    return size <= WHOLE_TABLE_INIT_BYTES


@torch.no_grad()
def init_meta_table(
    init_fn: Callable[[torch.Tensor], object],
    pieces: list[tuple[ShardSpec, torch.Tensor]],
    *,
    table: str,
    shape: tuple[int, int],
    module: str,
) -> None:
    """Fills this rank's `pieces` (each shard's spec and its tensor) of meta table `table` of
    `shape` with `init_fn` (Note [shard init])."""
    first = pieces[0][1]
    if not initialised_whole(*shape, first.dtype):
        logger.info(
            "table %r of module %r (%s rows x %s columns) is over %s bytes: its init_fn runs once "
            "per shard, so its values are not those an unsharded module would draw "
            "(Note [shard init])", table, module, shape[0], shape[1], WHOLE_TABLE_INIT_BYTES,
        )  # fmt: skip
        for spec, view in pieces:
            with _seeded(shard_seed(table, spec), view.device):
                _call(init_fn, view, table=table, module=module, what=_shard_words(spec, view))
        return
    # A piece that is the whole table (table-wise, a data-parallel copy) is filled in place.
    whole = first if len(pieces) == 1 and tuple(first.shape) == shape else None
    full = torch.empty(shape, dtype=first.dtype, device=first.device) if whole is None else whole
    with _seeded(table_seed(table), full.device):
        _call(init_fn, full, table=table, module=module, what=f"the whole table (shape {shape})")
    if whole is None:
        for spec, view in pieces:
            rows = slice(spec.row_offset, spec.row_offset + spec.num_rows)
            view.copy_(full[rows, spec.col_offset : spec.col_offset + spec.num_cols])


def _call(init_fn, tensor: torch.Tensor, *, table: str, module: str, what: str) -> None:
    try:
        init_fn(tensor)
    except Exception as e:
        raise ShardingError(
            f"init_fn of table {table!r} of module {module!r} failed on {what}: "
            f"{type(e).__name__}: {e}. init_fn is called once on the whole table when it "
            f"takes at most {WHOLE_TABLE_INIT_BYTES} bytes, else once per shard with that "
            "shard's (rows, columns) tensor (Note [shard init])"
        ) from e


def _shard_words(spec: ShardSpec, view: torch.Tensor) -> str:
    return (
        f"the shard of rows {spec.row_offset}:{spec.row_offset + spec.num_rows}, columns "
        f"{spec.col_offset}:{spec.col_offset + spec.num_cols} (shape {tuple(view.shape)})"
    )


@contextlib.contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Draws from generators seeded by `seed`, then restores the caller's: only the CPU's and
    `device`'s CUDA one (torch.manual_seed would reseed every GPU)."""
    on_cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if on_cuda else [], device_type="cuda"):
        torch.random.default_generator.manual_seed(seed)
        if on_cuda:
            torch.cuda.default_generators[device.index].manual_seed(seed)
        yield


def table_seed(table: str) -> int:
    """The seed a meta table's init_fn draws from when it runs on the whole table."""
    return _seed(f"{torch.initial_seed()}/{table}")


def shard_seed(table: str, spec: ShardSpec) -> int:
    """# Note [shard init]
    A meta table's values come from its config's `init_fn` (torchrec builds one from
    `weight_init_min` / `weight_init_max` when the config has none, so those are honoured through
    it). Where the whole table takes at most `WHOLE_TABLE_INIT_BYTES`, every rank that holds a
    piece of it allocates it whole for a moment, calls `init_fn` on it once, as torchrec's
    unsharded module does, and copies its shards out: a table-wise table or a data-parallel copy is
    filled in place. Its values are then the unsharded module's wherever `init_fn` decides them itself (a
    seeded init_fn, pretrained rows), and the same under every plan and world size. An init_fn that
    draws from torch's global generator draws from one seeded by `table_seed` (the base seed,
    `torch.initial_seed()`, and the table's name), so every rank holding a piece draws the same
    table; an unsharded module, which draws its tables one after another from one stream, gives
    other values from the same distribution.

    A larger table is never materialised: `init_fn` runs once per shard, on that shard's
    (rows, columns) tensor, so its values differ from an unsharded module's even for a seeded
    init_fn (logged at INFO). Drawing each shard from the global RNG would repeat one stream in
    every shard (ranks are usually seeded alike); instead each shard draws from a stream seeded
    by the base seed, the table and the shard's offsets, so shards are independent and a shard
    gets the same values whichever rank (or plan size) holds it. Both paths are decided from the
    table's shape and dtype, the same on every rank. docs/table_configs.md states the rule."""
    return _seed(f"{torch.initial_seed()}/{table}/{spec.row_offset}/{spec.col_offset}")


def _seed(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1
