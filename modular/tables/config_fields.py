"""Which fields of torchrec's table configs sharding honours, and the refusal of the others.

# Note [table config fields]
Every field of torchrec's `EmbeddingBagConfig` and `EmbeddingConfig` is either honoured or
refused at `modular.shard`; none is ignored in silence, since an ignored field gives a model
that differs from the unsharded one without a word. docs/table_configs.md lists each field
with the test that holds it; tests/modular/tables/test_config_fields.py fails when the pinned
torchrec's dataclasses gain a field that list does not name.

The fields refused here only matter when set: at their default they change nothing in
torchrec's unsharded modules either, so a config refuses only when one holds another value.
Each is read by torchrec's own sharded kernels (virtual and SSD tables, ZCH buckets, inference
pruning, weight stashing, in-place embedding updates, row-wise positions for a feature
processor), which modular does not have. The check runs while each rank reads its tables, before
the plan agreement (Note [agreeing on the plan]): every rank computes it from the same configs,
and a rank whose configs differ makes every rank raise there, so no rank builds anything.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from modular.errors import ShardingError

__all__ = ["REFUSED_FIELDS", "check_config_fields"]


class Refused(NamedTuple):
    default: Any  # the only value sharding takes
    why: str  # what the field asks of torchrec's sharded modules


REFUSED_FIELDS: dict[str, Refused] = {
    "num_embeddings_post_pruning": Refused(
        None, "it sizes the pruned tables of torchrec's inference (quantised) sharding"
    ),
    "need_pos": Refused(
        False, "it makes torchrec's row-wise sharding carry each id's position to a "
        "position-weighted feature processor, and modular carries no positions",
    ),  # fmt: skip
    "input_dim": Refused(None, "torchrec reserves it for special cases it does not document"),
    "total_num_buckets": Refused(
        None, "it buckets a table's ids for torchrec's ZCH / virtual-table row-wise sharding"
    ),
    "use_virtual_table": Refused(
        False, "a virtual table's rows live in torchrec's SSD or DRAM key-value kernels"
    ),
    "virtual_table_eviction_policy": Refused(
        None, "it evicts rows of torchrec's virtual tables"
    ),
    "enable_embedding_update": Refused(
        False, "it writes rows in place through torchrec's key-value (virtual table) kernels"
    ),
    "stash_weights": Refused(False, "it stashes weights out of torchrec's TBE kernels"),
}


def check_config_fields(cfg, module: str) -> None:
    """Raises ShardingError naming the table, the field and the value sharding takes when a
    refused field of `cfg` (an EmbeddingBagConfig or EmbeddingConfig) is set (Note [table config
    fields])."""
    for field, refused in REFUSED_FIELDS.items():
        value = getattr(cfg, field)
        if value != refused.default:
            raise ShardingError(
                f"table {cfg.name!r} of module {module!r} sets {field}={value!r}, which modular "
                f"does not support: {refused.why}. Leave {field} at {refused.default!r} to shard "
                "it with modular (docs/table_configs.md lists every config field)"
            )
