"""One table of a sharded EBC, as the model sees it: its `weight` under the unsharded name.

Also reads a torchrec EBC's tables (`table_infos`), refuses shard widths the device cannot
take (`check_widths_off_cpu`), seeds a meta table's shards (`shard_seed`), makes every rank
raise when one could not fill its shards (`agree_on_init`), warns when ranks copied their shards
from tables that differ (`weights_fingerprints`) and defines `ShardingError`.
"""

from __future__ import annotations

import hashlib
import warnings
from typing import Optional

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.modules.embedding_configs import DataType, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from modular._comm import all_gather_bytes, raise_shared_failure
from modular._layout import Layout, Pooling, TableInfo, odd_width
from planners.types import ShardingType, ShardSpec

__all__ = [
    "ShardedTable",
    "ShardingError",
    "agree_on_init",
    "check_widths_off_cpu",
    "shard_seed",
    "table_infos",
]


class ShardingError(ValueError):
    """A plan that does not fit the model or the process group; names the module, table or rank."""


def table_infos(ebc: EmbeddingBagCollection, module: str) -> tuple[TableInfo, ...]:
    """Reads the tables of a torchrec EBC, rejecting what sharding does not support."""
    infos = []
    for cfg in ebc.embedding_bag_configs():
        if cfg.data_type != DataType.FP32:
            raise ShardingError(
                f"table {cfg.name!r} of module {module!r} has data type {cfg.data_type.name}; "
                "only FP32 tables can be sharded"
            )
        if cfg.pooling not in (PoolingType.SUM, PoolingType.MEAN):
            raise ShardingError(
                f"table {cfg.name!r} of module {module!r} has pooling {cfg.pooling.name}; "
                "only SUM and MEAN are supported"
            )
        if cfg.pooling == PoolingType.MEAN and ebc.is_weighted():
            # torchrec's own forward raises on it (nn.EmbeddingBag takes per-sample weights only
            # with mode="sum"), and fbgemm's CPU TBE computes the weighted mean but leaves the
            # 1/length out of its gradient: refuse it rather than train a wrong table.
            raise ShardingError(
                f"table {cfg.name!r} of module {module!r} has MEAN pooling in a weighted "
                "EmbeddingBagCollection; per-sample weights work only with SUM pooling (torchrec's "
                "unsharded EBC refuses them too): use PoolingType.SUM or an unweighted EBC"
            )
        infos.append(
            TableInfo(
                name=cfg.name,
                num_embeddings=cfg.num_embeddings,
                embedding_dim=cfg.embedding_dim,
                features=tuple(cfg.feature_names),
                pooling=Pooling.SUM if cfg.pooling == PoolingType.SUM else Pooling.MEAN,
            )
        )
    return tuple(infos)


def check_widths_off_cpu(layout: Layout, module: str, device: torch.device) -> None:
    """fbgemm's CUDA kernels read rows in blocks of 4 floats, so off CPU every shard must be a
    multiple of 4 columns wide. On CPU, modular runs other widths through fbgemm's CPU kernel or
    the torch emulation (Note [fused tables]); off CPU it has no kernel for them yet."""
    for table, placement, shards in zip(layout.tables, layout.placements, layout.shards):
        odd = sorted({s.num_cols for s in shards if odd_width(s.num_cols)})
        if odd:
            split_badly = placement.sharding_type is ShardingType.COLUMN_WISE and not odd_width(
                table.embedding_dim
            )
            how = (
                "choose column sizes that are multiples of 4 (TablePlacement(sizes=...); the "
                "planner's are when the dim is)"
                if split_badly
                else "give the table an embedding_dim that is a multiple of 4"
            )
            raise ShardingError(
                f"table {table.name!r} of module {module!r} has shards {odd} columns wide, which "
                f"fbgemm's kernels on {device.type} cannot take (widths must be multiples of 4); "
                f"{how}"
            )


class ShardedTable(nn.Module):
    """Holds one table's `weight` under the unsharded name (a ShardedTensor, or a replica)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        # register_parameter rejects a ShardedTensor; the dict accepts it.
        self._parameters["weight"] = weight

    @property
    def weight(self) -> torch.Tensor:
        return self._parameters["weight"]

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ) -> None:
        """`load_state_dict` for one table: a full (unsharded) tensor is sliced into this rank's
        shards; a ShardedTensor must have the same shards (another plan's goes through
        `modular.checkpoint.load`, which reshards); anything else is an error naming the table."""
        key = prefix + "weight"
        if key not in state_dict:
            if strict:
                missing_keys.append(key)
            return
        value, weight = state_dict[key], self._parameters["weight"]
        if tuple(value.size()) != tuple(weight.size()):
            error_msgs.append(
                f"table weight {key!r}: the state holds shape {tuple(value.size())}, the model "
                f"{tuple(weight.size())}"
            )
            return
        with torch.no_grad():
            if not isinstance(weight, ShardedTensor):
                if isinstance(value, ShardedTensor):
                    error_msgs.append(
                        f"table weight {key!r} is replicated here but sharded in the state; "
                        "load it with modular.checkpoint.load, which reshards"
                    )
                    return
                weight.copy_(value)
                return
            if not isinstance(value, ShardedTensor):  # a full table: keep this rank's slices
                for shard in weight.local_shards():
                    (r0, c0), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                    shard.tensor.copy_(value[r0 : r0 + nr, c0 : c0 + nc])
                return
            theirs = {
                (tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes)): s.tensor
                for s in value.local_shards()
            }
            for shard in weight.local_shards():
                where = (tuple(shard.metadata.shard_offsets), tuple(shard.metadata.shard_sizes))
                if where not in theirs:
                    error_msgs.append(
                        f"table weight {key!r}: the state was sharded under another plan (no "
                        f"shard at offsets {list(where[0])} with sizes {list(where[1])} on this "
                        "rank); load it with modular.checkpoint.load, which reshards"
                    )
                    return
                shard.tensor.copy_(theirs[where])

    def extra_repr(self) -> str:
        w = self._parameters["weight"]
        kind = "sharded" if isinstance(w, ShardedTensor) else "replicated"
        return f"{kind}, size={tuple(w.size())}"


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
    tables need none of it (rank 0's replicas are broadcast), nor do meta tables (`init_fn`
    runs per shard, seeded per shard: Note [shard init])."""
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


def shard_seed(table: str, spec: ShardSpec) -> int:
    """# Note [shard init]
    A meta table's shards are initialised on different ranks, usually all seeded alike (SPMD).
    Drawing each from the global RNG would repeat one stream in every shard; instead each shard
    draws from a stream seeded by the base seed, the table and the shard's offsets, so shards are
    independent and a shard gets the same values whichever rank (or plan size) holds it."""
    text = f"{torch.initial_seed()}/{table}/{spec.row_offset}/{spec.col_offset}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1
