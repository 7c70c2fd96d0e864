"""Composable sharded modules for recommender models.

    import modular
    opt = modular.fuse_optimizer(model, "exact_rowwise_adagrad", lr=0.1)  # optional, first
    modular.shard(model, plan)                  # EBCs and EmbeddingCollections, in place
    modular.apply_fully_shard(model, modules={MLP})  # or modular.apply_ddp(model)
    dense_opt = torch.optim.Adam(modular.local_parameters(model), lr=1e-3)
    with modular.unshard(model, tables=["ads_id"]) as full:  # full tables, written back on exit
        ...

Every call that changes the model does so in place and returns the model it was given (Note
[order of sharding calls] in modular/compose/fsdp.py). The packages follow a training step
(docs/design.md): `tables` (plan -> layout, the tables' weights), `routing` (input dist: ids to
their shards), `kernels` (lookups), `pooled` and `sequence` (each kind's lookup and output dist:
pooled columns or rows back to their samples), `fused` (the fused optimizer: its kernels, their
choice, its state and config), `compose` (FSDP2 / DDP, compile, clipping, which parameters a torch
optimizer takes), `checkpoint` and `resharding`; `collection.py` is the step both kinds share, and
`sharding.py` and `optim.py` hold the model-level calls.
"""

from modular import checkpoint
from modular import exit as _exit_hook  # noqa: F401  an atexit hook: Note [exit after destroy_process_group]
from modular.compose.clip import clip_grad_norm_
from modular.compose.compile import apply_compile
from modular.compose.ddp import apply_ddp
from modular.compose.fsdp import apply_fully_shard
from modular.compose.params import ignored_params, local_parameters
from modular.embedding import ShardedEmbeddingCollection
from modular.embedding_bag import ShardedEmbeddingBagCollection
from modular.errors import (
    CheckpointError, CollectiveError, InputError, PlanError, PlanMismatchWarning, ShardingError,
)
from modular.optim import CombinedOptimizer, FusedOptimizer, fuse_optimizer
from modular.prefetching import prefetch
from modular.replica_sync import sync_replicas
from modular.resharding import reshard
from modular.sharding import shard, sharded_modules
from modular.full_tables import unshard
from modular.tiered.tier_stats import tier_stats

__all__ = [
    "CheckpointError",
    "CollectiveError",
    "CombinedOptimizer",
    "FusedOptimizer",
    "InputError",
    "PlanError",
    "PlanMismatchWarning",
    "ShardedEmbeddingBagCollection",
    "ShardedEmbeddingCollection",
    "ShardingError",
    "apply_compile",
    "apply_ddp",
    "apply_fully_shard",
    "checkpoint",
    "clip_grad_norm_",
    "fuse_optimizer",
    "ignored_params",
    "local_parameters",
    "prefetch",
    "reshard",
    "shard",
    "sharded_modules",
    "sync_replicas",
    "tier_stats",
    "unshard",
]


def __dir__() -> list[str]:
    return sorted(__all__)
