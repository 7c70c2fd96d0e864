"""Filling a sharded module's local shards: copied from the unsharded weights, or `init_fn` on
meta tables (modular/tables/meta_init.py); every rank raises when one could not (Note [agreeing
on the shards' init]), and warns when the ranks copied from tables that differ."""

from __future__ import annotations

import warnings
from typing import Optional

import torch
from torch.distributed import ProcessGroup
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from modular.comm import all_gather_bytes, broadcast, raise_shared_failure
from modular.errors import ShardingError
from modular.tables.layout import Layout, RankLayout
from modular.tables.meta_init import init_meta_table, shard_seed
from planners.types import ShardingType, ShardSpec

__all__ = ["agree_on_init", "fill_local_shards", "init_shards", "shard_seed", "weights_fingerprints"]


@torch.no_grad()
def init_shards(
    ebc: EmbeddingBagCollection,
    views: dict[tuple[str, int], torch.Tensor],
    copies: list[torch.Tensor],
    *,
    at: RankLayout,
) -> None:
    """Fills this rank's shards (`views`) from `ebc`'s weights or init_fn; a failure on any rank
    is raised on every rank (Note [agreeing on the shards' init]); data-parallel `copies` then
    take rank 0's values, so they start equal everywhere. A module `modular.reshard` builds is
    filled by the blocks it moved instead, and never comes here (`LocalShards.build_tables`,
    Note [resharding in memory] in modular/resharding/__init__.py)."""
    failure: Optional[BaseException] = None
    try:
        fill_local_shards(ebc, views, layout=at.layout, module=at.module)
    except Exception as e:
        failure = e
    if at.local:
        if failure is not None:
            raise failure
        return
    # Shards are copied from each rank's own copy of a table, data-parallel copies broadcast below.
    copied = [
        t.name
        for t, p in zip(at.layout.tables, at.layout.placements)
        if p.sharding_type is not ShardingType.DATA_PARALLEL
    ]
    agree_on_init(failure, at.module, at.group, ebc, copied)
    for view in copies:
        broadcast(view.data, src=0, group=at.group,
                  what=f"module {at.module!r}'s data-parallel copies from rank 0")  # fmt: skip


def fill_local_shards(
    ebc: EmbeddingBagCollection, views: dict[tuple[str, int], torch.Tensor], *, layout: Layout,
    module: str,
) -> None:
    """Copies each local shard (`views`, by (table, shard index)) from `ebc`'s weights, or runs
    the table's init_fn on it where the table is on meta (Note [shard init])."""
    configs = ebc.embedding_bag_configs()
    on_meta: dict[str, list[tuple[ShardSpec, torch.Tensor]]] = {}
    for (table, j), view in views.items():
        t = layout.table_index(table)
        spec = layout.shards[t][j]
        source = ebc.embedding_bags[table].weight
        if source.is_meta:
            on_meta.setdefault(table, []).append((spec, view))
        else:
            view.copy_(
                source[
                    spec.row_offset : spec.row_offset + spec.num_rows,
                    spec.col_offset : spec.col_offset + spec.num_cols,
                ]
            )
    for table, pieces in on_meta.items():
        info = layout.tables[layout.table_index(table)]
        init_fn = configs[layout.table_index(table)].init_fn
        if init_fn is None:
            raise ShardingError(f"table {table!r} of {module!r} has no init_fn")
        shape = (info.num_embeddings, info.embedding_dim)
        init_meta_table(init_fn, pieces, table=table, shape=shape, module=module)


def agree_on_init(
    failure: Optional[BaseException],
    module: str,
    group: Optional[ProcessGroup],
    ebc: EmbeddingBagCollection,
    copied: list[str],
) -> None:
    """# Note [agreeing on the shards' init]
    Each rank fills its own shards (a user's `init_fn` on a meta table, or a copy of the
    materialised weights), then the tables become ShardedTensors, which is collective. A rank
    whose init_fn raised would leave the others waiting there until the process group's timeout,
    so every rank first joins one all-gather of a flag; if any rank failed, a second gather
    shares the messages and every rank raises (its own error, or the failing rank's). Nothing has
    been replaced in the model by then (`modular.shard` swaps modules in after building all).

    The same gather carries each rank's fingerprints of `ebc`'s tables named in `copied` (the
    ones its shards were copied from), and every rank warns where they differ (Note [weights
    that differ between ranks])."""
    prints = bytes(FINGERPRINT_WIDTH * len(copied))  # a failed rank's: the same width
    if failure is None:
        try:
            prints = weights_fingerprints([ebc.embedding_bags[n].weight for n in copied])
        except Exception as e:
            failure = e
    flag = b"\x00" if failure is None else b"\x01"
    payloads = all_gather_bytes(flag + prints, width=1 + len(prints), group=group)
    failed = [r for r, p in enumerate(payloads) if p[0] == 1]
    shared = raise_shared_failure(failure, failed, group, lambda e: f"{type(e).__name__}: {e}")
    if shared is not None:
        first, message = shared
        raise ShardingError(
            f"module {module!r}: rank {first} could not initialise its shards: {message} (ranks "
            f"{failed} failed; this rank stops too so that no rank hangs)"
        )
    _warn_if_weights_differ(module, copied, [p[1:] for p in payloads])


# Rows of a table compared between ranks (Note [weights that differ between ranks]).
FINGERPRINT_ROWS = 16
FINGERPRINT_WIDTH = 1 + 2 * 8  # a flag (materialised), two float64 sums


def weights_fingerprints(weights: list[torch.Tensor]) -> bytes:
    """# Note [weights that differ between ranks]
    A materialised table is copied into the shards from each rank's own copy of it, so ranks
    whose copies differ (seeded differently, or pretrained weights loaded on one rank only) give
    a sharded table that mixes them and equals no rank's unsharded model, silently. So each rank
    sends, in the init agreement's gather, per sharded table: whether it is materialised, and
    two float64 sums (plain and position-weighted) over `FINGERPRINT_ROWS` evenly spaced rows;
    equal copies give equal sums bit for bit (the same ops on the same values), copies seeded
    apart differ in every row. `_warn_if_weights_differ` names the tables and ranks. A warning,
    not an error: a model about to load a checkpoint may start from any weights. Data-parallel
    tables need none of it (rank 0's copies are broadcast), nor do meta tables (their
    shards run `init_fn`: Note [shard init])."""
    out = bytearray()
    for w in weights:
        if w.is_meta:
            out += bytes(FINGERPRINT_WIDTH)
            continue
        rows = w.shape[0]
        pick = torch.linspace(0, max(rows - 1, 0), min(FINGERPRINT_ROWS, rows), device=w.device)
        sample = w.detach().index_select(0, pick.long()).double().reshape(-1)
        ramp = torch.linspace(1.0, 2.0, sample.numel(), dtype=torch.float64, device=w.device)
        sums = torch.stack([sample.sum(), (sample * ramp).sum()]).cpu()
        out += b"\x01" + sums.numpy().tobytes()
    return bytes(out)


def _warn_if_weights_differ(module: str, tables: list[str], payloads: list[bytes]) -> None:
    """Warns, naming the tables and ranks, where the ranks' `weights_fingerprints` differ."""
    problems = []
    for i, table in enumerate(tables):
        cut = slice(i * FINGERPRINT_WIDTH, (i + 1) * FINGERPRINT_WIDTH)
        prints = [p[cut] for p in payloads]
        meta = [r for r, p in enumerate(prints) if p[0] == 0]
        if len(meta) == len(prints):
            continue
        if meta:
            problems.append(
                f"table {table!r} is on the meta device on ranks {meta} (their shards run "
                f"init_fn) and materialised on ranks "
                f"{[r for r in range(len(prints)) if r not in meta]} (their shards are copied)"
            )
            continue
        groups: dict[bytes, list[int]] = {}
        for r, p in enumerate(prints):
            groups.setdefault(p, []).append(r)
        if len(groups) > 1:
            problems.append(
                f"table {table!r} holds different weights on ranks "
                + " and ".join(str(g) for g in groups.values())
            )
    if problems:
        warnings.warn(
            f"modular.shard of module {module!r}: " + "; ".join(problems) + f" (compared on "
            f"{FINGERPRINT_ROWS} sampled rows). Each rank fills its shards from its own copy of "
            "the model, so these sharded tables mix the ranks' copies and match no rank's "
            "unsharded model. Seed every rank alike before building the model, load pretrained "
            "weights on every rank, or build every rank's model on the meta device; nothing to "
            "do if a checkpoint is loaded into the sharded model next "
            "(Note [weights that differ between ranks])",
            stacklevel=7,  # the caller of modular.shard
        )
